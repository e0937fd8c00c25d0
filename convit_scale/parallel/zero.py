"""DeepSpeed ZeRO stages 1/2/3 with DeepSpeed's own (sharded) checkpoints."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import types
from pathlib import Path

import torch

from .. import comm
from .base import Strategy

# DeepSpeed's own defaults, sized for GPUs (deepspeed/runtime/zero/config.py)
GPU_DEFAULTS = {"bucket": int(5e8), "overlap_comm": True, "param_persistence_threshold": int(1e5),
                "prefetch_bucket": int(5e7), "max_live_parameters": int(1e9), "max_reuse_distance": int(1e9),
                "sub_group_size": int(1e9)}
BUCKET_ALIGN = 8
"""Bucket sizes are multiples of this: DeepSpeed's ZeRO-1/2 refuse an all-gather bucket that is not a multiple of
their NCCL alignment (2 elements; a tenth of ConViT-B+ is 15,313,485.6)."""
BUCKET_RANGE = (int(1e6), int(5e8))
"""Bucket sizes (elements) are a tenth of the model within this range, unless ``parallel.zero_bucket_elements``
says otherwise: with DeepSpeed's 5e8 a model of up to 500M parameters (ConViT-B+ has 153M) fills one bucket, whose
reduction starts only after the whole backward; a tenth lets nine tenths of the reduction overlap it."""


def zero_sizes(p, num_params: int, device: torch.device | str = "cpu") -> dict:
    """The ZeRO buffer sizes (elements) and switches for ``p`` (a ParallelConfig) on ``device``.

    Each ``parallel.zero_*`` key that is set wins. Buckets (reduce and all-gather) are ``zero_bucket_elements`` or a
    tenth of the model within ``BUCKET_RANGE`` on any device. The other keys take DeepSpeed's defaults on CUDA; on
    CPU they are sized from the model too, because DeepSpeed's defaults cost more memory than a small model (and on
    CPU ZeRO-3 with them used more memory per rank than DDP): prefetch, live parameters, reuse distance and
    optimizer sub-groups of a bucket, no overlap of communication (no streams to overlap on), every parameter
    sharded (persistence threshold 0). The engine (``deepspeed_config``) and the planner both read their sizes
    from here.
    """
    low, high = BUCKET_RANGE
    bucket = p.zero_bucket_elements or -(-int(min(high, max(low, num_params / 10))) // BUCKET_ALIGN) * BUCKET_ALIGN
    if torch.device(device).type == "cuda":
        auto = {**GPU_DEFAULTS, "bucket": bucket}
    else:
        auto = {"bucket": bucket, "overlap_comm": False, "param_persistence_threshold": 0, "prefetch_bucket": bucket,
                "max_live_parameters": bucket, "max_reuse_distance": bucket, "sub_group_size": bucket}
    chosen = {"overlap_comm": p.zero_overlap_comm, "param_persistence_threshold": p.zero_param_persistence_threshold,
              "prefetch_bucket": p.zero_prefetch_bucket_elements, "max_live_parameters": p.zero_max_live_parameters,
              "max_reuse_distance": p.zero_max_reuse_distance}
    return {**auto, **{k: v for k, v in chosen.items() if v is not None}}


def deepspeed_config(p, micro_batch: int, grad_accum: int, world_size: int, num_params: int,
                     grad_clip: float | None = None, device: torch.device | str = "cpu") -> dict:
    """The DeepSpeed config of a ZeRO run; buffer sizes and switches from ``zero_sizes``."""
    stage = int(p.strategy[-1])
    z = zero_sizes(p, num_params, device)
    zero = {"stage": stage, "reduce_bucket_size": z["bucket"], "allgather_bucket_size": z["bucket"],
            "overlap_comm": z["overlap_comm"], "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=z["prefetch_bucket"],
                    stage3_max_live_parameters=z["max_live_parameters"],
                    stage3_max_reuse_distance=z["max_reuse_distance"],
                    # the optimizer steps one sub-group at a time, with a flat fp32 gradient copy and the
                    # optimizer's temporaries per sub-group: on CPU a whole-model sub-group (DeepSpeed's
                    # 1e9) doubles them, so there it is a bucket
                    sub_group_size=z["sub_group_size"],
                    # parameters under the threshold stay whole on every rank; 0 shards them all
                    stage3_param_persistence_threshold=z["param_persistence_threshold"])
    if p.zero_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "zero_optimization": zero,
        # DeepSpeed clips at 1.0 unless told: the loop clips (or not) as the recipe says.
        "gradient_clipping": grad_clip or 0.0,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # gradients reduced and accumulated in fp32, as FSDP2's reduce_dtype: bf16 sums of 32 ranks lose digits
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def share_fp32_master_partitions() -> None:
    """Let ZeRO-3 use its fp32 parameter partitions as the master weights instead of a copy of them.

    DeepSpeed means to: when the partitioned parameters already have the master dtype on the optimizer's
    device (fp32 training), ``_create_fp32_partitions`` reuses them. Its test compares a ``torch.device``
    with a device string, which is never equal, so it clones them: 4 more bytes per parameter, 1.25x of the
    16-byte ideal before any buffer. This wraps that method and puts the partitions back where the copy
    is an exact duplicate (same dtype, device and size; not offloaded, swapped or Muon-driven). Mixed
    precision (bf16/fp16 partitions, fp32 master) is untouched. Idempotent.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = Stage3._create_fp32_partitions
    if getattr(original, "_shares_partitions", False):
        return

    def create_fp32_partitions(self):
        original(self)
        if self.offload_optimizer or getattr(self, "use_muon", False) or getattr(self, "swap_optimizer", False):
            return
        for i, (lp, fp32) in enumerate(zip(self.fp16_partitioned_groups_flat, self.fp32_partitioned_groups_flat)):
            if (lp.dtype == fp32.dtype and lp.device == fp32.device and lp.numel() == fp32.numel() > 0
                    and lp.data_ptr() != fp32.data_ptr() and fp32 not in self.optimizer.state):
                lp.ds_id = fp32.ds_id
                lp.requires_grad = True
                self.fp32_partitioned_groups_flat[i] = lp

    create_fp32_partitions._shares_partitions = True
    Stage3._create_fp32_partitions = create_fp32_partitions


