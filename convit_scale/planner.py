"""Memory, communication and time per GPU for each layout of a recipe's job (`convit-scale plan`).

Layouts: ddp; fsdp2 resharding after forward (ZeRO-3-like) or not; HSDP (fsdp2 sharding inside groups of
world/replicas ranks, replicating across them; replicas = nodes keeps the shards inside a node); ZeRO-1/2/3.

Memory model (bytes; P parameters, N ranks sharding, c = 2 in bf16 / 4 in fp32 compute):
- model state with AdamW is 16 bytes per parameter in fp32 (master 4 + gradient 4 + two moments 8):
  ddp 16P (+4P while it rebuilds its buckets after step 1); fsdp2 16P/N (+4P/N of gradient buffers)
  plus the unsharded working set of two blocks (c + 4 bytes per block parameter), or with no resharding after
  forward every block's parameters (cP) from forward to backward;
  zero1 keeps parameters and gradients whole (2c P) and shards master + moments (12P/N, or 8P/N in fp32);
  zero2 also shards gradients; zero3 shards everything and keeps the gathered parameters DeepSpeed lets
  live (``stage3_max_live_parameters``, at most the model) and a bucket of gradients being reduced (its
  fp32 partitions double as the master weights in fp32 runs); sizes from ``parallel.zero_config.zero_sizes``,
  the function that writes the engine's DeepSpeed config, for a GPU or (``--gpu cpu``) the CPU.
- activations: the bytes autograd saves per image, counted exactly by a forward on the meta device
  (no memory used), times the micro-batch; with activation checkpointing, one block's worth plus every
  block's input.

Communication model: ``step_collectives`` lists, per layout, the collectives of one optimizer step, each with its
bytes (the full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), its calls, the
process group (ranks, nodes spanned) and when it runs (forward, backward, or after backward where nothing hides it).
It follows what the engine's strategies issue (checked against the bytes counted at the c10d dispatcher on CPU,
tests/test_planner_comm.py): FSDP2 all-gathers each block's parameters in the compute dtype in forward, again in
backward when it reshards after forward, on every micro-batch, and reduce-scatters fp32 gradients on the last
micro-batch only (``set_requires_gradient_sync``), HSDP all-reducing the shards across replicas after that; DDP
all-reduces fp32 gradients (autocast keeps fp32 parameters) in 25 MiB buckets on the last micro-batch (its buffers,
deterministic, are not re-broadcast); ZeRO-1/2 all-reduce each gradient bucket in DeepSpeed's communication dtype
(``communication_data_type``, else the precision's) at the accumulation boundary (ZeRO-2: every micro-batch) and
all-gather the updated parameters after the optimizer step; ZeRO-3 all-gathers parameters in forward (keeping those
it reuses within ``stage3_max_reuse_distance`` elements for backward) and reduce-scatters gradients every
micro-batch. Every layout adds the engine's one packed all-reduce per step (``STEP_REDUCTION_BYTES``: the loss,
non-finite flags, squared gradient norm, replaced samples and the flags every rank acts on alike: stop, save, log,
failed save, broken decoder; ``train/step.py``), after backward.
Collective model (NCCL's ring): a collective of B bytes over r ranks sends (and receives) B(r-1)/r per rank for an
all-gather or reduce-scatter, 2B(r-1)/r for an all-reduce, B for a broadcast. Across k nodes of q ranks a ring enters
and leaves each node once per channel, and the node's q NICs carry its channels: 1/q of a rank's bytes cross nodes,
on its own NIC, the rest stays on NVLink. HSDP is two-level: shard-group collectives inside a node, the all-reduce
of the shards across nodes one rank per node. Time = max(intra bytes / intra bandwidth, inter bytes / inter
bandwidth) + a latency per call of NCCL's ring model (``NCCL_RING_LATENCY_US``), with the links at
``LINK_EFFICIENCY`` of ``hardware.GPUS``' data-sheet rates unless given.
Overlap model: compute is a third forward, two thirds backward (3 x forward FLOPs at ``mfu`` of the peak); the
collectives of a phase run beside its compute (FSDP2/ZeRO-3 prefetch, DDP/ZeRO buckets overlapping backward), so
a phase exposes what exceeds its compute, and at least its first (forward) or last (backward) call, which has
nothing to run beside; what runs after backward (ZeRO's reductions when one bucket holds the model or when
``overlap_comm`` is off, ZeRO-1/2's parameter all-gather after the step) is exposed whole. Compute slowed by
sharing the GPU with communication kernels is not modelled.
Step = compute + exposed communication, or the loader's time for the GPU's images when that is longer; the
loader gives ``cpus_per_gpu`` x 1000 / its CPU ms per image (``LOADER_VS_DECODE`` x the node's JPEG decode) images/s.
"Bound by": memory (no micro-batch fits), else the largest of compute, exposed communication and loader time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from .config import ParallelConfig, group_shares, model_options
from .data.device_augment import augment_on_device, handover_of
from .hardware import GPUS, LINK_EFFICIENCY
from .models import create_model
from .parallel.zero_config import deepspeed_config, zero_sizes

IMAGENET_TRAIN = 1_281_167

LOADER_VS_DECODE = {
    ("ffcv", "cpu"): 6.06, ("ffcv", "pixels"): 2.83, ("ffcv", "box"): 0.86, ("ffcv", "decode-on-device"): 0.04,
    ("wds", "cpu"): 6.15, ("wds", "pixels"): 2.94, ("wds", "box"): 1.13, ("wds", "decode-on-device"): 0.13,
    ("imagefolder", "cpu"): 5.52, ("imagefolder", "pixels"): 3.05, ("imagefolder", "box"): 1.62,
}
"""CPU time per training image of one rank's loader (one worker, DeiT's full recipe at 224), as a ratio to the
decode of the whole JPEG measured in the same run, by (data.format, mode; ``bench/stages.py`` names the modes):
``convit-scale bench data --stages --rounds 1 --seconds 3 --out runs/bench`` (BENCHMARKS.md, "Data loading";
500x375 q90 photographs, FFCV with the source JPEGs kept, as ``prep ffcv`` writes them; ImageFolder decodes
every file whole)."""

DECODE_MS_HERE = 0.721
"""The whole-JPEG decode of that run, CPU ms per image, on this project's 2-core x86-64 machine: the figure ``plan``
multiplies the ratios by when the node it plans for has no calibration (``convit-scale bench data --calibrate``)."""

DEVICE_MS_PER_IMAGE = {"box": 0.02, "decode-on-device": 0.1}
"""GPU time per image of the work a mode moves to the training device, added to the step's compute: the batched
resize of ``device_resize.py`` (about 0.9 GFLOP of float32 matrix products per 224 crop of an ImageNet box: tens of
microseconds on an H100/H200) and nvJPEG's decode (DALI feeds about 7,000 images/s per H100 with decode and crop on
the GPU). Estimates, not measured on a GPU here: ``make gpu-test GROUP=4`` measures the resize and the decode."""

LOADER_MODES = ("cpu", "pixels", "box", "decode-on-device")
"""From most CPU work to least; ``box`` gives the CPU path's pixels exactly (``bench pixels``), ``decode-on-device``
nvJPEG's (its own IDCT), so a plan prefers ``box``."""


