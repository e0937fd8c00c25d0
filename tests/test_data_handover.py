"""What a training loader hands the training device (``data.resize_on``, ``data.decode_on``; device_images.py): the
crop boxes at their own size ("box") or the views undecoded ("jpeg"), with the same views, boxes, flips, labels,
seeds and ids as the loader that resizes on the CPU ("pixels"), in every format, at any rank and after a resume;
finished on the device, the same crops within a level; a view the device cannot decode replaced within its group."""

import io
import itertools
import re

import numpy as np
import pytest
import torch
from PIL import Image
from support import losses, tiny_recipe, train_here

from convit_scale.config import ConfigError, DataConfig, load_config
from convit_scale.data import LoaderSpec, build_loader
from convit_scale.data.batch import Batch, Boxes, Encoded
from convit_scale.data.device_augment import handover_of
from convit_scale.data.device_images import StepImages, batch_on_device

CPU = torch.device("cpu")
CROP_ONLY = {"repeated_aug": 1, "rand_augment": None, "color_jitter": 0.0, "reprob": 0.0}
MODES = [("imagefolder", "box"), ("wds", "box"), ("wds", "jpeg"), ("ffcv", "box"), ("ffcv", "jpeg")]


def _loader(fmt, path, handover, rank=0, world=1):
    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), num_workers=0, global_batch_size=32,
                   canonical_groups=4, **CROP_ONLY)
    spec = LoaderSpec("train", 28, 32 // world, world, rank, seed=3, augment_on_device=True, handover=handover,
                      global_batch_size=32, canonical_groups=4)
    return build_loader(d, spec), spec


@pytest.mark.parametrize("fmt, handover", MODES)
def test_handed_over_views_are_the_pixel_modes_views(fmt, handover, fm_tree, fm_wds, fm_ffcv):
    """Batches 0-4 of one rank, and batches 3-4 of the second of two ranks resumed at batch 3 (a mid-epoch resume on
    another world size): the pixel mode's views within a level, and the second half of the one-rank batches exactly
    (the same views finished on the device alike at any world size and resume position)."""
    path = {"imagefolder": fm_tree, "wds": fm_wds, "ffcv": fm_ffcv}[fmt]
    finished = []
    for rank, world, start, count in ((0, 1, 0, 5), (1, 2, 3, 2)):
        pixels, spec = _loader(fmt, path, "pixels", rank, world)
        handed, _ = _loader(fmt, path, handover, rank, world)
        kind = Boxes if handover == "box" else Encoded
        finished.append([])
        for a, b in itertools.islice(zip(pixels.epoch(1, start), handed.epoch(1, start)), count):
            assert isinstance(b.images, kind) and len(b.images) == len(a.labels)
            assert torch.equal(a.labels, b.labels) and torch.equal(a.seeds, b.seeds) and a.ids == b.ids
            x, y = batch_on_device(b, CPU, 28, spec.group_size)
            assert x.dtype == torch.uint8 and x.shape == a.images.shape and torch.equal(y, a.labels)
            diff = (x.int() - a.images.contiguous().int()).abs()
            assert diff.max() <= 1, f"{fmt} {handover}: {diff.max()} levels from the CPU resize"
            finished[-1].append((x, y, b.seeds, b.ids))
    for (x, y, seeds, ids), (x1, y1, seeds1, ids1) in zip(finished[1], finished[0][3:], strict=True):
        assert ids == ids1[16:] and torch.equal(seeds, seeds1[16:]) and torch.equal(y, y1[16:])
        assert torch.equal(x, x1[16:]), f"{fmt} {handover}: resumed on rank 1 of 2, other pixels than on one rank"