def cpu_adam_like(optimizer: torch.optim.Optimizer):
    """The same AdamW (parameter groups, betas, eps, weight decay) as DeepSpeed's vectorised CPU Adam,
    which ZeRO-Offload steps on the host: DeepSpeed refuses a torch optimizer there. The extension is
    compiled on first use (about a minute, cached in TORCH_EXTENSIONS_DIR)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    d = optimizer.defaults
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                            adamw_mode=True)


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (deepspeed_shm_comm) at its first init on each
    machine: about a minute of C++ on 2 cores, for an op that only its tensor-parallel inference calls
    (``inference_all_reduce``). Training's collectives go through torch.distributed, and with the op marked
    unavailable ``inference_all_reduce`` does too."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_args(device: torch.device):
    """What ``deepspeed.initialize`` gets as ``args``: the rank's own device index. Without it DeepSpeed's engine
    calls ``set_device(LOCAL_RANK)``, which on a site that gives each task one GPU (CUDA_VISIBLE_DEVICES of
    length 1) is "invalid device ordinal" for every local rank but 0."""
    return types.SimpleNamespace(device_rank=device.index if device.index is not None else 0) \
        if device.type == "cuda" else None


class _OptimizerGate:
    """The update of a step goes through the torch optimizer's ``step`` that DeepSpeed's ZeRO optimizer calls: while
    the gate is closed that call does nothing, so weights and moments stay exactly as they were whatever DeepSpeed's
    release does with a non-finite gradient (its overflow checks differ by release, stage and dtype), and the
    engine's ``step`` still resets its own accumulation state."""

    def __init__(self, optimizers):
        self.open = True
        for opt in optimizers:
            step = opt.step
            opt.step = lambda *a, _step=step, **k: _step(*a, **k) if self.open else None

    @contextlib.contextmanager
    def closed(self):
        self.open = False
        try:
            yield
        finally:
            self.open = True


UNIVERSAL = "universal"
"""The folder of a ZeRO checkpoint that holds its DeepSpeed universal checkpoint, once converted."""


UNIVERSAL_ZERO3_SINCE = (0, 19)
"""The oldest DeepSpeed release whose universal conversion was seen to handle a ZeRO-3 checkpoint (0.19.8 converts;
0.16.0 and 0.17.0 fail on the padding of ZeRO-3's partitions: "start (N) + length (L) exceeds dimension size (N)")."""


