"""FFCV as faithful as the originals: `prep ffcv` keeps each JPEG's bytes (the rest as PIL's pixels), and the loader
gives timm's pixels for the same crop box and timm's eval view, exactly (the bound BENCHMARKS.md measured: 0).

The loader compiles its pipeline with numba (seconds): one module-scoped .beton, one train and one eval loader."""

import io
import json

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image
from test_jpeg import photo_like, with_warning
from timm.data import create_transform
from torchvision.transforms import InterpolationMode

KINDS = {  # file name -> how `prep ffcv` stores it (write_mode keep)
    "a_420.JPEG": "kept", "b_progressive.JPEG": "kept", "c_grey.JPEG": "kept", "d_444.JPEG": "kept",
    "e_cmyk.JPEG": "raw", "f_png.JPEG": "raw", "g_warning.JPEG": "raw",
}


def _write(path, kind: str, seed: int) -> None:
    img = Image.fromarray(photo_like(97 + 9 * seed, 131 - 7 * seed, seed))
    if kind.startswith("a"):
        img.save(path, "JPEG", quality=90)
    elif kind.startswith("b"):
        img.save(path, "JPEG", quality=85, progressive=True)
    elif kind.startswith("c"):
        img.convert("L").save(path, "JPEG", quality=90)
    elif kind.startswith("d"):
        img.save(path, "JPEG", quality=95, subsampling=0)
    elif kind.startswith("e"):
        img.convert("CMYK").save(path, "JPEG", quality=90)
    elif kind.startswith("f"):
        img.save(path, "PNG")
    else:
        path.write_bytes(with_warning())


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants") / "tree"
    for split in ("train", "val"):
        for c in ("c0", "c1"):
            (root / split / c).mkdir(parents=True)
            for k, name in enumerate(KINDS):
                _write(root / split / c / name, name, k + (c == "c1"))
    return root


@pytest.fixture(scope="module")
def kept(tree, tmp_path_factory):
    from data_prep import PrepOptions, prepare

    out = tmp_path_factory.mktemp("kept")
    prepare(tree, out, PrepOptions(fmt="ffcv", workers=2))
    return out


def _files(tree, split):
    return [p for c in ("c0", "c1") for p in sorted((tree / split / c).iterdir())]


def _stored(beton) -> list[tuple[int, bytes]]:
    """(ffcv image mode, stored bytes) of every sample of a .beton, read back from the file."""
    from convit_scale.ffcv_threads import importing_ffcv

    with importing_ffcv():
        from ffcv.reader import Reader

    reader, data = Reader(str(beton)), beton.read_bytes()
    sizes = {int(p): int(s) for p, s in zip(reader.alloc_table["ptr"], reader.alloc_table["size"])}
    return [(int(m["mode"]), data[int(m["data_ptr"]):int(m["data_ptr"]) + sizes[int(m["data_ptr"])]])
            for m in reader.metadata["f0"]]


def test_kept_bytes_are_the_source_files_and_the_rest_pils_pixels(tree, kept):
    manifest = json.loads((kept / "manifest.json").read_text())
    for split in ("train", "val"):
        info = manifest["splits"][split]
        assert info["images"] == {"kept": 8, "raw": 6, "resized": 0}, info["images"]
        files = _files(tree, split)
        assert info["stored_raw"] == sorted(str(f) for f in files if KINDS[f.name] == "raw")
        (name,) = info["files"]
        assert name == f"{split}_full_keep_q90_f1.beton"
        for f, (mode, stored) in zip(files, _stored(kept / name), strict=True):
            if KINDS[f.name] == "kept":
                assert mode == 0 and stored == f.read_bytes(), f  # the source file, byte for byte
            else:
                assert mode == 1 and stored == np.asarray(Image.open(f).convert("RGB")).tobytes(), f