def test_a_repeated_micro_batch_is_decoded_once(fm_wds):
    """Rank 1 of 3 holding one of 4 canonical groups repeats its micro-batch with weight 0 (data/steps.py): the
    training step's ``StepImages`` gives the repeat the images decoded for the micro-batch before it, not a second
    decode and resize, and keeps nothing past it (the next step's micro-batch is decoded)."""
    d = DataConfig(format="wds", train_path=str(fm_wds), val_path=str(fm_wds), num_workers=0, global_batch_size=32,
                   canonical_groups=4, **CROP_ONLY)
    spec = LoaderSpec("train", 28, 8, 3, 1, seed=3, augment_on_device=True, handover="jpeg", global_batch_size=32,
                      canonical_groups=4)
    assert [p.samples for p in spec.micro_parts] == [8, 0]
    on_device, made = StepImages(CPU, 28, spec.group_size), []
    for m, b in enumerate(itertools.islice(build_loader(d, spec).epoch(0), 4)):
        assert isinstance(b.images, Encoded)
        made.append(on_device(b, repeated_next=m % 2 == 0))
    for step in range(2):
        (x, y), (x_again, y_again) = made[2 * step], made[2 * step + 1]
        assert x_again is x and y_again is y
    assert not torch.equal(made[2][0], made[0][0]) and on_device._held is None
    # made early with its augmentation (the next step's first micro-batch): the augmented images once, for that
    # micro-batch; its repeat is augmented in its turn from the same uint8 images, which nothing changed
    batches = list(itertools.islice(build_loader(d, spec).epoch(0), 2))
    augmented = []
    on_device.prepare(batches[0], lambda x, seeds: augmented.append(x.clone()) or x.float() + 1)
    x, _ = on_device(batches[0], repeated_next=True)
    early = on_device.augmented(batches[0])
    assert torch.equal(early, x.float() + 1) and torch.equal(augmented[0], x)
    repeat = Batch(batches[0].images, batches[0].labels, batches[0].seeds, (), [])  # data/steps.py's repeat
    assert on_device(repeat, repeated_next=False)[0] is x and on_device.augmented(repeat) is None
    first = next(iter(build_loader(d, spec).epoch(0)))
    assert torch.equal(batch_on_device(first, CPU, 28, spec.group_size)[0], made[0][0])


def test_boxes_and_encoded_views_cut_and_join_as_tensors_do():
    crops = [(np.full((h, w, 3), k, np.uint8), k % 2 == 0) for k, (h, w) in enumerate([(2, 3), (4, 1), (3, 3)])]
    boxes = Boxes.of(crops)
    assert boxes.sizes.tolist() == [[2, 3], [4, 1], [3, 3]] and boxes.flips.tolist() == [True, False, True]
    joined = Boxes.cat([boxes[0:1], boxes[1:3]])
    assert torch.equal(joined.pixels, boxes.pixels) and torch.equal(joined.sizes, boxes.sizes)
    picked = boxes[torch.tensor([2, 0])]
    assert picked.pixels.tolist() == [2] * 27 + [0] * 18
    views = Encoded.of([(b"\x01\x02", Encoded.JPEG, (5, 6), (0, 1, 2, 3), True),
                        (np.zeros((1, 2, 3), np.uint8), Encoded.RAW, (1, 2), (0, 0, 1, 2), False)])
    assert views.meta.tolist() == [[2, 0, 5, 6, 0, 1, 2, 3], [6, 1, 1, 2, 0, 0, 1, 2]]
    assert [p.tolist() for p in views[1:].payloads()] == [[0] * 6]


