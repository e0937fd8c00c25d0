"""The batched device resize (data/device_resize.py) is PIL's bicubic resize, image for image: against PIL on odd sizes,
flips, independent of the batch around an image, in a number of kernels that does not grow with the batch; the
device decode's crops are timm's pixels, and files its decoder refuses are decoded by PIL and counted, the others
still in batched calls; an out-of-memory error is never taken for a refused file."""

import io
import re

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image
from test_jpeg import encode, photo_like
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms import InterpolationMode

from convit_scale.data import device_resize
from convit_scale.data.device_resize import decode_crop_resize, device_decodable, resize_list, resize_packed

SIZE = 32
# upscale, 1-pixel edges, downscale by large factors, non-square, PIL's vertical-first rule (h > 100 w, shrunk)
SHAPES = [(1, 1), (1, 9), (9, 1), (5, 3), (40, 30), (32, 32), (33, 31), (1000, 23), (23, 1000), (250, 2),
          (300, 3), (201, 2), (2, 250), (120, 360), (64, 17)]


def _pil(pixels: np.ndarray, flip: bool = False) -> np.ndarray:
    out = np.asarray(Image.fromarray(pixels).resize((SIZE, SIZE), Image.BICUBIC))
    return out[:, ::-1] if flip else out


def _packed(images):
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in images]))
    return flat, torch.tensor([a.shape[:2] for a in images])


def _hwc(t: torch.Tensor) -> np.ndarray:
    return t.permute(1, 2, 0).numpy()


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SHAPES]


def test_resize_packed_is_pils_bicubic_resize_with_flips(images):
    flips = torch.tensor([i % 3 == 1 for i in range(len(images))])
    out = resize_packed(*_packed(images), SIZE, flips)
    assert out.shape == (len(images), 3, SIZE, SIZE) and out.dtype == torch.uint8
    for img, o, f in zip(images, out, flips.tolist()):
        diff = np.abs(_hwc(o).astype(int) - _pil(img, f)).max()
        assert diff == 0, f"{img.shape[:2]} flip={f}: {diff} levels from PIL"
    as_float = resize_packed(*_packed(images), SIZE, flips, out_dtype=torch.float32)
    assert as_float.dtype == torch.float32 and torch.equal(as_float, out.float())


def test_an_image_does_not_depend_on_its_batch_or_chunks(images):
    """Alone, beside larger images (more padding), in another order, in chunks of one image: the same bytes."""
    alone = [resize_packed(*_packed([img]), SIZE)[0] for img in images[4:7]]
    big = np.full((700, 650, 3), 255, np.uint8)
    mixed = [big, images[4], images[0], images[5], big, images[6]]
    batch = resize_packed(*_packed(mixed), SIZE)
    chunked = resize_packed(*_packed(mixed), SIZE, chunk_bytes=1)
    assert torch.equal(batch, chunked)
    for a, b in zip(alone, batch[[1, 3, 5]]):
        assert torch.equal(a, b)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run kernels (views only make metadata: resize_list makes one per image)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _ops(call) -> int:
    with _OpCounter() as counter:
        call()
    return counter.ops


def test_the_number_of_ops_does_not_grow_with_the_batch():
    rng = np.random.default_rng(1)
    shapes = [(int(rng.integers(8, 60)), int(rng.integers(8, 60))) for _ in range(16)]
    imgs = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    flips = torch.from_numpy(rng.random(16) < 0.5)
    (small, small_sizes), (large, large_sizes), few = _packed(imgs[:2]), _packed(imgs), flips[:2].clone()
    counts = _ops(lambda: resize_packed(small, small_sizes, SIZE, few)), _ops(
        lambda: resize_packed(large, large_sizes, SIZE, flips))
    assert counts[0] == counts[1] and counts[0] < 300, counts
    views = [torch.from_numpy(a).permute(2, 0, 1).contiguous()[:, 1:, 2:] for a in imgs]
    two = views[:2]
    assert _ops(lambda: resize_list(two, SIZE)) == _ops(lambda: resize_list(views, SIZE))