def test_loader_pixels_are_timms_for_the_same_crop_boxes(tree, kept):
    """Eval: timm's transform (resize to 256/224 of the size, centre crop). Train: timm's resized crop of the box
    the view's seed draws, flipped as drawn. Every kind of file, JPEG or raw, gives exactly timm's pixels. The train
    decoder decodes each kept JPEG's crop box alone (jpeg_roi: one box per view whose box is not the whole image,
    none refused; the loader's threads are this process's); the eval decoder decodes whole images (turbojpeg)."""
    from convit_scale import jpeg_roi
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader
    from convit_scale.data.ffcv_decoders import FILE_INDEX, ID_BITS, seeded_crop
    from convit_scale.splitmix_numba import FLIP_DRAW, uniform

    d = DataConfig(format="ffcv", train_path=str(kept), val_path=str(kept), num_workers=1, repeated_aug=1)
    val = build_loader(d, LoaderSpec("val", 48, 7, augment_on_device=True))
    timm_eval = create_transform(48, is_training=False, interpolation="bicubic", crop_pct=0.875, use_prefetcher=True)
    files = _files(tree, "val")
    before = jpeg_roi.counts()
    images = torch.cat([b.images for b in val.epoch(0)])
    after_eval = jpeg_roi.counts()
    assert (after_eval["decoded"], after_eval["refused"]) == (before["decoded"], before["refused"])
    for f, x in zip(files, images, strict=True):
        assert torch.equal(x, timm_eval(Image.open(f).convert("RGB"))), f
    train = build_loader(d, LoaderSpec("train", 40, 7, augment_on_device=True))
    files, views = _files(tree, "train"), train.views(0)
    before = jpeg_roi.counts()
    images = torch.cat([b.images for b in train.epoch(0)])
    after = jpeg_roi.counts()
    ratio = np.log(np.array((3 / 4, 4 / 3)))
    boxes = 0
    for view, x in zip(views, images, strict=True):
        img = Image.open(files[int(view & FILE_INDEX)]).convert("RGB")
        seed = view >> ID_BITS
        i, j, h, w = seeded_crop(img.size[1], img.size[0], np.array(d.crop_scale), ratio, seed)
        boxes += KINDS[files[int(view & FILE_INDEX)].name] == "kept" and (h, w) != (img.size[1], img.size[0])
        ref = F.resized_crop(img, i, j, h, w, [40, 40], InterpolationMode.BICUBIC)
        if uniform(seed, FLIP_DRAW) < d.hflip:
            ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
        assert torch.equal(x, torch.from_numpy(np.array(ref)).permute(2, 0, 1)), (
            files[int(view & FILE_INDEX)], i, j, h, w)
    assert after["decoded"] - before["decoded"] == boxes > 0 and after["refused"] == before["refused"], (
        before, after, boxes)


def test_fashion_mnist_keeps_every_file(fm_tree, fm_ffcv):
    manifest = json.loads((fm_ffcv / "manifest.json").read_text())
    info = manifest["splits"]["val"]
    assert info["images"] == {"kept": info["num_samples"], "raw": 0, "resized": 0}
    files = [p for c in manifest["classes"] for p in sorted((fm_tree / "val" / c).iterdir())]
    (name,) = info["files"]
    assert [s for _, s in _stored(fm_ffcv / name)] == [f.read_bytes() for f in files]


def test_the_earlier_re_encoding_on_request_and_shrinking_only_large_images(tree, tmp_path):
    """--write-mode jpg --max-resolution N: ffcv's own writer, every image decoded, shrunk and re-encoded (the
    earlier default, N = 384); keep with --max-resolution: only the larger images are shrunk and re-encoded."""
    from data_prep import PrepOptions, prepare

    old = prepare(tree, tmp_path / "old", PrepOptions(fmt="ffcv", write_mode="jpg", max_resolution=64,
                                                      splits=("train",), workers=2)).to_dict()
    (name,) = old["splits"]["train"]["files"]
    assert name == "train_64_jpg_q90_f1.beton" and "images" not in old["splits"]["train"]
    for f, (mode, stored) in zip(_files(tree, "train"), _stored(tmp_path / "old" / name), strict=True):
        assert mode == 0 and stored != f.read_bytes() and max(Image.open(io.BytesIO(stored)).size) <= 64
    small = prepare(tree, tmp_path / "mixed", PrepOptions(fmt="ffcv", max_resolution=128, splits=("train",),
                                                          workers=2)).to_dict()
    counts = small["splits"]["train"]["images"]
    large = sum(max(Image.open(f).size) > 128 for f in _files(tree, "train"))
    assert counts["resized"] == large > 0 and counts["kept"] + counts["raw"] + large == 14


def test_num_classes_keeps_the_first_classes_only(tree, tmp_path):
    from data_prep import PrepOptions, prepare

    m = prepare(tree, tmp_path / "one", PrepOptions(fmt="wds", num_classes=1, workers=2, shard_size=100)).to_dict()
    assert m["classes"] == ["c0"]
    for split in ("train", "val"):
        assert m["splits"][split]["per_class"] == {"0": 7} and m["splits"][split]["skipped"] == []