def _jpeg(colour, size=(20, 16)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG", quality=95)
    return out.getvalue()


def test_a_view_the_device_cannot_decode_takes_the_next_of_its_group():
    """Views 0-3 in groups of 2: view 0 is corrupt (replaced by view 1, its label too); view 3 is not a JPEG the
    device decodes but PIL does (a grey-scale PNG handed over as raw pixels decodes on the host: not replaced)."""
    grey = np.asarray(Image.new("L", (16, 20), 99).convert("RGB"))
    views = Encoded.of([(b"\xff\xd8\xff\xe0 not a jpeg", Encoded.JPEG, (20, 16), (0, 0, 20, 16), False),
                        (_jpeg((200, 10, 10)), Encoded.JPEG, (16, 20), (2, 2, 10, 10), False),
                        (_jpeg((10, 200, 10)), Encoded.JPEG, (16, 20), (0, 0, 16, 20), True),
                        (grey, Encoded.RAW, (20, 16), (0, 0, 20, 16), False)])
    batch = Batch(views, torch.tensor([0, 1, 2, 3]), ids=["a", "b", "c", "d"])
    x, y = batch_on_device(batch, CPU, 8, group=2)
    assert y.tolist() == [1, 1, 2, 3] and torch.equal(x[0], x[1])
    assert [r["key"] for r in batch.bad] == ["a"] and "undecodable JPEG" in batch.bad[0]["reason"]
    assert abs(int(x[1, 0].float().mean()) - 200) <= 3 and abs(int(x[3].float().mean()) - 99) <= 1


def test_a_file_the_device_decoder_refuses_is_decoded_on_the_host_and_counted():
    from convit_scale.data import device_images

    png = io.BytesIO()
    Image.new("RGB", (12, 10), (30, 60, 90)).save(png, format="PNG")  # a PNG named .JPEG: torchvision refuses it
    before = device_images.REFUSED[0]
    views = Encoded.of([(png.getvalue(), Encoded.JPEG, (10, 12), (0, 0, 10, 12), False),
                        (_jpeg((10, 200, 10)), Encoded.JPEG, (16, 20), (0, 0, 16, 20), False)])
    batch = Batch(views, torch.tensor([4, 5]), ids=["p", "j"])
    x, y = batch_on_device(batch, CPU, 8, group=2)
    assert device_images.REFUSED[0] == before + 1 and not batch.bad and y.tolist() == [4, 5]
    assert x[0, :, 0, 0].tolist() == [30, 60, 90]


def test_a_mixed_batch_decodes_its_jpegs_in_one_call_and_moves_the_others_in_one_copy(monkeypatch):
    """JPEGs, PNGs under a .JPEG name (PIL decodes them: counted) and images the loader decoded (raw pixels): the
    JPEGs in one call of the device's decoder, the others cut on the host and moved together, so the kernels a
    batch runs do not grow with its host-decoded views (no copy, no wait per image); each view's pixels are those it
    gets in a batch of its own."""
    from test_data_device_resize import _counted, _OpCounter

    from convit_scale.data import device_images

    def png(colour) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (12, 10), colour).save(out, format="PNG")
        return out.getvalue()

    grey = np.asarray(Image.new("L", (16, 20), 99).convert("RGB"))
    jpegs = [(_jpeg((200, 10, 10)), Encoded.JPEG, (16, 20), (2, 2, 10, 10), False),
             (_jpeg((10, 200, 10)), Encoded.JPEG, (16, 20), (0, 0, 16, 20), True)]
    host = [[(png((30, 60, 90 + k)), Encoded.JPEG, (10, 12), (1, 0, 9, 12), k % 2 == 0),
             (grey + k, Encoded.RAW, (20, 16), (k, 0, 20 - k, 16), False)] for k in range(3)]
    small, large = jpegs + host[0], jpegs + [v for pair in host for v in pair]
    calls, counts, before = _counted(monkeypatch), [], device_images.REFUSED[0]
    for views in (small, large):
        with _OpCounter() as counter:
            x, y = batch_on_device(Batch(Encoded.of(views), torch.arange(len(views))), CPU, 8, group=2)
        counts.append(counter.ops)
        alone = [batch_on_device(Batch(Encoded.of([v]), torch.tensor([0])), CPU, 8, group=1)[0][0] for v in views]
        assert torch.equal(x, torch.stack(alone)) and y.tolist() == list(range(len(views)))
    # per batch: one call for its 2 JPEGs, then one for each JPEG alone; no kernel more for 4 more host images
    assert calls == [(2, True), (1, True), (1, True)] * 2 and counts[0] == counts[1], (calls, counts)
    assert device_images.REFUSED[0] - before == 8, device_images.REFUSED[0] - before  # PNGs: 1 + 3 batched, 1 + 3 alone
    assert x[2, :, 0, 0].tolist() == [30, 60, 90] and x[3].float().mean() == 99


