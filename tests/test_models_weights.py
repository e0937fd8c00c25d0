"""Published weights into the models (convit_scale/models/weights.py): timm's and the official release's state
dicts, safetensors, a mismatch refused as a whole, pickled code never run, another resolution; and ours written in
timm's layout (what ``export`` writes), read back by both."""

from __future__ import annotations

import pytest
import timm
import torch

from convit_scale import create_model
from convit_scale.errors import BadInput
from convit_scale.models import WeightsMismatch, load_pretrained
from convit_scale.models.weights import timm_state_dict


@pytest.mark.parametrize("timm_name,ours,token", [
    ("convit_tiny", "convit_tiny", False),
    ("deit_tiny_patch16_224", "deit_tiny", False),
    ("deit_tiny_distilled_patch16_224", "deit_tiny", True),
])
def test_loads_timm_state_dict_and_matches_logits(timm_name, ours, token):
    torch.manual_seed(0)
    ref = timm.create_model(timm_name, pretrained=False).eval()
    model = create_model(ours, distill_token=token).eval()
    load_pretrained(model, ref.state_dict())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert (ref(x) - model(x)).abs().max().item() < 1e-4


NANO = dict(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_classes=10)  # our *_nano


@pytest.mark.parametrize("timm_name,ours,token,extra", [
    ("deit_tiny_patch16_224", "deit_nano", False, {}),
    ("deit_tiny_distilled_patch16_224", "deit_nano", True, {}),
    ("convit_tiny", "convit_nano", False, {"local_up_to_layer": 2, "embed_dim": 8}),  # timm's: per head
])
def test_our_weights_in_timms_layout_load_strictly_into_timm_and_back(timm_name, ours, token, extra):
    torch.manual_seed(0)
    model = create_model(ours, num_classes=10, distill_token=token).eval()
    sd = timm_state_dict(model.state_dict())
    ref = timm.create_model(timm_name, pretrained=False, **{**NANO, **extra}).eval()
    ref.load_state_dict(sd, strict=True)  # a DeiT's pos_embed has its tokens' rows: 16 patches + 1 or 2
    assert sd["pos_embed"].shape[1] == 16 + (0 if extra else 1 + token)
    back = load_pretrained(create_model(ours, num_classes=10, distill_token=token), sd).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert (ref(x) - model(x)).abs().max().item() < 1e-5
        assert torch.equal(back(x), model(x))


def test_load_from_files_official_wrapper_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    ref = timm.create_model("convit_tiny", pretrained=False).eval()
    sd = ref.state_dict()
    torch.save({"model": sd, "epoch": 299}, tmp_path / "official.pth")  # the official release format
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "w.safetensors")
    x = torch.randn(1, 3, 224, 224)
    for f in ("official.pth", "w.safetensors"):
        model = create_model("convit_tiny", pretrained_file=str(tmp_path / f)).eval()
        with torch.no_grad():
            assert (ref(x) - model(x)).abs().max().item() < 1e-4


def test_mismatched_state_dict_is_refused_whole():
    model = create_model("convit_nano", num_classes=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = dict(before)
    bad.pop("head.bias")
    bad["blocks.0.attn.bogus"] = torch.zeros(1)
    bad["norm.weight"] = torch.zeros(7)
    with pytest.raises(WeightsMismatch) as e:
        load_pretrained(model, bad)
    msg = str(e.value)
    assert "head.bias" in msg and "blocks.0.attn.bogus" in msg and "norm.weight" in msg
    for k, v in model.state_dict().items():  # nothing half-loaded
        assert torch.equal(v, before[k])


def test_pickle_checkpoint_is_not_executed(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"model": Evil()}, tmp_path / "evil.pth")
    with pytest.raises(BadInput, match="weights-only"):
        create_model("convit_nano", pretrained_file=str(tmp_path / "evil.pth"))


def test_other_resolution_interpolates_position_embedding():
    torch.manual_seed(0)
    ref = timm.create_model("convit_tiny", pretrained=False).eval()
    model = create_model("convit_tiny", img_size=160).eval()
    load_pretrained(model, ref.state_dict())
    assert model.pos_embed.shape == (1, 100, 192)
    assert model.blocks[0].attn.rel_indices.shape == (100, 100, 3)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 160, 160))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