def test_resize_list_takes_crop_views_in_either_layout(images):
    """Crops of CHW images (views), HWC images, and a list mixing both: resize_packed's output for the same boxes."""
    boxes = [(0, 0, 1, 1), (3, 2, 20, 9), (1, 1, 31, 29), (0, 5, 30, 25)]
    full = [img for img in images if img.shape[0] >= 31 and img.shape[1] >= 30][:4]
    crops = [f[t:t + h, left:left + w] for f, (t, left, h, w) in zip(full, boxes)]
    want = resize_packed(*_packed([np.ascontiguousarray(c) for c in crops]), SIZE)
    chw = [torch.from_numpy(f).permute(2, 0, 1).contiguous() for f in full]
    views = [c[:, t:t + h, left:left + w] for c, (t, left, h, w) in zip(chw, boxes)]
    assert torch.equal(resize_list(views, SIZE), want)
    hwc = [torch.from_numpy(c) for c in crops]
    assert torch.equal(resize_list(hwc, SIZE, layout="HWC"), want)
    assert torch.equal(resize_list([views[0], hwc[1], views[2], hwc[3]], SIZE), want)
    planes = [v.contiguous().permute(1, 2, 0) for v in views]  # HWC views of CHW memory: a pixel step of 1
    assert torch.equal(resize_list(planes, SIZE, layout="HWC"), want)
    # beside interleaved HWC images, which are copied into planes first
    assert torch.equal(resize_list([planes[0], hwc[1], planes[2], hwc[3]], SIZE, layout="HWC"), want)


def test_a_crop_of_a_chw_image_is_packed_plane_by_plane(monkeypatch):
    """The buffer a batch is resized from holds each CHW crop's three plane spans (3 x ((h - 1) x W + w) bytes), not
    the span across its planes, which is most of the whole decoded image (2 x H x W more)."""
    packed, real = [], device_resize._resize_rows
    monkeypatch.setattr(device_resize, "_resize_rows",
                        lambda rows, *a: packed.append(rows.flat.numel()) or real(rows, *a))
    img = torch.randint(0, 256, (3, 400, 300), dtype=torch.uint8)
    crop = img[:, 100:120, 50:90]  # h = 20, w = 40 of W = 300
    out = resize_list([crop], SIZE)
    plane = (20 - 1) * 300 + 40
    assert packed == [3 * plane + (40 - 1)]  # the planes, then a row's padding
    assert torch.equal(out, resize_list([crop.contiguous()], SIZE))


def test_bad_input_is_refused_with_a_clear_error(images):
    flat, sizes = _packed(images[:3])
    with pytest.raises(ValueError, match="flat holds"):
        resize_packed(flat[:-1], sizes, SIZE)
    with pytest.raises(ValueError, match="flips must be"):
        resize_packed(flat, sizes, SIZE, torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="3 channels"):
        resize_list([torch.zeros((4, 5, 6), dtype=torch.uint8)], SIZE)


def test_a_box_over_64_times_the_output_is_resized_exactly_in_a_float64_chunk_of_its_own(monkeypatch):
    """Past ``MAX_SCALE`` x the output side, float32's limb sums could leave its exact integers: such boxes (beside
    the others, PIL's tall rule included) are PIL's pixels all the same, from float64 passes of their own chunks."""
    passes, real = [], device_resize._resize_passes
    monkeypatch.setattr(device_resize, "_resize_passes",
                        lambda boxes, *a: passes.append((len(boxes), a[-3], a[-2])) or real(boxes, *a))
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(3, 20000, 3), (40, 30, 3), (300, 2, 3),
                                                                         (256, 200, 3), (257, 300, 3)]]
    flips = torch.tensor([True, False, True, False, True])
    out = resize_packed(*_packed(images), 4, flips)
    for img, o, f in zip(images, out, flips.tolist()):
        want = np.asarray(Image.fromarray(img).resize((4, 4), Image.BICUBIC))[:, ::-1 if f else 1]
        assert np.array_equal(_hwc(o), want), img.shape
    # (boxes, transposed, dtype): 40 x 30 and 256 x 200 (64 x 4) in float32; the wide ones in float64, the tall one
    # (300 > 100 x 2) in a chunk of its own
    assert sorted(passes, key=str) == sorted([(2, False, torch.float32), (2, False, torch.float64),
                                              (1, True, torch.float64)], key=str)