def test_where_the_work_runs_is_resolved_and_refused_before_any_process():
    cuda = torch.device("cuda")
    assert handover_of(DataConfig(), cuda) == "box" and handover_of(DataConfig(), CPU) == "pixels"
    assert handover_of(DataConfig(resize_on="device"), CPU) == "box"
    assert handover_of(DataConfig(decode_on="device"), CPU) == "jpeg"
    assert handover_of(DataConfig(resize_on="cpu"), cuda) == "pixels"
    assert handover_of(DataConfig(augment_on="cpu"), cuda) == "pixels"
    for overrides, needle in ((["data.resize_on=device", "data.augment_on=cpu"], "data.augment_on: cpu"),
                              (["data.decode_on=device", "data.resize_on=cpu"], "data.resize_on must be device"),
                              (["data.decode_on=device", "data.format=imagefolder"], "format ffcv or wds"),
                              (["data.resize_on=device", "data.interpolation=bilinear"], "bicubic")):
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert needle in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.slow
@pytest.mark.parametrize("fmt, key", [("imagefolder", "resize_on"), ("wds", "decode_on")])
def test_training_with_the_work_on_the_device_resumes_bit_identically(fmt, key, fm_tree, fm_wds, tmp_path, capsys):
    """One process: 4 steps uninterrupted against 2, stopped (a checkpoint) and resumed, the paper's augmentation
    on; the same losses."""
    path = {"imagefolder": fm_tree, "wds": fm_wds}[fmt]
    kw = dict(data={key: "device", "num_workers": 1, "repeated_aug": 1},
              parallel={"strategy": "none", "precision": "fp32"}, checkpoint={"every_steps": 2})
    full = tiny_recipe(tmp_path / "a.yaml", fmt, path, tmp_path / "a", schedule={"max_steps": 4}, **kw)
    assert train_here(full) == 0
    part = tiny_recipe(tmp_path / "b.yaml", fmt, path, tmp_path / "b", schedule={"max_steps": 2}, **kw)
    assert train_here(part) == 0
    capsys.readouterr()
    assert train_here(part, "schedule.max_steps=4") == 0
    assert "resumed from" in capsys.readouterr().out
    assert len(losses(tmp_path / "a")) == 4 and losses(tmp_path / "b") == losses(tmp_path / "a")


def test_a_decoder_that_refuses_whole_batches_ends_the_run_as_bad_input(fm_wds, tmp_path, capsys, monkeypatch):
    """Training with decode_on device whose decoder refuses every JPEG (a broken nvJPEG installation, emulated: a
    file's status for each): the first step's packed reduction tells every rank, which raise it as a DataError (exit
    2: no restart repeats it), naming what to set; no rank ends alone."""
    from convit_scale.data import device_resize

    def refusing(data, device):
        raise RuntimeError("Failed to decode batch: 3")

    monkeypatch.setattr(device_resize, "_decode", refusing)
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", fm_wds, tmp_path / "run", schedule={"max_steps": 3},
                         data={"decode_on": "device", "num_workers": 0, "repeated_aug": 1},
                         parallel={"strategy": "none", "precision": "fp32"})
    assert train_here(recipe) == 2
    err = capsys.readouterr().err
    assert re.search(r"step 1: the device's decoder \(cpu\) refused all \d+ JPEGs .*set data.decode_on=cpu", err), err
    assert not losses(tmp_path / "run")


