"""convit_scale/train/optim.py: AdamW's parameter groups and kernels."""

import torch

from convit_scale.config import OptimConfig
from convit_scale.models import create_model
from convit_scale.train.optim import build_optimizer, param_groups


def test_weight_decay_groups():
    model = create_model("convit_nano")
    groups = {g["group"]: g for g in param_groups(model, 0.05)}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    for n in ("pos_embed", "cls_token", "blocks.0.attn.gating_param", "blocks.0.norm1.weight", "head.bias",
              "blocks.0.attn.pos_proj.bias"):
        assert n in no_decay, n
    for n in ("blocks.0.attn.qk.weight", "blocks.2.attn.qkv.weight", "head.weight", "patch_embed.proj.weight"):
        assert n in decay, n
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.05


def test_fused_adamw_on_cuda_multi_tensor_elsewhere():
    model = create_model("convit_nano")
    cpu = build_optimizer(model, OptimConfig(), 1e-3, torch.device("cpu"))
    assert cpu.defaults["foreach"] is True and not cpu.defaults["fused"]
    cuda = build_optimizer(model, OptimConfig(), 1e-3, torch.device("cuda"))  # built, not stepped, on this machine
    assert cuda.defaults["fused"] is True and cuda.defaults["foreach"] is False