def test_a_box_too_large_for_any_chunk_is_resized_in_blocks_of_rows(monkeypatch):
    """One image whose working memory is over the chunk budget (a chunk cannot be smaller than one image): its first
    pass runs over blocks of rows that fit the budget, with the same pixels as PIL's."""
    products, bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: products.append(tuple(a.shape)) or bmm(a, b))
    rng = np.random.default_rng(4)
    img = rng.integers(0, 256, (300, 280, 3), dtype=np.uint8)  # 300 > 64 x 4: float64
    want = np.asarray(Image.fromarray(img).resize((4, 4), Image.BICUBIC))
    whole = resize_packed(*_packed([img]), 4)
    assert np.array_equal(_hwc(whole[0]), want) and len(products) == 2  # both passes, all rows at once
    products.clear()
    budget = 3 * (280 + 5 * 4) * 8 * 16  # 16 rows a block
    blocks = resize_packed(*_packed([img]), 4, chunk_bytes=budget)
    assert np.array_equal(_hwc(blocks[0]), want)
    assert [p[1] for p in products[:-1]] == [3 * 16] * 18 + [3 * 12] and len(products) == 20, products


def _timm_crop(data: bytes, box, flip: bool) -> np.ndarray:
    """timm's train crop for this box: PIL's decode, ``F.resized_crop`` bicubic, then the flip."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    out = np.asarray(F.resized_crop(img, *box, [SIZE, SIZE], InterpolationMode.BICUBIC))
    return out[:, ::-1] if flip else out


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.fixture(scope="module")
def jpegs():
    rgb = photo_like(90, 120, seed=3)
    return {"4:2:0": encode(rgb, quality=90), "progressive": encode(rgb, quality=80, progressive=True),
            "grey": encode(rgb, mode="L", quality=90), "cmyk": encode(rgb, mode="CMYK", quality=90),
            "4:4:4": encode(photo_like(70, 50, seed=4), quality=95, subsampling=0)}


def test_decode_crop_resize_gives_timms_pixels(jpegs):
    """torchvision's CPU decoder standing in for nvJPEG decodes as PIL does here (the same libjpeg-turbo IDCT:
    0 levels apart), so the crops are timm's exactly; greyscale comes out in 3 channels; CMYK is PIL's (counted)."""
    names = list(jpegs)
    boxes = torch.tensor([(5, 7, 60, 80), (0, 0, 90, 120), (30, 40, 12, 9), (1, 2, 88, 117), (10, 3, 40, 44)])
    flips = torch.tensor([True, False, True, False, True])
    res = decode_crop_resize([_tensor(jpegs[k]) for k in names], boxes, SIZE, flips, "cpu")
    assert res.refused == 1 and res.failed == {} and res.images.shape == (5, 3, SIZE, SIZE)
    for k, img, box, f in zip(names, res.images, boxes.tolist(), flips.tolist()):
        assert np.abs(_hwc(img).astype(int) - _timm_crop(jpegs[k], box, f)).max() == 0, k


def test_a_file_the_decoder_refuses_is_decoded_by_pil_and_counted(jpegs):
    """A PNG under a .JPEG name (ImageNet has one) is not offered to the JPEG decoder: PIL decodes it (counted);
    truncated bytes no decoder reads are listed."""
    png = io.BytesIO()
    Image.fromarray(photo_like(40, 50, seed=5)).save(png, "PNG")
    png = png.getvalue()
    truncated = jpegs["4:2:0"][: len(jpegs["4:2:0"]) // 2]
    data = [jpegs["4:2:0"], png, truncated, jpegs["grey"]]
    boxes = torch.tensor([(5, 7, 60, 80), (2, 3, 30, 40), (0, 0, 10, 10), (0, 0, 90, 120)])
    res = decode_crop_resize([_tensor(d) for d in data], boxes, SIZE, None, torch.device("cpu"))
    assert res.refused == 1
    assert list(res.failed) == [2] and "truncated" in res.failed[2]
    assert int(res.images[2].max()) == 0
    for i in (0, 1, 3):
        assert np.abs(_hwc(res.images[i]).astype(int) - _timm_crop(data[i], boxes[i].tolist(), False)).max() == 0


def test_a_box_outside_its_image_is_refused(jpegs):
    with pytest.raises(ValueError, match=r"boxes\[0\].*not inside its image of 90 x 120"):
        decode_crop_resize([_tensor(jpegs["4:2:0"])], torch.tensor([(50, 0, 60, 10)]), SIZE, None, "cpu")


def _counted(monkeypatch) -> list[tuple[int, bool]]:
    """(size, whether it decoded) of each call of the device's decoder (``device_resize._decode``, the one place it
    is called)."""
    calls, decode = [], device_resize._decode

    def counting(data, device):
        calls.append((len(data), False))
        out = decode(data, device)
        calls[-1] = (len(data), True)
        return out

    monkeypatch.setattr(device_resize, "_decode", counting)
    return calls


def test_files_the_decoder_refuses_leave_the_others_in_batched_calls(jpegs, monkeypatch):
    """A PNG under a .JPEG name is never offered to the decoder: the batch's JPEGs are one call. Bytes corrupt past a
    valid header fail the whole call: halved until the file is alone, the others decode in log2(B) batched calls,
    not one per image. The pixels are each image's decoded alone."""
    png = io.BytesIO()
    Image.fromarray(photo_like(40, 50, seed=5)).save(png, "PNG")
    good = [jpegs[k] for k in ("4:2:0", "progressive", "grey", "4:4:4")] * 2
    truncated = jpegs["4:2:0"][: len(jpegs["4:2:0"]) // 2]
    assert device_decodable(_tensor(truncated)) and not device_decodable(_tensor(png.getvalue()))
    box = (1, 2, 30, 40)
    alone = [decode_crop_resize([_tensor(d)], torch.tensor([box]), SIZE, None, "cpu").images[0] for d in good]
    calls = _counted(monkeypatch)
    for bad, refused, failed in ((png.getvalue(), 1, {}), (truncated, 0, {3: "truncated"})):
        data = good[:3] + [bad] + good[3:]
        calls.clear()
        res = decode_crop_resize([_tensor(d) for d in data], torch.tensor([box] * 9), SIZE, None, "cpu")
        assert res.refused == refused and {i: "truncated" for i in res.failed} == failed
        assert torch.equal(torch.cat([res.images[:3], res.images[4:]]), torch.stack(alone))
        decoded = [n for n, ok in calls if ok]
        if bad is truncated:  # 9 fails -> 4 fails + 5 -> 2 + 2 fails -> 1 + 1 fails: the bad one alone
            assert calls[0] == (9, False) and sum(decoded) == 8 and len(decoded) <= 4 and len(calls) <= 9, calls
        else:
            assert calls == [(8, True)]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
                                   RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to "
                                                "allocate 96.00 MiB"),
                                   RuntimeError("Failed to decode batch: 5"),  # nvJPEG's own allocation
                                   RuntimeError("Failed to synchronize CUDA stream: 700"),
                                   RuntimeError("cudaEventRecord failed: 700"),
                                   RuntimeError("Failed to create decode params: 1"),
                                   RuntimeError("Failed to transfer jpeg to device: 5")])