@pytest.mark.parametrize("on_device", [False, True])
def test_imagefolder_and_ffcv_give_a_view_the_same_pixels(on_device, fm_tree, fm_ffcv):
    """The sample contract (data/sample.py): the same views at the same positions, each with the same crop box and
    flip (drawn from its seed), and the augmentation after them (RandAugment, erasing) drawn alike: the PIL path of
    ImageFolder and FFCV's compiled one give the same batches, bit for bit, with the paper's augmentation on."""
    batches = []
    for fmt, path in (("imagefolder", fm_tree), ("ffcv", fm_ffcv)):
        d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), global_batch_size=32, num_workers=0,
                       repeated_aug=1)
        spec = LoaderSpec("train", 28, 16, augment_on_device=on_device, global_batch_size=32, canonical_groups=2)
        batches.append(list(itertools.islice(build_loader(d, spec).epoch(2, start_batch=1), 2)))
    for a, b in zip(*batches, strict=True):
        assert a.ids == b.ids and torch.equal(a.labels, b.labels) and torch.equal(a.seeds, b.seeds)
        assert torch.equal(a.images.contiguous(), b.images.contiguous())


def test_a_micro_batch_slice_is_a_view_of_the_steps_memory():
    boxes = Boxes.of([(np.full((2, 2, 3), k, np.uint8), bool(k % 2)) for k in range(4)])
    part = boxes[1:3]
    assert part.pixels.data_ptr() == boxes.pixels[12:].data_ptr() and part.pixels.tolist() == [1] * 12 + [2] * 12
    assert part.flips.tolist() == [True, False] and torch.equal(Boxes.cat([boxes[:1], part, boxes[3:]]).pixels,
                                                                boxes.pixels)
    views = Encoded.of([(bytes([k]) * (k + 1), Encoded.JPEG, (1, 1), (0, 0, 1, 1), False) for k in range(3)])
    assert [p.tolist() for p in views[1:].payloads()] == [[1, 1], [2, 2, 2]]
    assert views[1:].data.data_ptr() == views.data[1:].data_ptr()


def test_an_ffcv_file_whose_hand_over_would_not_fit_resizes_on_the_cpu_or_is_refused(fm_ffcv, monkeypatch, capsys):
    """Where the slots packing the first epoch's largest batch would pass the budget, resize_on auto keeps the CPU
    resize and says so; resize_on device is refused."""
    from convit_scale.data import DataError, ffcv

    monkeypatch.setattr(ffcv, "HANDOVER_BUDGET_BYTES", 1000)
    auto, _ = _loader("ffcv", fm_ffcv, "box")
    assert auto.handover == "pixels" and "resized on the CPU" in capsys.readouterr().out
    assert isinstance(next(iter(auto.epoch(0))).images, torch.Tensor)
    d = DataConfig(format="ffcv", train_path=str(fm_ffcv), val_path=str(fm_ffcv), resize_on="device", num_workers=0)
    with pytest.raises(DataError, match=r"GiB of loader buffers per rank .* --max-resolution 512"):
        build_loader(d, LoaderSpec("train", 28, 16, augment_on_device=True, handover="box"))


@pytest.fixture(scope="module")
def originals_ffcv(tmp_path_factory):
    """A .beton that keeps its originals (``prep ffcv``'s default): 63 small photographs and one of 1200 x 900."""
    from data_prep import PrepOptions, prepare

    tree = tmp_path_factory.mktemp("originals") / "tree"
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for k in range(64 if split == "train" else 8):
            size = (900, 1200) if (split, k) == ("train", 17) else (30 + k % 7, 40 + k % 5)
            folder = tree / split / f"c{k % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (np.add.outer(np.arange(size[0]), np.arange(size[1])) % 256).astype(np.uint8)
            image = np.stack([pixels, pixels[::-1], rng.integers(0, 256, size, dtype=np.uint8)], axis=-1)
            Image.fromarray(image).save(folder / f"{k:03d}.JPEG", quality=90)
    out = tmp_path_factory.mktemp("originals_ffcv")
    prepare(tree, out, PrepOptions(fmt="ffcv", workers=1))
    return out


