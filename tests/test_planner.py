"""The planner's memory model against the memory the engine measures on CPU (same configuration)."""

import math
import re

import pytest
import torch
from support import REPO, records, run_ranks, tiny_recipe

from convit_scale.bench.worker import RSS_ENV
from convit_scale.config import ConfigError, load_config
from convit_scale.planner import model_facts, plan


def test_plan_table_shapes_and_sharding():
    cfg = load_config("recipes/table1/convit_base_plus.yaml")
    rows = {r["layout"]: r for r in plan(cfg, nodes=2, gpus_per_node=8, gpu="h100-80gb")}
    assert set(rows) == {"ddp", "fsdp2", "fsdp2 no-reshard", "hsdp 2x8", "hsdp 2x8 no-reshard", "zero1", "zero2",
                         "zero3"}
    # full sharding needs less state per GPU than replication
    assert rows["zero3"]["optimizer_gib"] < rows["ddp"]["optimizer_gib"] / 10
    assert rows["fsdp2"]["total_gib"] < rows["zero1"]["total_gib"] < rows["ddp"]["total_gib"]
    for r in rows.values():  # the recipe's global batch, whatever the cluster: micro x accum x 16 = 512
        assert r["micro_batch"] * r["grad_accumulation"] * 16 == 512
        assert r["gpu_hours"] > 0 and r["steps"] == 300 * (1_281_167 // 512)
    facts = model_facts(cfg)
    assert 150e6 < facts.params < 155e6 and facts.act_bytes_per_image > 0
    assert facts.act_ckpt_bytes_per_image < facts.act_bytes_per_image / 4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero3"])
def test_memory_model_matches_engine_on_cpu(fm_tree, tmp_path, strategy):
    """A launch per strategy: a process's peak memory is its own only in a fresh process (a run after another one
    in the same process reuses memory the first freed but the allocator kept, and measures less)."""
    # deit_small at 32x32: 21M parameters, so model state dominates as on a GPU
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out",
                    model={"name": "deit_small", "img_size": 32, "drop_path_rate": 0.0},
                    data={"val_path": "", "global_batch_size": 64}, parallel={"strategy": strategy},
                    schedule={"max_steps": 3}, log={"debug_memory": True})
    res = run_ranks(r, env=RSS_ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    last = records(tmp_path / "out")[-1]
    measured = max(last["peak_mem_mb"]) - last["base_mem_mb"]
    assert measured > 0, (last["peak_mem_mb"], last["base_mem_mb"])
    (row,) = plan(load_config(r), nodes=1, gpus_per_node=2, gpu="cpu", layouts=(strategy,))
    assert row["micro_batch"] == 32
    if strategy == "zero3":
        # RSS also holds ~0.2 GB of DeepSpeed's own per-process overhead on CPU (not tensors, not model
        # state, not on a GPU's allocator): compare the model state with the live tensors instead
        measured = max(last["state_mem_mb"])
        predicted = (row["params_gib"] + row["grads_gib"] + row["optimizer_gib"]) * 1024
        assert abs(predicted - measured) / measured < 0.1, (predicted, measured)
        return
    predicted = row["total_gib"] * 1024
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


# -- ZeRO sizes: one function (parallel.zero.zero_sizes) for the engine's DeepSpeed config and the planner --
ZERO_CPU_21M = {  # what deepspeed_config wrote before the GPU settings existed: a tenth of the model
    "stage": 3, "reduce_bucket_size": 2_100_000, "allgather_bucket_size": 2_100_000, "overlap_comm": False,
    "contiguous_gradients": True, "stage3_prefetch_bucket_size": 2_100_000,
    "stage3_max_live_parameters": 2_100_000, "stage3_max_reuse_distance": 2_100_000,
    "sub_group_size": 2_100_000, "stage3_param_persistence_threshold": 0,
}


def _zero(overrides=(), device="cpu", params=21_000_000):
    from convit_scale.parallel.zero_config import deepspeed_config

    cfg = load_config(None, ["parallel.strategy=zero3", *overrides])
    return deepspeed_config(cfg.parallel, 4, 2, 2, params, 1.0, device=torch.device(device))


def test_zero_config_on_cpu_is_sized_from_the_model():
    assert _zero()["zero_optimization"] == ZERO_CPU_21M
    assert _zero(params=1000)["zero_optimization"]["reduce_bucket_size"] == 1_000_000  # floor 1e6
    small = _zero(["parallel.zero_bucket_elements=8000"])["zero_optimization"]
    assert {small[k] for k in ZERO_CPU_21M if k.endswith(("size", "parameters", "distance"))} == {8000}
    cfg = _zero(device="cpu")
    assert cfg["train_batch_size"] == 16 and cfg["gradient_clipping"] == 1.0


def test_zero_config_on_cuda_is_deepspeeds_own_defaults_but_buckets_and_reduction_dtype():
    """Buckets a tenth of the model (within 1e6-5e8), so that most of the gradient reduction overlaps the backward;
    gradients reduced in fp32 as FSDP2's; everything else DeepSpeed's own GPU defaults."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = _zero(device="cuda")
    zero = cfg["zero_optimization"]
    ours, theirs = DeepSpeedZeroConfig(**zero), DeepSpeedZeroConfig(stage=3)
    for key in ("overlap_comm", "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                "max_reuse_distance", "sub_group_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 2_100_000
    assert _zero(device="cuda", params=10**10)["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8
    assert cfg["communication_data_type"] == "fp32"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_explicit_zero_key_wins(device):
    zero = _zero(["parallel.zero_bucket_elements=24", "parallel.zero_overlap_comm=true",
                  "parallel.zero_param_persistence_threshold=7", "parallel.zero_prefetch_bucket_elements=11",
                  "parallel.zero_max_live_parameters=13", "parallel.zero_max_reuse_distance=17"], device)
    z = zero["zero_optimization"]
    assert (z["reduce_bucket_size"], z["allgather_bucket_size"], z["overlap_comm"]) == (24, 24, True)
    assert (z["stage3_param_persistence_threshold"], z["stage3_prefetch_bucket_size"],
            z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"]) == (7, 11, 13, 17)
    assert _zero(["parallel.zero_overlap_comm=false"], "cuda")["zero_optimization"]["overlap_comm"] is False


@pytest.mark.parametrize("override, needle", [
    ("parallel.zero_max_live_parameters=-1", "parallel.zero_max_live_parameters = -1 is not allowed; must be >= 0"),
    ("parallel.zero_prefetch_bucket_elements=1.5", "parallel.zero_prefetch_bucket_elements = 1.5 is not allowed; "
                                                   "expected int or null"),
    ("parallel.zero_overlap_comm=3", "parallel.zero_overlap_comm = 3 is not allowed; expected bool or null"),
])
def test_bad_zero_keys_are_refused(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, ["parallel.strategy=zero3", override])
    with pytest.raises(ConfigError, match="needs parallel.strategy zero3"):
        load_config(None, ["parallel.strategy=zero2", "parallel.zero_max_reuse_distance=5"])
    with pytest.raises(ConfigError, match="zero_overlap_comm = True is not allowed; needs parallel.strategy zero1"):
        load_config(None, ["parallel.strategy=fsdp2", "parallel.zero_overlap_comm=true"])


def test_planner_reads_the_engines_zero_sizes():
    """zero3's buffers in the plan are the engine's: buckets of a tenth of the model on a GPU as on the CPU."""
    cfg = load_config("recipes/table1/convit_base_plus.yaml",
                      ["parallel.strategy=zero3"])
    P = model_facts(cfg).params
    (gpu,) = plan(cfg, nodes=1, gpus_per_node=8, gpu="h100-80gb", layouts=("zero3",))
    (cpu,) = plan(cfg, nodes=1, gpus_per_node=8, gpu="cpu", layouts=("zero3",))
    tenth = -(-int(P / 10) // 8) * 8  # a tenth, rounded up to DeepSpeed's alignment
    assert math.isclose(gpu["grads_gib"] * 2**30, 2 * P / 8 + 2 * tenth)  # bf16 ipg bucket, a tenth
    assert math.isclose(cpu["grads_gib"] * 2**30, 2 * P / 8 + 2 * tenth)
    cfg = load_config("recipes/table1/convit_base_plus.yaml", ["parallel.strategy=zero3",
                                                                "parallel.zero_bucket_elements=1000000"])
    (small,) = plan(cfg, nodes=1, gpus_per_node=8, gpu="h100-80gb", layouts=("zero3",))
    assert math.isclose(small["grads_gib"] * 2**30, 2 * P / 8 + 2 * 1e6)


# -- the loader: images/s the GPUs need against what the CPU cores beside them give --------------------------
def test_loader_check_names_the_slower_side_and_the_mode_that_feeds_the_gpus(tmp_path, monkeypatch):
    from convit_scale.planner import DECODE_MS_HERE, LOADER_VS_DECODE, loader_check

    monkeypatch.setenv("CONVIT_SCALE_CALIBRATION", str(tmp_path / "none.json"))
    cfg = load_config("recipes/table1/convit_tiny.yaml", ["data.decode_on=cpu"])  # a GPU run's default: box
    few = loader_check(cfg, "h200-141gb", cpus_per_gpu=2)
    assert few["mode"] == "box" and few["augment_on"] == "device" and few["format"] == cfg.data.format
    assert few["cpu_ms_per_image"] == pytest.approx(LOADER_VS_DECODE[(cfg.data.format, "box")] * DECODE_MS_HERE)
    assert "no calibration of this node's CPU" in few["decode_warning"]
    assert math.isclose(few["loader_images_per_s"], 2 * 1000 / few["cpu_ms_per_image"])
    assert few["loader_images_per_s"] < few["gpu_images_per_s"] and few["bottleneck"] == "loader"
    # every mode's cores per GPU, from the same images/s: the decode on the device needs the fewest
    cores = {m: v["cores_per_gpu"] for m, v in few["modes"].items()}
    assert list(cores) == ["cpu", "pixels", "box", "decode-on-device"] and cores == dict(sorted(
        cores.items(), key=lambda kv: -kv[1]))
    assert few["fed_by"] == "decode-on-device" and cores["decode-on-device"] <= 2 < cores["box"]
    capped = loader_check(cfg, "h200-141gb", cpus_per_gpu=10_000)  # the recipe's 8 workers use 8 of them
    assert math.isclose(capped["loader_images_per_s"], 8 * 1000 / few["cpu_ms_per_image"]) and cfg.data.num_workers == 8
    assert capped["fed_by"] == "box"  # the recipe's own mode, when the cores suffice
    # what a CUDA run cannot augment on the device stays on the CPU: more CPU time per image
    cpu = loader_check(load_config("recipes/table1/convit_tiny.yaml", ["data.augment_on=cpu", "data.decode_on=cpu"]),
                       "h200-141gb", 2)
    assert cpu["mode"] == "cpu" and cpu["cpu_ms_per_image"] > few["cpu_ms_per_image"]


def test_plan_reads_the_nodes_calibration(tmp_path, monkeypatch):
    """`bench data --calibrate` writes the node's decode cost; the loader's cost is the same-run ratio times it, and
    the device's share of a mode is part of the step's compute."""
    from convit_scale.planner import DEVICE_MS_PER_IMAGE, loader_check, loader_ms_per_image, plan

    cal = tmp_path / "calibration.json"
    cal.write_text('{"decode_cpu_ms_per_image": 2.0}')
    monkeypatch.setenv("CONVIT_SCALE_CALIBRATION", str(cal))
    cfg = load_config("recipes/table1/convit_small.yaml")
    slow = loader_ms_per_image(cfg)[0]
    assert loader_check(cfg, "h200-141gb", 10)["decode_warning"] is None
    cal.write_text('{"decode_cpu_ms_per_image": 0.5}')
    assert loader_ms_per_image(cfg)[0] == pytest.approx(slow / 4)
    box, pixels = (plan(load_config("recipes/table1/convit_small.yaml", [f"data.resize_on={r}"]), 1, 8, "h200-141gb",
                        layouts=("fsdp2",))[0] for r in ("device", "cpu"))
    images = cfg.data.global_batch_size / 8
    assert box["compute_s"] - pixels["compute_s"] == pytest.approx(images * DEVICE_MS_PER_IMAGE["box"] / 1000)


def test_plan_follows_the_recipes_micro_batch_checkpointing_and_teacher():
    """Before: plan took data.micro_batch_size and activation checkpointing's recompute as overrides and ignored
    them, and left Table 4's teacher out of the compute."""
    from convit_scale.planner import DEVICE_MS_PER_IMAGE

    base = load_config("recipes/table1/convit_small_plus.yaml")
    (row,) = [r for r in plan(base, 1, 8, "h200-141gb", layouts=["fsdp2"])]
    micro = load_config("recipes/table1/convit_small_plus.yaml", ["data.micro_batch_size=16"])
    (m,) = plan(micro, 1, 8, "h200-141gb", layouts=["fsdp2"])
    assert (m["micro_batch"], m["grad_accumulation"]) == (16, 4) != (row["micro_batch"], row["grad_accumulation"])
    ckpt = load_config("recipes/table1/convit_small_plus.yaml", ["parallel.activation_checkpointing=true"])
    (c,) = plan(ckpt, 1, 8, "h200-141gb", layouts=["fsdp2"])
    device = 512 / 8 * DEVICE_MS_PER_IMAGE["box"] / 1000  # the device's resize: not recomputed
    assert math.isclose(c["compute_s"] - device, (row["compute_s"] - device) * 4 / 3)
    assert c["activations_gib"] < row["activations_gib"]
    distilled = load_config("recipes/table4/convit_small_plus_distilled.yaml")
    (d,) = plan(distilled, 1, 8, "h200-141gb", layouts=["fsdp2"])
    from convit_scale.planner import teacher_flops

    assert teacher_flops("regnety_160", 224) > 30e9  # RegNetY-16GF: 16 G multiply-adds
    assert d["compute_s"] > 1.4 * row["compute_s"]  # about half again for ConViT-S+


def test_plan_command_warns_when_the_loader_is_slower(capsys, monkeypatch):
    """The remedy names the mode that keeps the GPUs fed at the job's cores, and the cores and workers it needs."""
    from convit_scale.cli import main

    monkeypatch.chdir(REPO)
    box = ["data.decode_on=cpu"]  # ConViT-Ti's recipe decodes on the device; this is the GPU default before it
    assert main(["plan", "--recipe", "recipes/table1/convit_tiny.yaml", "--gpu", "h200-141gb", "--cpus-per-gpu",
                 "1", *box]) == 0
    out = capsys.readouterr().out
    assert "warning: the loader is slower than the GPUs" in out
    assert "loader: CPU cores per GPU each mode needs: cpu" in out
    assert re.search(r"mode decode-on-device \(data\.decode_on=device\) keeps them fed with 0\.\d of the 1 cores per "
                     r"GPU \(the recipe's mode box needs \d+\.\d\)", out), out
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "100000")
    assert main(["plan", "--recipe", "recipes/table1/convit_tiny.yaml", "--gpu", "h200-141gb", "--gpus-per-node",
                 "1", *box]) == 0
    out = capsys.readouterr().out  # 8 workers of 100000 cores: the recipe's mode, with the workers it needs
    assert re.search(r"mode box \(data\.resize_on=device data\.num_workers=\d+\) keeps them fed", out), out
    assert main(["plan", "--recipe", "recipes/table1/convit_tiny.yaml", "--gpu", "h200-141gb", "--gpus-per-node",
                 "1", "data.num_workers=100000", *box]) == 0
    out = capsys.readouterr().out
    assert "100000 CPU cores per GPU" in out
    assert "the GPUs are slower than the loader" in out and "warning: the loader" not in out


