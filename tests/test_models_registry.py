"""The named models (convit_scale/models/registry.py): Table 1's parameter counts, unknown names, recipes that build
the same network, building on the meta device."""

from __future__ import annotations

import math

import pytest
import torch

from convit_scale import create_model, list_models
from convit_scale.errors import BadInput
from convit_scale.models import PAPER_MODELS


def test_parameter_counts_match_table1():
    from convit_scale.cli import model_table_rows

    rows = {r["name"]: r for r in model_table_rows()}
    assert set(PAPER_MODELS) <= set(rows) and len(PAPER_MODELS) == 12
    for name in PAPER_MODELS:
        r = rows[name]
        # Table 1 prints whole millions: accept 3% or the rounding of the printed figure.
        tol = max(0.03 * r["paper_params_m"], 0.5)
        assert abs(r["params_m"] - r["paper_params_m"]) <= tol, (name, r["params_m"])
    # Known exact counts of the reference implementation (timm): convit_small 27.78M, deit_small 22.05M.
    assert math.isclose(rows["convit_small"]["params_m"], 27.78, abs_tol=0.01)
    assert math.isclose(rows["deit_small"]["params_m"], 22.05, abs_tol=0.01)
    assert rows["convit_small"]["gmacs"] > rows["deit_small"]["gmacs"]
    assert set(list_models("convit_*")) >= {"convit_tiny", "convit_base_plus", "convit_micro"}


def test_unknown_model_name():
    with pytest.raises(BadInput, match="unknown model 'convit_huge'"):
        create_model("convit_huge")


def test_one_deit_plus_table1_and_table3_row_e_build_the_same_network():
    from convit_scale.config import RECIPES, load_config, model_options

    built = {}
    for name in ("table1/deit_small_plus.yaml", "table3/convit_small_plus_e_full.yaml"):
        cfg = load_config(RECIPES / name)
        model = create_model(cfg.model.name, device="meta", **model_options(cfg.model))
        built[name] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    a, b = built.values()
    assert a == b and not any("qkv.bias" in k for k in a)


def test_models_build_under_the_meta_device_context():
    """FSDP2's idiom `with torch.device("meta"): create_model(...)` builds on meta, as `device="meta"` does."""
    with torch.device("meta"):
        model = create_model("convit_nano")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