def _same_as_the_pixel_mode(handed, pixels, spec, epoch=0):
    for a, b in zip(pixels.epoch(epoch), handed.epoch(epoch), strict=True):
        assert torch.equal(a.labels, b.labels) and a.ids == b.ids and a.bad == b.bad
        x, _ = batch_on_device(b, CPU, 28, spec.group_size)
        assert (x.int() - a.images.contiguous().int()).abs().max() <= 1


def test_a_beton_of_originals_hands_over_in_slots_sized_for_its_batches_not_its_largest_photograph(
        originals_ffcv, monkeypatch):
    """Each slot packs its batch: 5 slots of the largest batch's boxes, not 32 views x 5 slots of rows sized for the
    1200 x 900 photograph (518 MB): under a 64 MB budget the boxes are still handed over, with the pixel mode's views.
    An epoch whose largest batch is larger than the slots makes them again, before its first batch."""
    from ffcv.reader import Reader

    from convit_scale.data import ffcv
    from convit_scale.data.ffcv_decoders import handover_bytes

    monkeypatch.setattr(ffcv, "HANDOVER_BUDGET_BYTES", 64 * 2**20)
    monkeypatch.setattr(ffcv, "ARENA_MARGIN", 1.0)
    seen = []
    unpack = ffcv.unpack_views
    monkeypatch.setattr(ffcv, "unpack_views", lambda arena, *a: seen.append(arena.shape[1]) or unpack(arena, *a))
    handed, spec = _loader("ffcv", originals_ffcv, "box")
    pixels, _ = _loader("ffcv", originals_ffcv, "pixels")
    first = handed._arena
    assert handed.handover == "box" and first * 5 < 16 * 2**20
    _same_as_the_pixel_mode(handed, pixels, spec)
    reader = Reader(str(next(originals_ffcv.glob("train*.beton"))))
    later = next(e for e in range(1, 100) if handover_bytes("box", reader, "image", handed.views(e), 32) > first)
    _same_as_the_pixel_mode(handed, pixels, spec, later)
    assert handed._packer.arena == handover_bytes("box", reader, "image", handed.views(later), 32) > first
    assert seen == [first] * 2 + [handed._packer.arena] * 2


def _damaged_copy(originals_ffcv, tmp_path, damage):
    """A copy of the .beton of originals with ``damage(meta)``'s {image index: (offset, bytes)} written over those
    images' stored bytes (``meta``: the image field's metadata); the copy's folder."""
    import shutil

    from ffcv.reader import Reader

    path = tmp_path / "ffcv"
    shutil.copytree(originals_ffcv, path)
    beton = next(path.glob("train*.beton"))
    reader = Reader(str(beton))
    meta = reader.metadata[f"f{reader.field_names.index('image')}"]
    with open(beton, "r+b") as f:
        for k, (offset, data) in damage(meta).items():
            f.seek(int(meta["data_ptr"][k]) + offset)
            f.write(data)
    return path


def _large(meta) -> int:
    """The index of the 1200 x 900 photograph."""
    return int(np.flatnonzero(meta["height"] == 900)[0])


def test_a_replacement_that_does_not_fit_its_slot_is_packed_into_memory_of_its_own(originals_ffcv, tmp_path,
                                                                                  monkeypatch):
    """A corrupt JPEG just before the large photograph in its canonical group takes the photograph's box (drawn
    with its own seed), which the slot, sized for the batch's own boxes, cannot hold: the batch is packed into memory
    of its own, with the pixel mode's views and its listed replacement; the other batches use the slot."""
    from convit_scale.data import ffcv
    from convit_scale.data.ffcv_decoders import ARENA_MARGIN, FILE_INDEX

    monkeypatch.setattr(ffcv, "ARENA_MARGIN", 1.0)
    order = _loader("ffcv", originals_ffcv, "box")[0].views(0) & FILE_INDEX  # the copy's views are the original's

    def before_the_photograph(meta):  # the view before the photograph's, cyclically in its group
        p = int(np.flatnonzero(order == _large(meta))[0])
        return {int(order[p - 1 if p % 8 else p + 7]): (0, b"\0\0\0\0")}

    path = _damaged_copy(originals_ffcv, tmp_path, before_the_photograph)
    seen = []
    unpack = ffcv.unpack_views
    monkeypatch.setattr(ffcv, "unpack_views", lambda arena, *a: seen.append(arena.shape[1]) or unpack(arena, *a))
    handed, spec = _loader("ffcv", path, "box")
    assert ARENA_MARGIN > 1.0 and handed.handover == "box"
    _same_as_the_pixel_mode(handed, _loader("ffcv", path, "pixels")[0], spec)
    assert len(seen) == 2 and max(seen) > handed._packer.arena and min(seen) == handed._packer.arena == handed._arena


