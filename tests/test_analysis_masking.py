"""Table 6's masking of any GPSA layer (the first k, the last, a list), with the one evaluation loop."""

import pytest
import torch

from convit_scale import create_model
from convit_scale.analysis.masking import default_specs, gpsa_layers, masked, masking_table, spec_key
from convit_scale.errors import BadInput


def test_specs_name_gpsa_layers():
    assert gpsa_layers("first2", 10) == (0, 1) and gpsa_layers("last", 10) == (9,)
    assert gpsa_layers("last3", 10) == (7, 8, 9) and gpsa_layers("all", 4) == (0, 1, 2, 3)
    assert gpsa_layers("4,0,4", 10) == (0, 4)
    assert default_specs(10) == ["first1", "last", "first5", "first10"] and default_specs(1) == ["first1", "last"]
    assert [spec_key(s) for s in ("first2", "last", "last3", "0,4", "all")] == [
        "first_2", "last", "last_3", "layers_0_4", "all"]
    for bad in ("first0", "10", "last11", "middle", "1,,2"):
        with pytest.raises(BadInput, match="--masking"):
            gpsa_layers(bad, 10)


def test_masking_the_last_gpsa_layer_touches_that_layer_only():
    """The last GPSA layer's positional attention masked = that layer at sigma(lambda) = 0 (content only), the
    other layers as trained; masking the first instead gives another output."""
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4).eval()
    gpsa = [b.attn for b in model.gpsa_blocks()]
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for attn in gpsa:
            attn.gating_param.fill_(2.0)
        with masked(model, position=gpsa_layers("last", len(gpsa))):
            assert [a.mask for a in gpsa] == [None, "position"]
            out = model(x)
        assert [a.mask for a in gpsa] == [None, None]  # restored
        gpsa[-1].gating_param.fill_(-1e4)  # sigma = 0 in the last GPSA layer: content only, by hand
        assert torch.allclose(model(x), out, atol=1e-5)
        gpsa[-1].gating_param.fill_(2.0)
        with masked(model, position=[0]):
            assert not torch.allclose(model(x), out, atol=1e-3)
    with pytest.raises(ValueError, match="cannot lose both"):
        with masked(model, content=[1], position=[1]):
            pass


def test_masking_table_reads_a_streamed_split(fm_wds):
    """As many validation images as asked, a batch at a time (FirstImages), every masking of the specs."""
    from convit_scale.analysis.report import FirstImages, eval_loader
    from convit_scale.evaluation import evaluate

    model = create_model("convit_nano", num_classes=10).eval()
    data = FirstImages(eval_loader(str(fm_wds), "wds", 16, batch_size=32), 70)
    assert evaluate(model, data, torch.device("cpu"))["samples"] == 70  # 2 batches and 6 images of a third
    assert FirstImages(eval_loader(str(fm_wds), "wds", 16), None).num_real == 200  # the whole split
    table = masking_table(model, data, ["last", "0,1"])
    assert set(table) == {"none", "position_embedding", "content_attention_last", "position_attention_last",
                          "content_attention_layers_0_1", "position_attention_layers_0_1"}
    assert all(0 <= v <= 100 for v in table.values())


def test_masking_position_with_sigma_zero_is_content_only_output():
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for blk in model.gpsa_blocks():
            blk.attn.gating_param.fill_(-1e4)  # sigma = 0
        ref = model(x)
        for blk in model.gpsa_blocks():
            blk.attn.gating_param.fill_(2.0)
        with masked(model, position_layers=len(model.gpsa_blocks())):
            out = model(x)
        assert torch.allclose(ref, out, atol=1e-5)
        with masked(model, pos_embed=True):
            assert torch.count_nonzero(model.pos_embed) == 0
        assert torch.count_nonzero(model.pos_embed) > 0  # restored