def test_a_failure_of_the_device_in_the_decoder_propagates(jpegs, monkeypatch, error):
    """The device failing (an allocation, nvJPEG's set-up, its stream) is not a file the decoder refused: it is
    raised, never decoded by PIL image by image and counted (torchvision re-raises them as RuntimeErrors); a file's
    failure (nvJPEG's BAD_JPEG, 3) is the file's."""
    def failing(data, device):
        raise error

    monkeypatch.setattr(device_resize, "_decode", failing)
    with pytest.raises(type(error), match=re.escape(str(error))):
        decode_crop_resize([_tensor(jpegs["4:2:0"])] * 2, torch.tensor([(0, 0, 9, 9)] * 2), SIZE, None, "cpu")
    assert not device_resize.device_fault(RuntimeError("Failed to decode batch: 3"))
    assert not device_resize.device_fault(RuntimeError("Failed to parse jpeg stream: 4"))
    assert not device_resize.device_fault(RuntimeError("Failed to transfer jpeg to device: 3"))
    assert not device_resize.device_fault(RuntimeError("Not a JPEG file: starts with 0x89 0x50"))


def test_a_failure_of_the_decoders_own_allocation_is_tried_once_more(jpegs, monkeypatch):
    """nvJPEG's ALLOCATOR_FAILURE (5) once: the call is made again (on CUDA after torch's cache gave its free blocks
    back) and the batch decodes; twice in a row it is raised. A torchvision without nvJPEG is the device's fault."""
    real, calls = device_resize._decode, []

    def once(data, device):
        calls.append(len(data))
        if len(calls) == 1:
            raise RuntimeError("Failed to decode batch: 5")
        return real(data, device)

    monkeypatch.setattr(device_resize, "_decode", once)
    res = decode_crop_resize([_tensor(jpegs["4:2:0"])] * 2, torch.tensor([(0, 0, 9, 9)] * 2), SIZE, None, "cpu")
    assert calls == [2, 2] and res.refused == 0 and res.images.shape == (2, 3, SIZE, SIZE)
    assert device_resize.device_fault(RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support"))


def test_a_decoder_that_refuses_a_whole_batch_pil_decodes_is_raised(jpegs, monkeypatch):
    """Every JPEG of a batch of 8 refused (a file's status, 3) while PIL decodes them all: the decoder's fault (a
    broken installation), a DataError with what to set, not a run at PIL's pace on the training thread; or, for the
    training step (``broken``), reported with the batch PIL decoded. 7 are taken as refused files."""
    from convit_scale.data import DataError

    def refusing(data, device):
        raise RuntimeError("Failed to decode batch: 3")

    monkeypatch.setattr(device_resize, "_decode", refusing)
    one = _tensor(jpegs["4:2:0"])
    res = decode_crop_resize([one] * 7, torch.tensor([(0, 0, 9, 9)] * 7), SIZE, None, "cpu")
    assert res.refused == 7 and res.failed == {}
    with pytest.raises(DataError, match=r"refused all 8 JPEGs of a batch that PIL decodes.*data.decode_on=cpu"):
        decode_crop_resize([one] * 8, torch.tensor([(0, 0, 9, 9)] * 8), SIZE, None, "cpu")
    broken = []
    res = decode_crop_resize([one] * 8, torch.tensor([(0, 0, 9, 9)] * 8), SIZE, None, "cpu", broken=broken)
    assert res.refused == 8 and len(broken) == 1 and "refused all 8 JPEGs" in broken[0]


def test_cmyk_jpegs_are_decoded_on_the_host_not_offered_to_the_device(jpegs):
    """nvJPEG decodes 4-component (CMYK, YCCK) JPEGs only when asked, and torchvision does not ask: they go to PIL
    (the reference's pixels), like a PNG under a .JPEG name, and never fail a batched call."""
    assert not device_decodable(_tensor(jpegs["cmyk"]))
    assert all(device_decodable(_tensor(jpegs[k])) for k in ("4:2:0", "progressive", "grey", "4:4:4"))


def test_jpegs_of_rgb_samples_are_decoded_on_the_host_not_offered_to_the_device():
    """libjpeg (PIL's decoder) reads a 3-component frame as RGB, not YCbCr, under an Adobe marker of transform 0, or,
    without one, by component ids R, G, B: such files go to PIL, whose pixels they get; a JFIF or a transform-1
    marker says YCbCr, and the device is offered them."""
    rng = np.random.default_rng(5)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(out, "JPEG", keep_rgb=True, quality=95)
    data = bytearray(out.getvalue())
    app14 = data.index(b"\xff\xee\x00\x0eAdobe")
    assert data[app14 + 15] == 0  # Pillow's RGB: Adobe transform 0, ids R, G, B
    assert not device_decodable(_tensor(bytes(data)))
    no_adobe = data[:app14] + data[app14 + 16:]
    assert not device_decodable(_tensor(bytes(no_adobe)))  # the ids alone
    ycc = bytearray(data)
    ycc[app14 + 15] = 1
    assert device_decodable(_tensor(bytes(ycc)))  # the marker says YCbCr, whatever the ids
    res = decode_crop_resize([_tensor(bytes(data))], torch.tensor([(2, 3, 20, 25)]), SIZE, None, "cpu")
    assert res.refused == 1 and res.failed == {}
    assert np.abs(_hwc(res.images[0]).astype(int) - _timm_crop(bytes(data), [2, 3, 20, 25], False)).max() == 0


def test_a_header_claiming_no_pixels_or_a_bomb_is_not_offered_to_the_device(jpegs):
    """A frame header of 0 rows, or of more pixels than PIL accepts (an allocation the device would fail, which
    ends the run): PIL's, on the host. A header cut short is not read past its end."""
    data = bytearray(jpegs["4:2:0"])
    sof = data.index(b"\xff\xc0")
    for height, width in ((0, 120), (65_535, 65_535)):
        data[sof + 5:sof + 9] = bytes([height >> 8, height & 255, width >> 8, width & 255])
        assert not device_decodable(_tensor(bytes(data)))
    assert not any(device_decodable(_tensor(jpegs["4:2:0"][:sof + k])) for k in range(2, 10))


def test_the_resize_divides_as_a_gpu_does(images, jpegs):
    """CUDA divides by a number as a multiplication by its reciprocal (tests/cuda_arithmetic.py), which moved the
    first tap or a weight of 17 box sizes in 3,000 resized to 224: with the GPU's division the resize and the device
    decode divide by no number whose reciprocal is inexact, and give PIL's pixels and the CPU's taps (box sides up
    to 1,000 resized to 224: 8 of them moved)."""
    from cuda_arithmetic import CudaScalarDivision

    flips = torch.tensor([i % 3 == 1 for i in range(len(images))])
    boxes, box_flips = torch.tensor([(5, 7, 60, 80), (0, 0, 90, 120), (30, 40, 12, 9)]), torch.tensor([1, 0, 1]) > 0
    encoded = [_tensor(jpegs[k]) for k in ("4:2:0", "progressive", "grey")]
    sizes = torch.arange(1, 1001)
    taps = device_resize._taps(sizes, 224, device_resize._taps_of(1000, 224), None)
    decoded = decode_crop_resize(encoded, boxes, SIZE, box_flips, "cpu").images
    with CudaScalarDivision() as gpu:
        out = resize_packed(*_packed(images), SIZE, flips)
        on_gpu = decode_crop_resize(encoded, boxes, SIZE, box_flips, "cpu").images
        gpu_taps = device_resize._taps(sizes, 224, device_resize._taps_of(1000, 224), None)
    assert gpu.inexact == []
    for img, o, f in zip(images, out, flips.tolist()):
        assert np.array_equal(_hwc(o), _pil(img, f)), (img.shape[:2], f)
    assert torch.equal(on_gpu, decoded)
    assert all(torch.equal(a, b) for a, b in zip(taps, gpu_taps))
