"""convit_scale/parallel/zero_engine.py: DeepSpeed on the rank's own GPU, and the optimizer state put where torch's
own ``load_state_dict`` puts it."""

from __future__ import annotations

import types

import pytest
import torch

from convit_scale.parallel.zero_engine import deepspeed_args, place_state_like_torch
from convit_scale.train.distributed import device_for


def test_deepspeed_takes_the_ranks_gpu_not_local_rank(monkeypatch):
    """A site that gives each task one GPU (`--gpus-per-task=1`): local rank 5 sees one device, cuda:0. The engine's
    own choice (LOCAL_RANK) would be the invalid ordinal 5; with the args the strategy passes, DeepSpeed's engine sets
    the device the process group uses."""
    import deepspeed.runtime.engine as engine

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ours = device_for(5)
    assert ours == torch.device("cuda", 0)

    chosen = []
    accelerator = types.SimpleNamespace(set_device=chosen.append, device_name=lambda i: f"cuda:{i}",
                                        device=lambda: "cuda")
    monkeypatch.setattr(engine, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(engine.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(engine.dist, "get_rank", lambda: 5)
    stub = types.SimpleNamespace(local_rank=5)
    engine.DeepSpeedEngine._set_distributed_vars(stub, deepspeed_args(ours))  # DeepSpeed's own code, our args
    assert chosen == [0] and stub.device == ours
    engine.DeepSpeedEngine._set_distributed_vars(stub, None)  # what it did before: LOCAL_RANK
    assert chosen == [0, 5]
    assert deepspeed_args(torch.device("cpu")) is None  # on the CPU DeepSpeed's accelerator has no device to pick


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_state_is_placed_as_torchs_load_state_dict_places_it(fused):
    """State as a universal load leaves it (``step`` and moments in other dtypes than torch would keep) is moved where
    torch's own ``Optimizer.load_state_dict`` moves the same state: the reference."""
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 3))]
    ours = torch.optim.AdamW(params, fused=fused or None, foreach=not fused)
    ours.state = {p: {"step": torch.tensor(7.0, dtype=torch.float64), "exp_avg": torch.ones_like(p).double(),
                      "exp_avg_sq": torch.ones_like(p).double()} for p in params}
    reference = torch.optim.AdamW(params, fused=fused or None, foreach=not fused)
    reference.load_state_dict(ours.state_dict())
    place_state_like_torch(ours)
    for p in params:
        for key, value in reference.state[p].items():
            assert (ours.state[p][key].dtype, ours.state[p][key].device) == (value.dtype, value.device), key
            assert torch.equal(ours.state[p][key].double(), value.double())


def test_compiled_extensions_are_cached_per_environment(monkeypatch):
    """DeepSpeed's CPU Adam and the dry run's extension build into a folder of this Python environment: a build file
    names its environment's include paths, so two environments sharing one folder rebuild it whenever the other ran.
    A TORCH_EXTENSIONS_DIR the user set is kept."""
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from convit_scale import extensions
    from convit_scale.dryrun.native import cache_dir

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    own = extensions.use_own_torch_extensions_dir()
    tag = extensions.environment_tag()
    assert own.endswith(f"-{tag}-cpu{extensions.cpu_tag()}") and f"torch{torch.__version__.replace('+', '_')}" in own
    assert Path(_get_build_directory("cpu_adam", False)) == Path(own) / "cpu_adam"
    assert cache_dir().name.endswith(f"-{tag}")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    assert extensions.environment_tag() != tag and not cache_dir().name.endswith(f"-{tag}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/site/extensions")
    assert extensions.use_own_torch_extensions_dir() == "/site/extensions"


def test_deepspeeds_cpu_builds_are_kept_per_kind_of_cpu(tmp_path):
    """DeepSpeed builds its CPU ops with -march=native: a login node's build must not be loaded by another CPU."""
    from convit_scale import extensions

    older, newer, same = (tmp_path / n for n in ("older", "newer", "same"))
    older.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    newer.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    same.write_text("processor\t: 0\nflags\t\t: avx2 sse2 fpu\nprocessor\t: 1\nflags\t\t: avx2 sse2 fpu\n")
    none = str(tmp_path / "no-compiler")  # the CPU's flags where the compiler does not say
    assert extensions.cpu_tag(str(older), none) != extensions.cpu_tag(str(newer), none)
    assert extensions.cpu_tag(str(older), none) == extensions.cpu_tag(str(same), none)
    assert extensions.cpu_tag(str(tmp_path / "none"), none) == extensions.platform.machine()
    # the compiler's own -march=native: the same target whatever else the kernel lists, another one for another CPU
    compilers = {}
    for name, extra in (("a", ""), ("b", ""), ("c", "  -mavx512f                   \t\t[enabled]\n")):
        cxx = tmp_path / f"cxx-{name}"
        cxx.write_text("#!/bin/sh\nprintf '%s' '  -march=                     \t\tskylake\n"
                       "  -mavx2                      \t\t[enabled]\n  -mavx512f                   \t\t[disabled]\n"
                       f"{extra}'\n")
        cxx.chmod(0o755)
        compilers[name] = str(cxx)
    assert "-march=skylake" in extensions.native_target(compilers["a"])
    assert extensions.cpu_tag(str(older), compilers["a"]) == extensions.cpu_tag(str(newer), compilers["b"])
    assert extensions.cpu_tag(str(older), compilers["a"]) != extensions.cpu_tag(str(older), compilers["c"])