def calibration_path() -> Path:
    """Where ``bench data --calibrate`` writes this node's decode cost and ``plan`` reads it: CONVIT_SCALE_CALIBRATION,
    else ~/.cache/convit-scale/calibration.json."""
    return Path(os.environ.get("CONVIT_SCALE_CALIBRATION") or Path.home() / ".cache" / "convit-scale" /
                "calibration.json")


def node_decode_ms() -> tuple[float, str | None]:
    """This node's whole-JPEG decode, CPU ms per image, and a warning when there is no calibration to read."""
    path = calibration_path()
    try:
        return float(json.loads(path.read_text())["decode_cpu_ms_per_image"]), None
    except (OSError, ValueError, KeyError, TypeError):
        return DECODE_MS_HERE, (f"no calibration of this node's CPU at {path}: the loader's cost is this project's "
                                f"machine's ({DECODE_MS_HERE} ms per JPEG decode); run `convit-scale bench data "
                                "--calibrate` on a node of the cluster (a few seconds)")


NCCL_RING_LATENCY_US = {"base": 8.4, "nvlink_step": 3.4, "net_step": 9.6}
"""NCCL's model of a ring collective's latency, Simple protocol (src/graph/tuning.cc: baseLat, hwLat): a base, plus
per ring step 3.4 us over NVLink and 9.6 us across the network; an all-gather over r ranks in k nodes takes r - 1
steps of which k - 1 cross nodes, an all-reduce twice as many."""

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's ``bucket_cap_mb`` default (the engine does not set it); its first bucket is 1 MiB."""


