"""`bench pixels`: the FFCV loader's pixels against timm's for the same crop boxes and eval views (0 difference),
the device resize's and device decode's train crops (0 difference), and ffcv's own decoders' (not 0), on
photograph-like JPEGs."""

from PIL import Image
from test_jpeg import photo_like

from convit_scale.bench.pixels import pixel_fidelity


def test_loader_matches_timm_and_ffcvs_own_decoders_do_not(tmp_path):
    photos = []
    for k, (h, w) in enumerate(((427, 640), (500, 333))):
        photos.append(tmp_path / f"p{k}.jpg")
        Image.fromarray(photo_like(h, w, seed=k)).save(photos[-1], "JPEG", quality=90)
    r = pixel_fidelity(photos, boxes=6)
    for view in ("train_crop", "eval_view"):
        assert r[view]["loader"] == {"mean_abs_diff": 0.0, "max_abs_diff": 0, "share_differing": 0.0}
        assert r[view]["ffcv_own"]["mean_abs_diff"] > 0.1 and r[view]["ffcv_own_384_q90"]["mean_abs_diff"] > 0.1
    assert r["decode_only_ffcv_imdecode"]["max_abs_diff"] > 0  # the fast inverse DCT
    for mode in ("device_resize", "device_decode"):  # on the CPU here; the same code on a GPU
        assert r["train_crop"][mode] == {"mean_abs_diff": 0.0, "max_abs_diff": 0, "share_differing": 0.0}, mode