def universal_problem(strategy: str, deepspeed_version: str) -> str | None:
    """Why this DeepSpeed cannot convert a ``strategy`` checkpoint to a universal one, or None."""
    release = tuple(int(x) for x in deepspeed_version.split("+")[0].split(".")[:2])
    if strategy == "zero3" and release < UNIVERSAL_ZERO3_SINCE:
        since = ".".join(map(str, UNIVERSAL_ZERO3_SINCE))
        return (f"a ZeRO-3 checkpoint converts to DeepSpeed's universal checkpoint with DeepSpeed >= {since} "
                f"(installed: {deepspeed_version}); upgrade DeepSpeed, or resume on the world size the checkpoint "
                f"was written on")
    return None


def universal_checkpoint(directory: Path) -> Path:
    """``directory/universal``: DeepSpeed's universal checkpoint of the ZeRO state in ``directory/zero`` (any stage),
    converted by ``deepspeed.checkpoint.ds_to_universal`` into ``universal.tmp`` and published by an atomic rename, so
    an interrupted conversion is redone and a finished one is not. The conversion runs in this process
    (one extraction and one merge worker: no child process from a training rank)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    final, tmp = directory / UNIVERSAL, directory / (UNIVERSAL + ".tmp")
    if final.is_dir():
        return final
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    args = types.SimpleNamespace(input_folder=str(directory / "zero"), output_folder=str(tmp / "zero"),
                                 num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                 inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # not the run's log
        ds_to_universal(args)
    os.replace(tmp, final)
    return final


CONVERSION_BYTES_PER_S = 5e6
"""The slowest conversion rate the other ranks wait for: about a twentieth of ``universal_checkpoint``'s rate on 2 CPU
cores and a local disk (ConViT-B+ under ZeRO-3, 1.8 GB in 20 s: BENCHMARKS.md, "Elastic resume"), for a shared file
system several times slower."""


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def conversion_wait_s(directory: Path, timeout_s: float) -> float:
    """How long the other ranks wait for rank 0's conversion of ``directory``'s ZeRO checkpoint: the process group's
    timeout plus its files at ``CONVERSION_BYTES_PER_S`` (ConViT-B+ under ZeRO-3, 1.8 GB: 600 + 363 s)."""
    return timeout_s + folder_bytes(directory / "zero") / CONVERSION_BYTES_PER_S


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO-1/2/3. The loop decides on the step before DeepSpeed's engine takes it: the finiteness of
    the gradients comes from hooks on every parameter, which see each micro-batch's gradients as autograd computes
    them, before DeepSpeed reduces them into its partitions (a reduced gradient is non-finite only if a
    contribution is). A good step is ``engine.step()``; a bad one is the same call with the optimizer gated shut,
    so DeepSpeed resets its accumulation state and nothing is updated."""

    name = "zero"
    norm_is_global = False  # the hooks see contributions, not the reduced gradient: DeepSpeed reports the norm

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        import deepspeed

        if self.p.activation_checkpointing:
            self.module.set_grad_checkpointing(True)
        num_params = sum(p.numel() for p in self.module.parameters())
        optimizer = optimizer_fn(self.module)
        if self.p.zero_offload:
            optimizer = cpu_adam_like(optimizer)
        cfg = deepspeed_config(self.p, micro_batch, grad_accum, self.world_size, num_params, self.grad_clip,
                               device=self.device)
        share_fp32_master_partitions()
        if self.device.type == "cpu":
            skip_shm_comm_build()
        self._engine, self.optimizer, _, _ = deepspeed.initialize(args=deepspeed_args(self.device), model=self.module,
                                                                  optimizer=optimizer, config=cfg)
        self.wrapped = self._engine
        self.module = self._engine.module
        self.scales_loss = self.p.precision == "fp16"  # DeepSpeed's dynamic loss scaling
        inner = [optimizer] + [o for o in (getattr(self.optimizer, "backup_optimizer", None),) if o is not None]
        self._gate = _OptimizerGate(inner)
        self._grad_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        self._hooks = [param.register_hook(self._count) for param in self.module.parameters() if param.requires_grad]

    def _count(self, grad: torch.Tensor) -> None:
        self._grad_sq += torch.linalg.vector_norm(grad, dtype=torch.float32).double().square()

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed holds bf16/fp16 parameters itself

    def forward(self, x, drop_path_keep=None):
        if self.p.precision != "fp32":
            x = x.to(torch.bfloat16 if self.p.precision == "bf16" else torch.float16)
        return self._engine(x) if drop_path_keep is None else self._engine(x, drop_path_keep=drop_path_keep)

    def backward(self, loss, is_last_micro, grad_accum):
        self._engine.set_gradient_accumulation_boundary(is_last_micro)
        self._engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself

    def grad_square_sum(self):
        total, self._grad_sq = self._grad_sq, torch.zeros_like(self._grad_sq)
        return total

    def step(self, grad_norm):
        # clipping was configured at set-up (DeepSpeed's ZeRO optimizers take it at construction)
        self._engine.set_gradient_accumulation_boundary(True)
        self._engine.step()

    def skip_step(self):
        self._engine.set_gradient_accumulation_boundary(True)
        with self._gate.closed():
            self._engine.step()
        self._engine.zero_grad()

    def reported_grad_norm(self) -> float | None:
        """DeepSpeed's global gradient norm of the last step taken (a host read: at log steps only)."""
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._engine.destroy()  # DeepSpeed's engine otherwise outlives the run (its hooks and global registries)

    def set_lr(self, lr):
        for g in self._engine.optimizer.param_groups:
            g["lr"] = lr
    def save(self, directory: Path) -> None:
        self._engine.save_checkpoint(str(directory), tag="zero", save_latest=False)

    def load(self, directory: Path, saved_world_size: int | None = None) -> None:
        """DeepSpeed's checkpoint as saved, or, written on another number of ranks, through DeepSpeed's universal
        checkpoint (``universal_checkpoint``: converted once, by rank 0) partitioned anew for this world size."""
        tag, folder = "zero", directory
        if saved_world_size is not None and saved_world_size != self.world_size:
            error = None
            with comm.patient_group(conversion_wait_s(directory, self.p.timeout_s)) as group:
                if comm.rank() == 0:
                    try:
                        import deepspeed

                        problem = universal_problem(self.p.strategy, deepspeed.__version__)
                        if problem:
                            raise RuntimeError(problem)
                        universal_checkpoint(directory)
                    except Exception as e:  # noqa: BLE001 - every rank raises it below, not only rank 0
                        error = (f"{directory}: DeepSpeed's universal checkpoint conversion failed: "
                                 f"{type(e).__name__}: {e}")
                error = comm.broadcast_object(error, group=group)
            if error is not None:
                raise RuntimeError(error)
            folder = directory / UNIVERSAL
        config = self._engine._config  # read by load_checkpoint only: set for this load, as the "checkpoint" section's
        # load_universal
        before, config.load_universal_checkpoint = config.load_universal_checkpoint, folder != directory
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer over fp32 partitions
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        try:
            path, _ = self._engine.load_checkpoint(str(folder), tag=tag, load_lr_scheduler_states=False)
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint")
        for group, values in zip(inner.param_groups, hyper):  # the recipe's (the same recipe resumes): ZeRO-3's
            group.update(values)  # universal load gives every group the first one's, weight decay included
        for state in inner.state.values():  # and one step tensor to every sub-group, which each sub-group's Adam
            if torch.is_tensor(state.get("step")):  # step would then advance: a step counted twice, Adam's bias
                state["step"] = state["step"].clone()  # correction off. One copy each.

    def full_state_dict(self):
        if self._engine.zero_optimization_stage() == 3:
            sd = self._engine._zero3_consolidated_16bit_state_dict()  # gathers to rank 0
        else:
            sd = self._engine.module.state_dict()
        if torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().float().cpu().clone() for k, v in sd.items()}

    def load_full_state_dict(self, state):
        import deepspeed

        params = list(self._engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0,
                                               enabled=self._engine.zero_optimization_stage() == 3):
            self._engine.module.load_state_dict(state)

    def optimizer_tensors(self) -> list[torch.Tensor]:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer over fp32 partitions
        out = [p for g in inner.param_groups for p in g["params"]]
        return out + [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