@dataclass(frozen=True)
class ModelFacts:
    params: int
    block_params: int
    fwd_flops_per_image: float
    act_bytes_per_image: float
    act_ckpt_bytes_per_image: float
    root_params: int = 0
    """Parameters outside the blocks (patch embedding, tokens, position embedding, norm, head): FSDP2's root unit."""
    depth: int = 1
    param_table: tuple[tuple[int, int, bool], ...] = ()
    """(elements, size of dim 0, in a block) of each parameter: FSDP2 and ZeRO-3 pad each to a multiple of the
    ranks sharding it."""

    def padded(self, ranks: int, blocks: bool | None = None, min_elements: int = 0, dim0: bool = True) -> int:
        """Elements of the parameters (of the blocks, of the root, or all), each padded as a shard of ``ranks``:
        FSDP2 splits dim 0 (``dim0``), ZeRO-3 the flattened parameter; those under ``min_elements`` left out."""
        total = 0
        for numel, d0, in_block in self.param_table:
            if (blocks is None or in_block == blocks) and numel >= min_elements:
                rows, row = (d0, numel // max(d0, 1)) if dim0 else (numel, 1)
                total += math.ceil(rows / ranks) * ranks * row
        return total


_FACTS: dict[str, ModelFacts] = {}


def model_facts(cfg, compute_bytes: int = 2) -> ModelFacts:
    """Parameters, FLOPs and saved-activation bytes per image, all from a meta-device forward (a few seconds of
    CPU: kept per model, its options and the compute dtype)."""

    options = model_options(cfg.model)
    key = repr((cfg.model.name, sorted(options.items()), compute_bytes))
    if key not in _FACTS:
        _FACTS[key] = _measure_model(cfg.model.name, options, compute_bytes)
    return _FACTS[key]


def _measure_model(name: str, options: dict, compute_bytes: int) -> ModelFacts:
    dtype = torch.bfloat16 if compute_bytes == 2 else torch.float32
    model = create_model(name, device="meta", **options).to(dtype)
    size = model.patch_embed.img_size[0]

    counter = FlopCounterMode(display=False)

    def saved(batch: int) -> int:
        """Bytes autograd saves for a forward of ``batch`` images; the FLOPs of one image are counted alongside
        (the flop counter changes nothing that is saved)."""
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        x = torch.empty(batch, 3, size, size, device="meta", dtype=dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                (counter if batch == 1 else contextlib.nullcontext()):
            out = model(x)
        del out
        return total

    per_image = saved(2) - saved(1)  # the batch-independent part is the weights saved for backward
    depth = len(model.blocks)
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    block_input = tokens * model.embed_dim * compute_bytes
    params = sum(p.numel() for p in model.parameters())
    in_blocks = sum(p.numel() for p in model.blocks.parameters())
    return ModelFacts(
        params=params,
        block_params=max(sum(p.numel() for p in b.parameters()) for b in model.blocks),
        fwd_flops_per_image=counter.get_total_flops(),
        act_bytes_per_image=per_image,
        act_ckpt_bytes_per_image=per_image / depth + depth * block_input,
        root_params=params - in_blocks, depth=depth,
        param_table=tuple((p.numel(), p.shape[0] if p.dim() else 1, name.startswith("blocks."))
                          for name, p in model.named_parameters()),
    )


def state_bytes(strategy: str, f: ModelFacts, n: int, c: int, zero: dict | None = None,
                reshard_after_forward: bool = True) -> dict[str, float]:
    """Parameters, gradients and optimizer state per rank, in bytes; ``zero``: ``zero_sizes`` (zero3)."""
    P = f.params
    master = 4  # fp32 master weights (and the parameters themselves in fp32 runs)
    if strategy in ("ddp", "none"):
        # DDP rebuilds its gradient buckets after the first iteration: for a moment a second copy of the
        # gradients exists (measured on CPU: peak = 20 bytes/param before activations).
        return {"params": master * P, "grads": 4 * P + (4 * P if strategy == "ddp" else 0), "optimizer": 8 * P}
    if strategy == "fsdp2":
        working = 2 * f.block_params * (c + 4)  # two blocks gathered (prefetch) + their unsharded grads
        if not reshard_after_forward:  # every block stays gathered from its forward to its backward
            working = P * c + 2 * f.block_params * 4
        # the reduce-scattered gradient shards and their fp32 accumulation buffers coexist for the last
        # blocks of backward (measured on CPU: +4 bytes/param/N)
        return {"params": master * P / n + working, "grads": 8 * P / n, "optimizer": 8 * P / n}
    low = c if c == 2 else 0  # DeepSpeed bf16: a bf16 module copy besides the fp32 master
    if strategy == "zero1":
        return {"params": (low or 4) * P + (master * P / n if low else 0), "grads": (low or 4) * P,
                "optimizer": 8 * P / n}
    if strategy == "zero2":
        return {"params": (low or 4) * P + (master * P / n if low else 0), "grads": (low or 4) * P / n,
                "optimizer": 8 * P / n}
    if zero is None:
        zero = zero_sizes(ParallelConfig(strategy="zero3"), P)
    gathered = min(P, zero["max_live_parameters"])
    # the gathered parameters and one bucket of gradients being reduced (DeepSpeed allocates its ipg
    # bucket whole)
    return {"params": ((low or 4) + (master if low else 0)) * P / n + gathered * (low or 4),
            "grads": (low or 4) * P / n + zero["bucket"] * (low or 4), "optimizer": 8 * P / n}


# -- layouts --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How the ranks share the model: the ``parallel.*`` keys a layout sets (the rest stays the recipe's)."""

    strategy: str
    reshard_after_forward: bool = True
    hsdp_replicas: int = 1

    @classmethod
    def of(cls, p: ParallelConfig, world: int = 1, per_node: int = 1) -> "Layout":
        """The recipe's layout on ``world`` ranks of ``per_node`` per node: its HSDP mesh as the run would build it
        (``ParallelConfig.hsdp_mesh``: ``hsdp_per_node`` gives a replica per node)."""
        if p.strategy != "fsdp2":
            return cls(p.strategy)
        return cls("fsdp2", p.reshard_after_forward, p.hsdp_mesh(world, per_node)[0])

    def name(self, world: int) -> str:
        if self.strategy != "fsdp2":
            return self.strategy
        base = f"hsdp {self.hsdp_replicas}x{world // self.hsdp_replicas}" if self.hsdp_replicas > 1 else "fsdp2"
        return base if self.reshard_after_forward else f"{base} no-reshard"

    def overrides(self) -> list[str]:
        out = [f"parallel.strategy={self.strategy}"]
        if self.strategy == "fsdp2":
            out += [f"parallel.hsdp_replicas={self.hsdp_replicas}",
                    f"parallel.reshard_after_forward={str(self.reshard_after_forward).lower()}"]
        return out

    def apply(self, p: ParallelConfig) -> ParallelConfig:
        if self.strategy != "fsdp2":
            return dataclasses.replace(p, strategy=self.strategy, hsdp_replicas=1)
        return dataclasses.replace(p, strategy="fsdp2", reshard_after_forward=self.reshard_after_forward,
                                   hsdp_replicas=self.hsdp_replicas)


def standard_layouts(nodes: int) -> list[Layout]:
    """The layouts the plan compares: HSDP with one replica per node where there are several nodes."""
    out = [Layout("ddp"), Layout("fsdp2"), Layout("fsdp2", False)]
    if nodes > 1:
        out += [Layout("fsdp2", True, nodes), Layout("fsdp2", False, nodes)]
    return out + [Layout("zero1"), Layout("zero2"), Layout("zero3")]


# -- communication: what each strategy sends ----------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One kind of collective of an optimizer step on one kind of process group."""

    kind: str  # all_gather | reduce_scatter | all_reduce | broadcast
    nbytes: float  # per optimizer step: the full buffers of all its calls
    calls: float  # per optimizer step
    ranks: int  # ranks of each of its groups
    nodes: int  # nodes each group spans
    phase: str  # forward | backward | after (after backward: nothing left to hide it behind)
    micro_batches: int  # on how many of the step's micro-batches it runs (every one, or the last)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a precision (``parallel.precision``, DeepSpeed's ``communication_data_type``)."""
    return {"fp32": 4, "bf16": 2, "fp16": 2}[name]


def zero_comm_bytes(p: ParallelConfig, params: int, device: str) -> int:
    """Bytes per gradient element ZeRO reduces: the DeepSpeed config's ``communication_data_type`` when the engine
    sets one, else DeepSpeed's default, the precision's (DeepSpeedEngine.communication_data_type)."""
    ds = deepspeed_config(p, 1, 1, 1, params, None, device=torch.device(device))
    return dtype_bytes(str(ds.get("communication_data_type") or p.precision).lower())


STEP_REDUCTION_BYTES = 9 * 8
"""The engine's packed all-reduce of a step: nine float64 values (``train/step.py``'s ``StepTotals``)."""


def step_collectives(p: ParallelConfig, facts: ModelFacts, nodes: int, gpus_per_node: int, accum: int,
                     device: str = "cuda") -> list[Collective]:
    """The collectives each rank takes part in during one optimizer step of ``accum`` micro-batches."""
    world = nodes * gpus_per_node
    if world == 1:
        return []
    if p.strategy in ("ddp", "none"):
        out = _ddp_collectives(facts, world, nodes)
    elif p.strategy == "fsdp2":
        out = _fsdp2_collectives(p, facts, nodes, gpus_per_node, accum)
    else:
        out = _zero_collectives(p, facts, world, nodes, accum, device)
    return out + [Collective("all_reduce", STEP_REDUCTION_BYTES, 1, world, nodes, "after", 1)]


def _ddp_collectives(f: ModelFacts, world: int, nodes: int) -> list[Collective]:
    grad = 4 * f.params  # fp32 gradients: autocast leaves the parameters fp32
    buckets = 1 + math.ceil(max(0, grad - 2**20) / DDP_BUCKET_BYTES)
    return [Collective("all_reduce", grad, buckets, world, nodes, "backward", 1)]


def _fsdp2_collectives(p: ParallelConfig, f: ModelFacts, nodes: int, g: int, accum: int) -> list[Collective]:
    world, replicas = nodes * g, p.hsdp_replicas
    shard = world // replicas  # the mesh is (replicate, shard): a shard group is `shard` consecutive ranks
    shard_nodes, replicate_nodes = max(1, math.ceil(shard / g)), min(replicas, nodes)
    c = dtype_bytes(p.precision)  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    units = f.depth + 1  # one per block and the root
    every, blocks = f.padded(shard), f.padded(shard, blocks=True)
    out = []
    if shard > 1:  # a 1-rank shard group sends nothing
        out.append(Collective("all_gather", c * every * accum, units * accum, shard, shard_nodes, "forward", accum))
        if p.reshard_after_forward:  # the root never reshards after forward
            out.append(Collective("all_gather", c * blocks * accum, f.depth * accum, shard, shard_nodes, "backward",
                                  accum))
        out.append(Collective("reduce_scatter", 4 * every, units, shard, shard_nodes, "backward", 1))
    if replicas > 1:  # HSDP: each shard's gradient all-reduced across the replicas
        out.append(Collective("all_reduce", 4 * every / shard, units, replicas, replicate_nodes, "backward", 1))
    return out


def _zero_collectives(p: ParallelConfig, f: ModelFacts, world: int, nodes: int, accum: int,
                      device: str) -> list[Collective]:
    P, stage = f.params, int(p.strategy[-1])
    z = zero_sizes(p, P, device)
    comm = zero_comm_bytes(p, P, device)
    param = dtype_bytes(p.precision)
    reduced = accum if stage >= 2 else 1  # ZeRO-1 reduces at the accumulation boundary only
    buckets = math.ceil(P / z["bucket"])
    # the reduction runs in backward as buckets fill; with overlap_comm off it holds the compute stream
    where = "backward" if z["overlap_comm"] else "after"
    if stage < 3:
        return [Collective("all_reduce", comm * P * reduced, buckets * reduced, world, nodes, where, reduced),
                # the updated parameters, one all-gather per optimizer parameter group (decay, no decay)
                Collective("all_gather", param * P, 2, world, nodes, "after", 1)]
    # parameters under the persistence threshold stay whole on every rank and are never gathered
    gathered = f.padded(world, min_elements=z["param_persistence_threshold"], dim0=False)
    # a parameter whose next use (backward) comes within max_reuse_distance elements of the module trace is kept:
    # the block used k-th from the end of forward is reused after about 2k/depth of the model
    regather = max(0.0, 1 - z["max_reuse_distance"] / (2 * gathered))
    fetches = math.ceil(gathered / z["prefetch_bucket"]) + 1
    out = [Collective("all_gather", param * gathered * accum, fetches * accum, world, nodes, "forward", accum),
           Collective("reduce_scatter", comm * P * accum, buckets * accum, world, nodes, where, accum)]
    if regather > 0:
        out.append(Collective("all_gather", param * gathered * regather * accum, fetches * accum, world, nodes,
                              "backward", accum))
    return out


def bytes_by_kind(collectives: list[Collective]) -> dict[str, float]:
    """Full-buffer bytes per step by kind of collective (what tests/test_planner_comm.py counts at the dispatcher)."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0.0) + c.nbytes
    return out


# -- communication: time ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Links:
    """Achieved bandwidth per GPU, one direction, GB/s."""

    intra_gbytes_s: float
    inter_gbytes_s: float

    @classmethod
    def of(cls, gpu: str, intra: float | None = None, inter: float | None = None) -> "Links":
        """The GPU's data-sheet links at ``LINK_EFFICIENCY``, or the figures given (measured busbw: as they are)."""
        g = GPUS[gpu]
        return cls(intra or g.intra_gbytes_s * LINK_EFFICIENCY, inter or g.inter_gbytes_s * LINK_EFFICIENCY)


def sent_bytes(c: Collective) -> tuple[float, float]:
    """(intra-node, inter-node) bytes each rank sends for ``c`` in a step (it receives as many)."""
    r = c.ranks
    ring = {"all_gather": (r - 1) / r, "reduce_scatter": (r - 1) / r, "all_reduce": 2 * (r - 1) / r}
    sent = ring.get(c.kind, 1.0 if r > 1 else 0.0) * c.nbytes
    inter = sent / (r / c.nodes) if c.nodes > 1 else 0.0  # 1/q of it leaves the node, q ranks per node
    return sent - inter, inter


def collective_seconds(c: Collective, links: Links) -> dict[str, float]:
    intra, inter = sent_bytes(c)
    steps, inter_steps = (c.ranks - 1, c.nodes - 1)
    if c.kind == "all_reduce":
        steps, inter_steps = 2 * steps, 2 * inter_steps
    lat = NCCL_RING_LATENCY_US
    latency = c.calls * (lat["base"] + (steps - inter_steps) * lat["nvlink_step"] + inter_steps * lat["net_step"])
    intra_s, inter_s = intra / (links.intra_gbytes_s * 1e9), inter / (links.inter_gbytes_s * 1e9)
    return {"intra_s": intra_s, "inter_s": inter_s, "latency_s": latency * 1e-6,
            "total_s": max(intra_s, inter_s) + latency * 1e-6}


def exposed_seconds(collectives: list[Collective], links: Links, compute_s: float, accum: int) -> float:
    """Communication the step's compute does not hide (the overlap model of the module's docstring)."""
    windows = {"forward": compute_s / accum / 3, "backward": 2 * compute_s / accum / 3, "after": 0.0}
    total = 0.0
    for micro in range(accum):
        on = [c for c in collectives if c.micro_batches == accum or micro == accum - 1]
        for phase, window in windows.items():
            times = [(collective_seconds(c, links)["total_s"] / c.micro_batches, c.calls / c.micro_batches)
                     for c in on if c.phase == phase]
            if not times:
                continue
            busy = sum(t for t, _ in times)
            first_or_last = max(t / max(calls, 1) for t, calls in times)
            total += busy if phase == "after" else max(busy - window, first_or_last)
    return total


def communication(collectives: list[Collective], links: Links, compute_s: float, accum: int) -> dict[str, float]:
    """Bytes (sent + received) and seconds of a step's communication, per GPU, intra- and inter-node."""
    sent = [sent_bytes(c) for c in collectives]
    secs = [collective_seconds(c, links) for c in collectives]
    return {"intra_bytes": 2 * sum(s[0] for s in sent), "inter_bytes": 2 * sum(s[1] for s in sent),
            "intra_s": sum(s["intra_s"] for s in secs), "inter_s": sum(s["inter_s"] for s in secs),
            "latency_s": sum(s["latency_s"] for s in secs), "comm_s": sum(s["total_s"] for s in secs),
            "exposed_s": exposed_seconds(collectives, links, compute_s, accum),
            "calls": sum(c.calls for c in collectives)}


# -- the plan -------------------------------------------------------------------------------------------------------
def loader_mode(cfg) -> str:
    """The mode of the recipe's loader on a CUDA run (``bench/stages.py``'s names)."""
    cuda = torch.device("cuda")
    handover = handover_of(cfg.data, cuda)
    if handover != "pixels":
        return {"box": "box", "jpeg": "decode-on-device"}[handover]
    return "pixels" if augment_on_device(cfg.data, cuda) else "cpu"


def loader_ms_per_image(cfg, mode: str | None = None) -> tuple[float, str]:
    """CPU ms per image of the recipe's loader in ``mode`` (default: the recipe's on a CUDA run) on this node, and
    the mode: the same-run ratio (``LOADER_VS_DECODE``) times the node's decode (``node_decode_ms``)."""
    mode = mode or loader_mode(cfg)
    return LOADER_VS_DECODE[(cfg.data.format, mode)] * node_decode_ms()[0], mode


def plan(cfg, nodes: int, gpus_per_node: int, gpu: str, mfu: float = 0.4, layouts=None,
         links: Links | None = None, cpus_per_gpu: float | None = None) -> list[dict]:
    """One row per layout (default: ``standard_layouts(nodes)`` and the recipe's own; a name such as "zero3" is that
    strategy's layout). ``cpus_per_gpu``: the loader's cores, None to leave the loader out."""
    c = dtype_bytes(cfg.parallel.precision)
    facts = model_facts(cfg, c)
    links = links or Links.of(gpu)
    own = Layout.of(cfg.parallel, nodes * gpus_per_node, gpus_per_node)
    chosen = [Layout(x) if isinstance(x, str) else x for x in (layouts or standard_layouts(nodes))]
    if layouts is None and own not in chosen:
        chosen.append(own)
    rows = [_row(cfg, facts, layout, nodes, gpus_per_node, gpu, mfu, links, cpus_per_gpu) for layout in chosen]
    for layout, row in zip(chosen, rows):
        row["recipe_layout"] = layout == own
    return rows


_TEACHER_FLOPS: dict = {}


def teacher_flops(name: str, img_size: int) -> int:
    """FLOPs of a timm teacher's forward of one image (Table 4's RegNetY-16GF), counted on the meta device."""
    key = (name, img_size)
    if key not in _TEACHER_FLOPS:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.empty(1, 3, img_size, img_size, device="meta"))
        _TEACHER_FLOPS[key] = counter.get_total_flops()
    return _TEACHER_FLOPS[key]


def train_flops_per_image(cfg, facts: ModelFacts, p: ParallelConfig) -> float:
    """A training step's FLOPs per image: forward and backward (3 x forward, MFU's convention), one more forward with
    activation checkpointing (each block's forward is recomputed in backward), and the teacher's forward (Table 4)."""
    flops = (4 if p.activation_checkpointing else 3) * facts.fwd_flops_per_image
    if cfg.distill.enabled:
        flops += teacher_flops(cfg.distill.teacher_model, cfg.model.img_size or 224)
    return flops


def loader_cores(cfg, cpus_per_gpu: float) -> float:
    """The cores a rank's loader can use: its CPUs, at most ``data.num_workers`` of them (0: the main process)."""
    return min(cpus_per_gpu, max(1, cfg.data.num_workers))


def _row(cfg, facts: ModelFacts, layout: Layout, nodes: int, g: int, gpu: str, mfu: float, links: Links,
         cpus_per_gpu: float | None) -> dict:
    world, c = nodes * g, dtype_bytes(cfg.parallel.precision)
    p = layout.apply(cfg.parallel)
    global_batch, groups = cfg.data.global_batch_size, cfg.data.groups
    # the busiest rank's images: with unequal shares of the canonical groups the step waits for it
    per_rank = max(group_shares(groups, world)) * (global_batch // groups) if world <= groups else None
    act = facts.act_ckpt_bytes_per_image if p.activation_checkpointing else facts.act_bytes_per_image
    budget = GPUS[gpu].memory_gib * 2**30 * 0.9 - (2**30 if gpu != "cpu" else 0)  # fragmentation, CUDA context
    device = "cpu" if gpu == "cpu" else "cuda"
    st = state_bytes(p.strategy, facts, world // p.hsdp_replicas, c, zero_sizes(p, facts.params, device),
                     p.reshard_after_forward)
    fixed = sum(st.values())
    fit = int((budget - fixed) // act) if budget > fixed else 0
    micro = accum = None
    want = cfg.data.micro_batch_size  # the recipe's, when it names one: that, if it fits
    if per_rank is not None and fit > 0:
        if want is None:
            micro = max(d for d in range(1, per_rank + 1) if per_rank % d == 0 and d <= fit)
        elif per_rank % want == 0 and want <= fit:
            micro = want
        accum = per_rank // micro if micro else None
    images = per_rank if per_rank is not None else global_batch / world
    compute_s = train_flops_per_image(cfg, facts, p) * images / (GPUS[gpu].peak_tflops * 1e12 * mfu)
    compute_s += images * DEVICE_MS_PER_IMAGE.get(loader_mode(cfg), 0.0) / 1000 if gpu != "cpu" else 0.0
    comm = communication(step_collectives(p, facts, nodes, g, accum or 1, device), links, compute_s, accum or 1)
    ms, _ = loader_ms_per_image(cfg)
    loader_s = images * ms / (loader_cores(cfg, cpus_per_gpu) * 1000) if cpus_per_gpu else None
    step_s = max(compute_s + comm["exposed_s"], loader_s or 0.0)
    shares = {"compute": compute_s, "communication": comm["exposed_s"], "loader": loader_s or 0.0}
    steps = cfg.schedule.epochs * math.floor(IMAGENET_TRAIN * cfg.data.subset_fraction / global_batch)
    return {
        "layout": layout.name(world), "strategy": p.strategy, "overrides": layout.overrides(),
        "params_gib": st["params"] / 2**30, "grads_gib": st["grads"] / 2**30, "optimizer_gib": st["optimizer"] / 2**30,
        "activations_gib": (act * micro / 2**30) if micro else None,
        "total_gib": (fixed + act * (micro or 0)) / 2**30, "max_micro_batch": fit, "micro_batch": micro,
        "grad_accumulation": accum, "compute_s": compute_s, "loader_s": loader_s, **comm,
        "bound_by": "memory" if micro is None else max(shares, key=shares.get),
        "step_s": step_s, "steps": steps, "gpu_hours": step_s * steps * world / 3600,
        "wall_clock_h": step_s * steps / 3600,
    }


EQUALLY_FAST = 0.02
"""Steps within 2% of the fastest count as equally fast: closer than this model can tell layouts apart."""


def recommend(rows: list[dict]) -> dict | None:
    """The fastest layout that fits memory. Of equally fast ones the recipe's own (nothing to change), else the one
    communicating least (the most room for a faster compute than the MFU assumed, or a slower network)."""
    fits = [r for r in rows if r["micro_batch"] is not None]
    if not fits:
        return None
    fastest = min(r["step_s"] for r in fits)
    close = [r for r in fits if r["step_s"] <= fastest * (1 + EQUALLY_FAST)]
    return min(close, key=lambda r: (not r.get("recipe_layout", False), r["comm_s"]))


def loader_check(cfg, gpu: str, cpus_per_gpu: float, mfu: float = 0.4, world: int = 1) -> dict:
    """Images/s per GPU the training step's compute needs against what the loader gives from ``cpus_per_gpu`` cores,
    in the recipe's mode on a CUDA run (``loader_mode``) and in every mode of its format: the CPU cores per GPU each
    needs, and the mode that keeps the GPU fed (the recipe's, else the least CPU work whose pixels are the CPU
    path's, else any: ``LOADER_MODES``).

    The loader's rate is ``loader_cores`` (the CPUs, at most ``data.num_workers``) x 1000 / its CPU ms per image on
    this node (``loader_ms_per_image``); the device's share of a mode's work (``DEVICE_MS_PER_IMAGE``) is part of the
    step's compute."""
    c = dtype_bytes(cfg.parallel.precision)
    facts = model_facts(cfg, c)
    global_batch = cfg.data.global_batch_size
    flops = train_flops_per_image(cfg, facts, cfg.parallel)
    step_s = flops * global_batch / (world * GPUS[gpu].peak_tflops * 1e12 * mfu)
    step_s += global_batch / world * DEVICE_MS_PER_IMAGE.get(loader_mode(cfg), 0.0) / 1000
    need = global_batch / world / step_s
    ms, mode = loader_ms_per_image(cfg)
    give = loader_cores(cfg, cpus_per_gpu) * 1000 / ms
    modes = {}
    for m in LOADER_MODES:
        if (cfg.data.format, m) in LOADER_VS_DECODE:
            m_ms = loader_ms_per_image(cfg, m)[0]
            modes[m] = {"cpu_ms_per_image": m_ms, "cores_per_gpu": need * m_ms / 1000}
    fed = [m for m in (mode, "box", *LOADER_MODES) if m in modes and modes[m]["cores_per_gpu"] <= cpus_per_gpu]
    return {"gpu_images_per_s": need, "loader_images_per_s": give, "cpu_ms_per_image": ms, "mode": mode,
            "augment_on": "cpu" if mode == "cpu" else "device", "modes": modes, "fed_by": fed[0] if fed else None,
            "format": cfg.data.format, "cpus_per_gpu": cpus_per_gpu, "loader_cores": loader_cores(cfg, cpus_per_gpu),
            "step_s": step_s, "decode_warning": node_decode_ms()[1],
            "bottleneck": "loader" if give < need else "gpus"}