def test_the_recipes_layout_is_the_hsdp_mesh_the_run_builds():
    """parallel.hsdp_per_node plans as the run lays it out, one replica per node at each node count (a requeue onto
    fewer nodes included); a fixed replica count stays as the recipe sets it."""
    from convit_scale.config import load_config
    from convit_scale.planner import plan

    recipe = REPO / "recipes/table1/convit_base_plus.yaml"
    for nodes in (4, 3):
        cfg = load_config(recipe, ["parallel.hsdp_per_node=true"])
        own = [r["layout"] for r in plan(cfg, nodes, 8, "h200-141gb") if r["recipe_layout"]]
        assert own == [f"hsdp {nodes}x8 no-reshard"], own
    cfg = load_config(recipe, ["parallel.hsdp_replicas=2"])
    assert [r["layout"] for r in plan(cfg, 4, 8, "h200-141gb") if r["recipe_layout"]] == ["hsdp 2x16 no-reshard"]


def test_loader_ratios_are_the_benchmarks_figures():
    """``LOADER_VS_DECODE`` and ``DECODE_MS_HERE`` are BENCHMARKS.md's table of the loader's modes: the constants and
    the document cannot drift apart."""
    from convit_scale.planner import DECODE_MS_HERE, LOADER_VS_DECODE

    text = (REPO / "BENCHMARKS.md").read_text()
    rows = re.findall(r"^\| (ffcv|wds|imagefolder) \| `?([\w-]+)`? \| ([\d.]+) \| ([\d.]+)x \|", text, re.M)
    assert {(f, m): float(x) for f, m, _, x in rows} == LOADER_VS_DECODE
    assert f"whole-JPEG decode {DECODE_MS_HERE} CPU ms per image" in text