def test_a_truncated_photograph_decoded_whole_before_it_is_refused_never_writes_into_the_slot(originals_ffcv,
                                                                                               tmp_path, monkeypatch):
    """The large photograph cut short mid-scan: the crop-region decoder refuses it, the whole decode writes all its
    900 rows (3.2 MB) before turbojpeg refuses it too. That decode goes to a row of the slot's own, not into the
    packed arena sized for the batch's boxes (where it overran the slot: a corrupted heap, the process aborted); the
    view is replaced as in the pixel mode, in every epoch."""
    from convit_scale.data import ffcv

    monkeypatch.setattr(ffcv, "ARENA_MARGIN", 1.0)
    path = _damaged_copy(originals_ffcv, tmp_path,  # inside the scan: an end-of-image marker, then nothing
                         lambda meta: {_large(meta): (20_000, b"\xff\xd9" + b"\0" * 64)})
    handed, spec = _loader("ffcv", path, "box")
    pixels, _ = _loader("ffcv", path, "pixels")
    assert handed.handover == "box" and handed._arena < 900 * 1200 * 3
    for epoch in range(3):
        _same_as_the_pixel_mode(handed, pixels, spec, epoch)
        assert sum(len(b.bad) for b in handed.epoch(epoch)) == 1


@pytest.mark.parametrize("handover", ["box", "pixels"])
def test_a_canonical_group_of_which_no_view_decodes_is_refused_by_name(originals_ffcv, tmp_path, handover):
    """Every JPEG of the first batch's first canonical group corrupt: the batch is refused, naming the group's
    files, in the box mode as in the pixel mode."""
    from convit_scale.data import DataError
    from convit_scale.data.ffcv_decoders import FILE_INDEX

    loader, spec = _loader("ffcv", originals_ffcv, handover)
    order = loader.views(0) & FILE_INDEX
    path = _damaged_copy(originals_ffcv, tmp_path,
                         lambda meta: {k: (0, b"\0\0\0\0") for k in set(order[:spec.group_size].tolist())})
    loader, spec = _loader("ffcv", path, handover)
    names = str((order[:4]).tolist())[:-1]
    with pytest.raises(DataError, match=rf"no decodable image in a group of {spec.group_size} \(file indices "
                                        rf"{re.escape(names)}"):
        next(iter(loader.epoch(0)))


def test_views_no_decoder_reads_count_against_the_limit_on_every_rank_alike():
    from types import SimpleNamespace

    from convit_scale.data import DataError
    from convit_scale.train.step import _limit_device_bad

    run = SimpleNamespace(device_bad={}, cfg=SimpleNamespace(data=DataConfig(max_bad_samples=1)),
                          ctx=SimpleNamespace(world_size=2))
    state = SimpleNamespace(epoch=3)
    bad = [{"key": "a", "reason": "undecodable JPEG (x)", "device": True}, {"file": "f", "reason": "loader's"}]
    _limit_device_bad(run, state, bad)
    _limit_device_bad(run, state, bad)  # 2 of the 2 a 2-rank epoch allows
    with pytest.raises(DataError, match=r"3 views no decoder could read in epoch 3 .* \(the last: a, undecodable"):
        _limit_device_bad(run, state, bad)
