"""The recipe: YAML -> a typed tree of dataclasses, with inheritance and dotted overrides.

Every field has a docstring (the string right under it) that doubles as help text. Unknown keys,
wrong types and impossible values raise ``ConfigError`` naming the key, the file and what is allowed,
before any worker process or process group starts.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .augment_policy import unsupported_on_device
from .errors import BadInput


class ConfigError(BadInput, ValueError):
    """A recipe key or value that is not allowed."""


def _shipped_recipes() -> Path:
    # An installed wheel holds the recipes in the package (pyproject maps the top-level recipes/ folder to
    # convit_scale/recipes); a source checkout or an editable install reads the top-level folder itself.
    packaged = Path(__file__).resolve().parent / "recipes"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "recipes"


RECIPES = _shipped_recipes()
"""The folder of the shipped recipes (recipes/ in the repository)."""


def recipe_path(name: str | Path) -> Path:
    """A shipped recipe by its name relative to recipes/ (``cpu/demo.yaml``; ``recipes/cpu/demo.yaml`` too)."""
    parts = Path(name).parts
    rel = Path(*parts[1:]) if len(parts) > 1 and parts[0] == "recipes" else Path(name)
    path = RECIPES / rel
    if rel.is_absolute() or not path.is_file():
        shipped = [str(Path("recipes") / p.relative_to(RECIPES)) for p in sorted(RECIPES.rglob("*.yaml"))]
        close = closest(str(Path("recipes") / rel), shipped)
        raise ConfigError(f"recipe not found: {name} (neither a file nor a shipped recipe under {RECIPES})"
                          + (f"; did you mean {close}?" if close else ""))
    return path


def closest(word: str, choices) -> str | None:
    """The closest of ``choices`` to a mistyped ``word`` (difflib's ratio >= 0.75), for "did you mean"."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return close[0] if close else None


def _did_you_mean_key(word: str, names: list[str], prefix: str) -> str:
    """`` (did you mean 'prefix.key'?)`` for a mistyped key of a section, or nothing."""
    close = closest(word, names)
    return f" (did you mean '{prefix}{close}'?)" if close else ""


def find_recipe(name: str | Path) -> Path:
    """``name`` if that file exists (relative to the current directory), otherwise the shipped recipe
    of that name (see :func:`recipe_path`)."""
    return Path(name) if Path(name).is_file() else recipe_path(name)


@dataclass
class ModelConfig:
    name: str = "convit_small"
    """Registered model name (`convit-scale models` lists them)."""
    num_classes: int = 1000
    """Number of output classes."""
    img_size: int | None = None
    """Input resolution; None keeps the model's (224 for the paper's models)."""
    patch_size: int | None = None
    """Side of the square patches in pixels; None keeps the model's (16 for the paper's models)."""
    drop_path_rate: float = 0.1
    """Stochastic depth rate of the last block (linearly increasing from 0)."""
    local_up_to_layer: int | None = None
    """Number of GPSA blocks; None keeps the model's (10 for ConViT, 0 for DeiT)."""
    locality_strength: float = 1.0
    """alpha of the convolutional init (the paper's Section 3)."""
    gpsa_impl: Literal["fast", "reference"] = "fast"
    """GPSA implementation: fused/shared-positional 'fast', or the literal 'reference'."""
    distill_token: bool = False
    """DeiT's distillation token and second head (Table 4 option)."""
    conv_init: bool = True
    """Convolutional init of GPSA (Table 3 switch); False = random init."""
    train_gating: bool = True
    """Train the gating lambda (Table 3 switch); False = frozen at lambda = 0."""
    freeze_gpsa: bool = False
    """Freeze GPSA attention so only the MLPs of those blocks learn (Table 3 rows f, g)."""
    pretrained: str | None = None
    """Local file of published weights to start from (.pth or .safetensors)."""

    def validate(self, fail) -> None:
        from .models.registry import MODELS

        if self.name not in MODELS:
            fail("model.name", self.name, "known models: " + ", ".join(MODELS))
        spec = MODELS[self.name]
        if self.num_classes < 1:
            fail("model.num_classes", self.num_classes, "must be >= 1")
        patch = spec.patch_size if self.patch_size is None else self.patch_size
        if patch <= 0:
            fail("model.patch_size", self.patch_size, "must be a positive number of pixels")
        size = spec.img_size if self.img_size is None else self.img_size
        if size <= 0 or size % patch:
            key, value = (("model.img_size", self.img_size) if self.img_size is not None
                          else ("model.patch_size", self.patch_size))
            fail(key, value, f"the image size ({size}) must be a positive multiple of the patch size ({patch})")
        if self.local_up_to_layer is not None and not 0 <= self.local_up_to_layer < spec.depth:
            fail("model.local_up_to_layer", self.local_up_to_layer, f"must be in [0, {spec.depth - 1}]")
        if not 0.0 <= self.drop_path_rate < 1.0:
            fail("model.drop_path_rate", self.drop_path_rate, "must be in [0, 1)")


def default_groups(global_batch: int, most: int = 16) -> int:
    """The canonical groups of a recipe that names none: the largest number up to ``most`` that divides the global
    batch into groups of an even size (Mixup pairs within a group), else the largest that divides it. 16 groups of
    64 at batch 1024 are the paper's 16 GPU batches, each of which DeiT's Mixup draws for (DeiT, Section 6)."""
    divisors = [k for k in range(1, most + 1) if global_batch % k == 0]
    return max((k for k in divisors if (global_batch // k) % 2 == 0), default=max(divisors))


def group_shares(groups: int, world_size: int) -> list[int]:
    """The canonical groups each rank holds, rank by rank: consecutive groups, the first ``groups % world_size`` ranks
    one more than the others (32 groups on 24 ranks: 8 ranks hold 2, 16 hold 1); every world size up to ``groups``."""
    base, extra = divmod(groups, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shares_note(groups: int, world_size: int) -> str | None:
    """One line on unequal shares of the canonical groups (None when every rank holds as many): the step waits for
    the busiest ranks, so it takes as long as on the world size where every rank holds that many."""
    base, extra = divmod(groups, world_size)
    if extra == 0:
        return None
    busy = base + 1
    return (f"{world_size} ranks hold {groups} canonical groups unequally: {extra} rank{'s' * (extra > 1)} x {busy}, "
            f"{world_size - extra} x {base}; step time as for {math.ceil(groups / busy)} ranks x {busy}")


@dataclass
class DataConfig:
    format: Literal["ffcv", "wds", "imagefolder"] = "ffcv"
    """Loader: FFCV .beton, WebDataset tar shards, or a plain ImageFolder tree."""
    train_path: str = ""
    """Training data: a `convit-scale prep` output folder (ffcv, wds), a .ffcv/.beton file or a folder of them that
    another tool wrote (ffcv), a folder of WebDataset shards with timm's _info.json or a URL template (wds), or an
    ImageFolder root."""
    val_path: str = ""
    """Validation data, same form as train_path."""
    ffcv_fields: tuple[str, str] = ("image", "label")
    """FFCV files: the names of the image field (an RGBImageField) and the label field (an IntField)."""
    num_classes: int | None = None
    """Keep the first N labels only, train and val (the appendix's 100-class experiments, the official code's
    --nb_classes): FFCV files and ImageFolder trees at load time, WebDataset shards converted with them (`prep wds
    --num-classes N`); null keeps every class."""
    global_batch_size: int = 1024
    """Images per optimizer step over all ranks: a property of the recipe, not of the cluster."""
    micro_batch_size: int | None = None
    """Images per rank per forward; None = the largest divisor that needs no accumulation."""
    canonical_groups: int | None = None
    """The global batch as this many groups of consecutive samples, each a rank's whole unit (Mixup/CutMix pairs and
    draws, WebDataset partitions): any world size up to it can run and resume the run (unequal shares where it does
    not divide it, the loss weighted by the samples each rank holds); None = the largest number up to 16 that divides
    the global batch into groups of an even size (16 groups of 64 at batch 1024: the paper's GPU batches)."""
    eval_batch_size: int = 128
    """Images per rank per evaluation forward."""
    num_workers: int = 8
    """Loader worker processes per rank."""
    subset_fraction: float = 1.0
    """Table 2: keep the first floor(n_c * f) images of each class (sorted order)."""
    repeated_aug: int = 3
    """Repeated augmentation: each image appears this many times per epoch, differently augmented."""
    hflip: float = 0.5
    """Horizontal flip probability."""
    rand_augment: str | None = "rand-m9-mstd0.5-inc1"
    """timm RandAugment policy string; None disables it."""
    color_jitter: float = 0.4
    """Colour jitter strength (timm; ignored by timm when RandAugment is on, as in DeiT)."""
    reprob: float = 0.25
    """Random erasing probability (pixel mode)."""
    mixup: float = 0.8
    """Mixup alpha; 0 disables."""
    cutmix: float = 1.0
    """CutMix alpha; 0 disables."""
    mixup_prob: float = 1.0
    """Probability of applying Mixup or CutMix to a batch."""
    mixup_switch_prob: float = 0.5
    """Probability of CutMix rather than Mixup when both are on."""
    label_smoothing: float = 0.1
    """Label smoothing of the targets."""
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    """Resize interpolation of RandomResizedCrop and of the eval resize."""
    crop_scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop's range of the crop's area as a fraction of the image (DeiT's 0.08-1)."""
    eval_crop_ratio: float = 0.875
    """Eval: resize to img_size / ratio (256 for 224), then centre-crop img_size."""
    open_retries: int = 3
    """WebDataset: reopen a shard that fails to open or to stream this many times, with exponential backoff."""
    open_retry_backoff_s: float = 1.0
    """WebDataset: the wait before the first reopen, doubled for each further one (1, 2, 4 s)."""
    max_bad_samples: int = 100
    """Unreadable or undecodable samples replaced per epoch and rank before the run stops with a DataError."""
    augment_on: Literal["auto", "device", "cpu"] = "auto"
    """Where RandAugment, normalisation and erasing run: auto = the device on CUDA if it supports the recipe, else
    cpu (the device when ``resize_on`` or ``decode_on`` is device)."""
    resize_on: Literal["auto", "device", "cpu"] = "auto"
    """Where a training view's crop box is resized to the model's input: device = the loader hands the box over at
    its own size and the training device resizes the whole batch (PIL's bicubic, within a level of its pixels);
    auto = the device wherever the augmentation runs on a CUDA device, else cpu."""
    decode_on: Literal["cpu", "device"] = "cpu"
    """Where training JPEGs are decoded: device = the loader reads the bytes and draws the crop box from the JPEG's
    header; the training device decodes the batch (nvJPEG through torchvision on CUDA), crops, resizes and flips
    (formats ffcv and wds; the augmentation and the resize then run on the device too)."""
    whole_jpeg_decode: bool = False
    """Train even where the crop-region JPEG decoder (convit_scale/_jpeg_roi.c) is not built: each rank's loader then
    decodes whole JPEGs before cropping (the same pixels, more CPU per image: BENCHMARKS.md, "Decoding only the
    crop"); false: such a run refuses to start (ffcv and wds decoded on the CPU)."""

    @property
    def groups(self) -> int:
        """``canonical_groups`` resolved (``default_groups`` when null)."""
        return self.canonical_groups or default_groups(self.global_batch_size)

    def world_size_problem(self, world_size: int) -> str | None:
        """Why ``world_size`` ranks cannot run this recipe (each rank holds at least one whole canonical group: the
        run, and every checkpoint of it, are then the same at any world size up to the group count), or None."""
        groups = self.groups
        if world_size <= groups:
            return None
        return (f"{world_size} ranks exceed the {groups} canonical groups of data.global_batch_size = "
                f"{self.global_batch_size} (data.canonical_groups = {groups}; each rank holds at least one whole "
                f"group): at most {groups} ranks")

    def validate(self, fail) -> None:
        for key in ("global_batch_size", "eval_batch_size", "repeated_aug"):
            if getattr(self, key) < 1:
                fail(f"data.{key}", getattr(self, key), "must be >= 1")
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.global_batch_size:
            fail("data.micro_batch_size", self.micro_batch_size,
                 f"must be in [1, global_batch_size={self.global_batch_size}]")
        if self.canonical_groups is not None and (self.canonical_groups < 1
                                                  or self.global_batch_size % self.canonical_groups):
            fail("data.canonical_groups", self.canonical_groups,
                 f"must divide data.global_batch_size = {self.global_batch_size}, or be null")
        if (self.mixup > 0 or self.cutmix > 0) and (self.global_batch_size // self.groups) % 2:
            fail("data.canonical_groups", self.groups, f"Mixup/CutMix pair the samples of a group: groups of "
                 f"{self.global_batch_size // self.groups} images are odd (global batch {self.global_batch_size})")
        if self.num_workers < 0:
            fail("data.num_workers", self.num_workers, "must be >= 0")
        if not 0.0 < self.subset_fraction <= 1.0:
            fail("data.subset_fraction", self.subset_fraction, "must be in (0, 1]")
        if self.num_classes is not None and self.num_classes < 1:
            fail("data.num_classes", self.num_classes, "must be >= 1, or null (every class)")
        for key in ("hflip", "reprob", "mixup_prob", "mixup_switch_prob"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                fail(f"data.{key}", getattr(self, key), "a probability in [0, 1]")
        if not 0.0 <= self.label_smoothing < 1.0:
            fail("data.label_smoothing", self.label_smoothing, "must be in [0, 1)")
        if self.mixup < 0 or self.cutmix < 0 or self.color_jitter < 0:
            fail("data.mixup/cutmix/color_jitter", (self.mixup, self.cutmix, self.color_jitter), "must be >= 0")
        if not 0.0 < self.crop_scale[0] <= self.crop_scale[1] <= 1.0:
            fail("data.crop_scale", list(self.crop_scale), "[min, max] with 0 < min <= max <= 1")
        if not 0.0 < self.eval_crop_ratio <= 1.0:
            fail("data.eval_crop_ratio", self.eval_crop_ratio, "must be in (0, 1]")
        for key in ("open_retries", "max_bad_samples"):
            if getattr(self, key) < 0:
                fail(f"data.{key}", getattr(self, key), "must be >= 0")
        if not self.open_retry_backoff_s > 0:
            fail("data.open_retry_backoff_s", self.open_retry_backoff_s, "must be > 0")
        if self.rand_augment is not None and not self.rand_augment.startswith("rand"):
            fail("data.rand_augment", self.rand_augment,
                 "a timm RandAugment string like 'rand-m9-mstd0.5-inc1', or null")
        if self.augment_on == "device":
            reason = unsupported_on_device(self)
            if reason is not None:
                fail("data.augment_on", "device", reason)
        self._validate_device_work(fail)

    def _validate_device_work(self, fail) -> None:
        for key in ("resize_on", "decode_on"):
            if getattr(self, key) != "device":
                continue
            if self.augment_on == "cpu":
                fail(f"data.{key}", "device", "the augmentation that follows runs on the CPU (data.augment_on: cpu); "
                     "allowed: data.augment_on device or auto")
            reason = unsupported_on_device(self)
            if reason is not None:
                fail(f"data.{key}", "device", reason)
        if self.decode_on == "device" and self.resize_on == "cpu":
            fail("data.decode_on", "device", "the crop is then resized on the device: data.resize_on must be device "
                 "or auto, not cpu")
        if self.decode_on == "device" and self.format not in ("ffcv", "wds"):
            fail("data.decode_on", "device", f"data.format {self.format!r} decodes every file whole on the host; "
                 "allowed with data.format ffcv or wds")


@dataclass
class OptimConfig:
    base_lr: float = 5e-4
    """Learning rate at a global batch of lr_reference_batch; scaled linearly with the global batch."""
    lr_reference_batch: int = 512
    """lr = base_lr * global_batch_size / lr_reference_batch (DeiT's rule)."""
    weight_decay: float = 0.05
    """AdamW weight decay (not on biases, norms, position embedding, tokens, gating)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value; None = no clipping (the paper)."""
    fused: bool | None = None
    """AdamW's fused kernel (its state then lives on the parameters' device); None = fused on CUDA, multi-tensor
    (foreach) elsewhere; true on the CPU runs torch's fused CPU kernel, the CUDA runs' optimizer state layout."""

    def validate(self, fail) -> None:
        if self.base_lr <= 0:
            fail("optim.base_lr", self.base_lr, "must be > 0")
        if self.lr_reference_batch < 1:
            fail("optim.lr_reference_batch", self.lr_reference_batch, "must be >= 1")
        if self.weight_decay < 0:
            fail("optim.weight_decay", self.weight_decay, "must be >= 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            fail("optim.betas", list(self.betas), "each in [0, 1)")
        if self.grad_clip is not None and self.grad_clip <= 0:
            fail("optim.grad_clip", self.grad_clip, "must be > 0, or null for no clipping")


@dataclass
class ScheduleConfig:
    epochs: int = 300
    """Training epochs (Table 2 multiplies them by 1/f)."""
    warmup_epochs: float = 5
    """Linear warmup from warmup_lr to the peak lr."""
    warmup_lr: float = 1e-6
    """Learning rate at step 0."""
    min_lr: float = 1e-5
    """Cosine schedule floor."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (short runs and tests); the schedule still spans `epochs`."""

    def validate(self, fail) -> None:
        if self.epochs < 1:
            fail("schedule.epochs", self.epochs, "must be >= 1")
        if not 0 <= self.warmup_epochs < self.epochs:
            fail("schedule.warmup_epochs", self.warmup_epochs, f"must be in [0, epochs={self.epochs})")
        if self.max_steps is not None and self.max_steps < 1:
            fail("schedule.max_steps", self.max_steps, "must be >= 1, or null")
        if self.min_lr < 0 or self.warmup_lr < 0:
            fail("schedule.min_lr/warmup_lr", (self.min_lr, self.warmup_lr), "must be >= 0")


@dataclass
class ParallelConfig:
    strategy: Literal["none", "ddp", "fsdp2", "zero1", "zero2", "zero3"] = "fsdp2"
    """How ranks share the work: DDP, FSDP2 (fully_shard), or DeepSpeed ZeRO stage 1/2/3."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute precision; master weights stay fp32. fp16 uses loss scaling."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto = NCCL on GPUs, gloo on CPU."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3-like) or keep them (ZeRO-2-like)."""
    hsdp_replicas: int = 1
    """FSDP2: >1 shards within groups of world/replicas ranks and replicates across groups (HSDP); a count that does
    not fit the world of a resume (or whose shard groups would straddle nodes) gives one replica per node."""
    hsdp_per_node: bool = False
    """FSDP2: HSDP shaped by the ranks per node at each start: shard within a node, replicate across nodes (a requeue
    onto fewer nodes keeps every shard group inside a node); one node: plain FSDP2."""
    activation_checkpointing: bool = False
    """Recompute each block in backward to save activation memory."""
    compile: bool = False
    """torch.compile each block (ddp, fsdp2; CPU too, where it mostly costs compile time)."""
    zero_offload: bool = False
    """DeepSpeed: offload optimizer state to CPU."""
    zero_bucket_elements: int | None = None
    """DeepSpeed bucket sizes in elements; None = sized from the model (default buckets are GPU-sized)."""
    zero_overlap_comm: bool | None = None
    """DeepSpeed: overlap gradient reduction with backward; None = on with CUDA, off on CPU."""
    zero_param_persistence_threshold: int | None = None
    """ZeRO-3: parameters below this many elements stay whole on every rank; None = 1e5 on CUDA, 0 on CPU."""
    zero_prefetch_bucket_elements: int | None = None
    """ZeRO-3: parameter elements gathered ahead of use; None = 5e7 on CUDA, the bucket size on CPU."""
    zero_max_live_parameters: int | None = None
    """ZeRO-3: most gathered parameter elements held at once; None = 1e9 on CUDA, the bucket size on CPU."""
    zero_max_reuse_distance: int | None = None
    """ZeRO-3: keep a gathered parameter reused within this many elements; None = 1e9 on CUDA, bucket on CPU."""
    zero_universal_scratch: str | None = None
    """DeepSpeed: a node-local folder (made if missing) for the fragment files of a universal conversion (a resume on
    another world size); None = $SLURM_TMPDIR, else $TMPDIR, else beside the checkpoint on its file system."""
    meta_init: bool = False
    """FSDP2: build on the meta device and initialise shards after sharding (large models)."""
    timeout_s: int = 600
    """Collective timeout: a dead rank makes the others fail after at most this long."""

    def hsdp_mesh(self, world_size: int, ranks_per_node: int) -> tuple[int, str | None]:
        """(HSDP replicas, a line for the log or None) on ``world_size`` ranks of ``ranks_per_node`` per node: the
        recipe's ``hsdp_replicas`` where it divides the world into shard groups that stay inside nodes (or span whole
        ones), else, and with ``hsdp_per_node``, one replica per node (1 on one node, or on unequal nodes)."""
        per_node = ranks_per_node if 0 < ranks_per_node <= world_size and world_size % ranks_per_node == 0 else 0
        by_node = world_size // per_node if per_node else 1
        r = self.hsdp_replicas
        if r > 1:
            shard = world_size // r if world_size % r == 0 else 0
            if shard and (not per_node or per_node % shard == 0 or shard % per_node == 0):
                return r, None
            return by_node, (f"parallel.hsdp_replicas = {r} does not fit {world_size} ranks of {ranks_per_node} per "
                             f"node: {by_node} replica(s), one per node, instead")
        return (by_node if self.hsdp_per_node else 1), None

    def validate(self, fail) -> None:
        zero, any_zero = "needs parallel.strategy zero3", "needs parallel.strategy zero1, zero2 or zero3"
        if self.hsdp_replicas < 1:
            fail("parallel.hsdp_replicas", self.hsdp_replicas, "must be >= 1")
        if self.hsdp_replicas > 1 and self.strategy != "fsdp2":
            fail("parallel.hsdp_replicas", self.hsdp_replicas, "HSDP needs parallel.strategy = 'fsdp2'")
        if self.hsdp_per_node and self.strategy != "fsdp2":
            fail("parallel.hsdp_per_node", self.hsdp_per_node, "HSDP needs parallel.strategy = 'fsdp2'")
        if self.zero_offload and not self.strategy.startswith("zero"):
            fail("parallel.zero_offload", True, any_zero)
        if self.zero_bucket_elements is not None and not self.strategy.startswith("zero"):
            fail("parallel.zero_bucket_elements", self.zero_bucket_elements, any_zero)
        if self.zero_bucket_elements is not None and (self.zero_bucket_elements < 1 or self.zero_bucket_elements % 8):
            fail("parallel.zero_bucket_elements", self.zero_bucket_elements,
                 "must be a positive multiple of 8 (DeepSpeed aligns its buckets), or null (sized from the model)")
        if self.zero_overlap_comm is not None and not self.strategy.startswith("zero"):
            fail("parallel.zero_overlap_comm", self.zero_overlap_comm, any_zero)
        if self.zero_universal_scratch is not None and not self.strategy.startswith("zero"):
            fail("parallel.zero_universal_scratch", self.zero_universal_scratch, any_zero)
        for key in ("zero_param_persistence_threshold", "zero_prefetch_bucket_elements", "zero_max_live_parameters",
                    "zero_max_reuse_distance"):
            value = getattr(self, key)
            if value is not None and self.strategy != "zero3":
                fail(f"parallel.{key}", value, zero)
            if value is not None and value < 0:
                fail(f"parallel.{key}", value, "must be >= 0, or null (DeepSpeed's value on CUDA, sized from the model "
                     "on CPU)")
        if self.compile and self.strategy.startswith("zero"):
            fail("parallel.compile", True, "is supported with ddp and fsdp2 (DeepSpeed's ZeRO-3 linear does not trace "
                 "under torch.compile); set it false for zero1/2/3")
        if self.precision == "fp16" and self.strategy == "fsdp2":
            fail("parallel.precision", "fp16", "fsdp2 trains in fp32 or bf16 (no sharded loss scaling here); use bf16, "
                 "or ddp / zero1/2/3 for fp16")
        if self.meta_init and self.strategy != "fsdp2":
            fail("parallel.meta_init", True, "needs parallel.strategy = 'fsdp2'")
        if self.timeout_s < 10:
            fail("parallel.timeout_s", self.timeout_s, "must be >= 10")


@dataclass
class DistillConfig:
    enabled: bool = False
    """Hard/soft distillation from a teacher (Table 4)."""
    teacher_model: str = "regnety_160"
    """timm architecture of the teacher."""
    teacher_checkpoint: str | None = None
    """Local weights of the teacher (.pth or .safetensors); required when enabled."""
    type: Literal["hard", "soft"] = "hard"
    """Hard: CE to the teacher's argmax; soft: KL at temperature tau."""
    alpha: float = 0.5
    """Weight of the distillation term."""
    tau: float = 1.0
    """Temperature of soft distillation."""
    teacher_min_top1: float | None = None
    """Evaluate the teacher on up to 5,000 validation images at start-up and refuse to train below this top-1
    (a wrong or weaker teacher file would silently move every Table 4 row); None = no lower bound."""
    teacher_max_top1: float | None = None
    """With the same evaluation, refuse a teacher above this top-1 (a stronger one, such as timm's default
    ImageNet-12k regnety_160 weights, would inflate Table 4); None = no upper bound."""
    teacher_sha256: str | None = None
    """Hex prefix (8 to 64 digits) the teacher file's SHA-256 must start with, whatever the file is called (Table 4:
    a5fe301d, DeiT's regnety_160-a5fe301d.pth); None = only a torch.hub-style name's own prefix is checked."""

    def validate(self, fail) -> None:
        if self.enabled and not self.teacher_checkpoint:
            fail("distill.teacher_checkpoint", self.teacher_checkpoint,
                 "a local teacher weights file is required when distill.enabled")
        if not 0.0 <= self.alpha <= 1.0:
            fail("distill.alpha", self.alpha, "must be in [0, 1]")
        if self.tau <= 0:
            fail("distill.tau", self.tau, "must be > 0")
        if self.teacher_min_top1 is not None and not 0.0 <= self.teacher_min_top1 <= 100.0:
            fail("distill.teacher_min_top1", self.teacher_min_top1, "a top-1 in percent, in [0, 100], or null")
        if self.teacher_max_top1 is not None and not (self.teacher_min_top1 or 0.0) <= self.teacher_max_top1 <= 100.0:
            fail("distill.teacher_max_top1", self.teacher_max_top1,
                 "a top-1 in percent, in [teacher_min_top1, 100], or null")
        if self.teacher_sha256 is not None and not re.fullmatch(r"[0-9a-f]{8,64}", self.teacher_sha256):
            fail("distill.teacher_sha256", self.teacher_sha256, "8 to 64 lowercase hex digits of a SHA-256, or null")


@dataclass
class CheckpointConfig:
    every_epochs: int | None = 1
    """Save a checkpoint every this many epochs (and at the end and on a stop signal); None = not by epochs (the GPU
    recipes: by time, ``every_minutes``)."""
    every_steps: int | None = None
    """Also save every this many steps; None = only per epoch."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints."""
    resume: str = "auto"
    """'auto' = newest complete checkpoint in output_dir/checkpoints if any, 'none', or a path."""
    every_minutes: float | Literal["auto"] | None = None
    """Also save once this many minutes passed since the last save (rank 0's clock, agreed in the step's reduction:
    every rank saves after the same step); None = by steps and epochs only; 'auto' = the Young/Daly interval that
    `convit-scale plan` advises, for the job's ranks and the save time measured in the run folder (cadence.py)."""
    async_save: bool = False
    """Write checkpoints beside training: the step pays for the copy of the state to host memory, the files are
    written, listed and published (``latest``) by a background thread once every rank's write completed; the next
    save, a stop and the end wait for it (at most one save in flight). DDP and FSDP2: torch.distributed.checkpoint's
    async_save; ZeRO: DeepSpeed's own files, serialized into host memory by the step and written by that thread."""

    def validate(self, fail) -> None:
        if not isinstance(self.async_save, bool):
            fail("checkpoint.async_save", self.async_save, "must be true or false")
        if self.every_minutes not in (None, "auto") and not self.every_minutes > 0:
            fail("checkpoint.every_minutes", self.every_minutes, "must be > 0, 'auto' or null")
        if self.keep_last < 1:
            fail("checkpoint.keep_last", self.keep_last, "must be >= 1")
        if self.every_epochs is not None and self.every_epochs < 1:
            fail("checkpoint.every_epochs", self.every_epochs, "must be >= 1, or null")
        if self.every_steps is not None and self.every_steps < 1:
            fail("checkpoint.every_steps", self.every_steps, "must be >= 1, or null")


@dataclass
class FaultConfig:
    """Unplanned failures (docs/failures.md): every rank's watchdog ends a rank that makes no progress, after writing
    its threads' stacks; the Slurm launcher restarts the run from its newest checkpoint."""

    hang_timeout_s: float = 120.0
    """During training steps: end a rank whose step makes no progress (data, forward/backward, reduction) for this
    long, after writing every thread's stack (the log and run_dir/hangs/)."""
    startup_timeout_s: float = 1800.0
    """From the process's start to the end of the first step (rendezvous, loaders, model, resume and a universal
    checkpoint's conversion, the first step's compilation)."""
    long_phase_timeout_s: float = 1800.0
    """Checkpoint save and load, evaluation and the epoch analysis, and an epoch's first batch."""
    collective_timeout_s: float = 300.0
    """The process group's timeout after the first step (parallel.timeout_s before it, and during the long
    phases): more than hang_timeout_s, so that the watchdog, which names the rank that stopped, ends a hang first."""
    heartbeat_s: float = 10.0
    """How often each rank's watchdog writes run_dir/heartbeat/rank_<r>.json (its step, phase and time), which the
    others read to name the rank that stopped first."""
    enabled: bool = True
    """Run the watchdog (off: a hang waits for the collective timeout and names no rank)."""
    nccl_trace_entries: int = 0
    """NCCL's flight recorder (TORCH_FR_BUFFER_SIZE, set before the process group forms): each rank keeps its last
    this many collectives, with the Python stack of each, and a hang report writes them (rank_<r>.nccl_trace.pkl);
    0: off (recent torch turns it on by default). Turn it on (e.g. 2000) to find which collective a repeated hang
    stops in; its cost per step is measured by `make gpu-test GROUP=3` (docs/gpu.md)."""

    def validate(self, fail) -> None:
        if self.nccl_trace_entries < 0:
            fail("fault.nccl_trace_entries", self.nccl_trace_entries, "must be >= 0 (0: NCCL's flight recorder off)")
        for key in ("hang_timeout_s", "startup_timeout_s", "long_phase_timeout_s", "heartbeat_s"):
            if not getattr(self, key) > 0:
                fail(f"fault.{key}", getattr(self, key), "must be > 0 (seconds)")
        if self.heartbeat_s * 3 > self.hang_timeout_s:
            fail("fault.heartbeat_s", self.heartbeat_s, f"must be at most a third of fault.hang_timeout_s "
                 f"({self.hang_timeout_s}): a rank is taken for stopped after 3 heartbeats without one")
        if self.collective_timeout_s <= self.hang_timeout_s:
            fail("fault.collective_timeout_s", self.collective_timeout_s,
                 f"must be more than fault.hang_timeout_s ({self.hang_timeout_s}): the watchdog names a hang only if "
                 f"it fires before the collective times out")


@dataclass
class LogConfig:
    every_steps: int | None = 10
    """Write a metrics.jsonl record every this many steps; null: by time alone (log.every_seconds)."""
    every_seconds: float | None = None
    """Also write one when this many seconds have passed since the last (rank 0's clock, agreed in the step's
    reduction, so every rank logs after the same step); null: by steps alone. A GPU recipe's steps take milliseconds:
    the recipes log every 30 s, a few hundred records per day, not one per 10 steps (75,000 for ConViT-B+)."""
    progress: bool = True
    """Rich progress bar on rank 0."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    wandb: bool = False
    """Also log every metrics.jsonl record to Weights & Biases, from rank 0 (needs the wandb package)."""
    wandb_project: str = "convit-scale"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B entity (team or user); null: the account's default."""
    wandb_name: str | None = None
    """W&B run name; null: the run folder under runs/ (run.output_dir runs/table1/convit_small ->
    table1/convit_small)."""
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """auto: WANDB_MODE when the environment sets it, else online when W&B's server answers and an API key is set,
    else offline (files in the run folder, uploaded later with `wandb sync`)."""
    analysis_images: int = 1024
    """Validation images of the gating/nonlocality analysis at every evaluation (sharded over the ranks, on the
    training device; the paper uses 1,024); 0 turns the analysis off."""
    debug_memory: bool = False
    """Record `state_mem_mb` once: memory of the live tensors after backward (walks every tensor on CPU)."""
    debug_digest: bool = False
    """Record a digest of weights and optimizer state per rank after every step, and the teacher's checksums."""
    debug_samples: bool = False
    """Record the sample ids of every step's global batch, gathered from the ranks in canonical order (dataset index
    for ImageFolder and FFCV, shard/key for WebDataset)."""

    def validate(self, fail) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            fail("log.every_steps", self.every_steps, "must be >= 1, or null (by log.every_seconds alone)")
        if self.every_seconds is not None and not self.every_seconds > 0:
            fail("log.every_seconds", self.every_seconds, "must be > 0, or null")
        if self.every_steps is None and self.every_seconds is None:
            fail("log.every_steps", None, "null needs log.every_seconds (a record by time); set one of them")
        if self.analysis_images < 0:
            fail("log.analysis_images", self.analysis_images, "must be >= 0 (0 turns the analysis off)")
        for key in ("wandb_project", "wandb_name"):
            if self.wandb and getattr(self, key) is not None and not getattr(self, key).strip():
                fail(f"log.{key}", getattr(self, key),
                     "a non-empty name" + (", or null" if key == "wandb_name" else ""))


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    """Where the config, metrics, checkpoints and plots of this run go."""
    seed: int = 0
    """Seed of model init, data order and augmentation."""
    eval_every_epochs: int = 1
    """Evaluate every this many epochs and at the end."""
    nonfinite_policy: Literal["skip", "stop"] = "skip"
    """On a NaN/inf loss or gradient norm: skip the step (and count it) or stop without saving."""
    max_skipped_steps: int = 10
    """With 'skip': stop after this many consecutive non-finite steps."""

    def validate(self, fail) -> None:
        if self.eval_every_epochs < 1:
            fail("run.eval_every_epochs", self.eval_every_epochs, "must be >= 1")


@dataclass
class PaperConfig:
    table: str | None = None
    """Which table of the paper this recipe reproduces (e.g. '1')."""
    row: str | None = None
    """Which row (e.g. 'ConViT-S+')."""
    top1: float | None = None
    """The top-1 the paper reports for it."""
    compare_with: Literal["best_top1", "top1"] = "top1"
    """The run's number to set beside it: the final epoch's top-1 (the official code keeps the last checkpoint; the
    released ConViT-Ti scores 73.116, Table 1's 73.1) or the best epoch's (the max over hundreds of noisy
    evaluations, biased upward); metrics.jsonl and the end of the run carry both."""

    def validate(self, fail) -> None:
        """Nothing to check beyond the types: the paper's numbers are for reading."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)
    paper: PaperConfig = field(default_factory=PaperConfig)

    def validate(self, source: str = "<config>") -> None:
        """Every section's own checks, then the few that span sections: each refusal names the key and the file."""

        def fail(key: str, value, allowed: str):
            raise ConfigError(f"{source}: {key} = {value!r} is not allowed; {allowed}")

        for key, value in _float_fields(self):  # 5e400 parses as inf, .nan as NaN: a run would train on them
            if not math.isfinite(value):
                fail(key, value, "must be a finite number")
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(fail)
        if self.model.distill_token and not self.distill.enabled:
            fail("model.distill_token", True, "the distillation token needs distill.enabled = true")

    def to_dict(self) -> dict:
        return _to_plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- help text -----------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def explain(key: str, cfg: "Config | None" = None) -> str:
    """A dotted key's documentation: its type, default and field docstring (and, with ``cfg``, its value there); a
    section's keys with theirs. For ``convit-scale config --explain``."""
    cls, parts, default = Config, key.split("."), None
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(parts[:i]) or "the top level"
            prefix = "".join(f"{p}." for p in parts[:i])
            raise ConfigError(f"--explain {key}: no key '{part}' in {where}{_did_you_mean_key(part, names, prefix)}"
                              f"; allowed: {', '.join(names)}")
        hint = typing.get_type_hints(cls)[part]
        if i < len(parts) - 1:
            if not dataclasses.is_dataclass(hint):
                raise ConfigError(f"--explain {key}: '{'.'.join(parts[:i + 1])}' is a key, not a section")
            cls = hint
        else:
            field_ = next(f for f in dataclasses.fields(cls) if f.name == part)
            default = field_.default if field_.default is not dataclasses.MISSING else (
                field_.default_factory() if field_.default_factory is not dataclasses.MISSING else None)
    if dataclasses.is_dataclass(hint):  # a section: each key with its docstring's first line
        docs = {k: v.splitlines()[0] for k, v in field_docs(hint).items() if v}
        return f"{key}: a section\n" + "".join(f"  {key}.{f.name}: {docs.get(f.name, '')}\n"
                                                for f in dataclasses.fields(hint))
    value = ""
    if cfg is not None:
        node = cfg
        for part in parts:
            node = getattr(node, part)
        value = f" (this recipe: {_to_plain(node)!r})"
    if typing.get_origin(hint) is Literal:
        kind = "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    else:
        kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    doc = " ".join(line.strip() for line in field_docs(cls).get(parts[-1], "").splitlines())
    return f"{key}: {kind}, default {_to_plain(default)!r}{value}\n  {doc}\n"


# -- loading ---------------------------------------------------------------------------------------
def _to_plain(obj):
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is refused (plain YAML keeps the last one
    silently, so a second ``optim:`` section would drop the first without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: let PyYAML report it
                continue
            if first != key_node.start_mark.line + 1:
                raise ConfigError(f"{key_node.start_mark.name}:{key_node.start_mark.line + 1}: key {key!r} given "
                                  f"twice in one mapping (first on line {first}); each key may appear once")
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, name: str = "<override>"):
    """YAML text -> Python objects with :class:`_UniqueKeyLoader` (``name`` appears in its errors)."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """Read a recipe, resolving ``base:`` (a path relative to the file, or a list of them)."""
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    if path.resolve() in chain:
        raise ConfigError(f"{path}: 'base' inheritance loops through {' -> '.join(map(str, chain))}")
    try:
        raw = _load_yaml(path.read_text(), str(path)) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    bases = raw.pop("base", None)
    merged: dict = {}
    for b in [bases] if isinstance(bases, str) else bases or []:
        merged = _deep_merge(merged, _read_yaml(_base_path(path, b), chain + (path.resolve(),)))
    return _deep_merge(merged, raw)


def _base_path(including: Path, base) -> Path:
    """Where a recipe's ``base: NAME`` is: NAME relative to the including file, else the shipped recipe of that name
    (``table1/convit_base_plus.yaml`` or ``recipes/table1/...``, in the checkout or the installed package), so a
    recipe of one's own, anywhere, can build on a shipped one; a ConfigError naming the file and every path tried."""
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{including}: base = {base!r} is not allowed; expected a recipe file name or a list of them")
    tried = [including.parent / base]
    parts = Path(base).parts
    if not Path(base).is_absolute():
        tried.append(RECIPES / Path(*(parts[1:] if len(parts) > 1 and parts[0] == "recipes" else parts)))
    found = next((p for p in tried if p.is_file()), None)
    if found is None:
        raise ConfigError(f"{including}: base {base} not found; tried {', '.join(map(str, tried))}; allowed: a "
                          f"recipe relative to {including.name}, or a shipped recipe's name (table1/convit_base.yaml)")
    return found


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "a list [" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str, source: str):
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{source}: {key} = {value!r} is not allowed; expected {_type_name(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                continue
        raise bad
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(v, a, key, source) for v, a in zip(value, args))
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad


def _build(cls, data: dict, prefix: str, source: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.')}' must be a mapping of {', '.join(names)}")
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"in '{prefix.rstrip('.')}'" if prefix else "at the top level"
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}'"
            + _did_you_mean_key(unknown[0], names, prefix)
            + f"; allowed keys {where}: {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], f"{prefix}{name}.", source)
        else:
            kwargs[name] = _coerce(data[name], tp, f"{prefix}{name}", source)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``optim.base_lr=4e-4`` -> (['optim', 'base_lr'], 0.0004); values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = _load_yaml(raw, f"override {text!r}") if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_first_line(e)})") from e
    return key.strip().split("."), _yaml_numbers(value)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a recipe (with its bases), apply dotted overrides, and validate everything."""
    data = _read_yaml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    recipe_model = _model_name(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{k}' is not a section")
        node[keys[-1]] = value
    if overrides:
        source += " (with overrides " + " ".join(overrides) + ")"
    _drop_paper_of_another_model(data, recipe_model)
    cfg = _build(Config, _yaml_numbers(data), "", source)
    cfg.validate(source)
    return cfg


def _model_name(data: dict):
    model = data.get("model")
    return model.get("name", ModelConfig.name) if isinstance(model, dict) else ModelConfig.name


def _drop_paper_of_another_model(data: dict, recipe_model) -> None:
    """The recipe's ``paper:`` row is its model's: a run whose ``model.name`` an override changed trains another
    model, and is not set beside that row at its end (the resolved config, config.yaml, has no paper section)."""
    if _model_name(data) != recipe_model:
        data.pop("paper", None)


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _yaml_numbers(obj):
    """YAML 1.1 (PyYAML) reads '5e-4' as a string: turn such strings into floats."""
    if isinstance(obj, dict):
        return {k: _yaml_numbers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_yaml_numbers(v) for v in obj]
    if isinstance(obj, str):
        try:
            if any(c in obj for c in "eE") and obj.strip()[0] in "0123456789.+-":
                return float(obj)
        except ValueError:
            pass
    return obj


def _float_fields(node, prefix: str = ""):
    """(dotted key, value) of every float in the config tree, tuples included (``optim.betas[1]``)."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _float_fields(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, tuple):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))


def model_options(m: ModelConfig) -> dict:
    """The keyword arguments ``create_model`` takes for this model section."""
    opts = dict(
        num_classes=m.num_classes, drop_path_rate=m.drop_path_rate, locality_strength=m.locality_strength,
        gpsa_impl=m.gpsa_impl, distill_token=m.distill_token, conv_init=m.conv_init,
        train_gating=m.train_gating, freeze_gpsa=m.freeze_gpsa,
    )
    if m.img_size is not None:
        opts["img_size"] = m.img_size
    if m.patch_size is not None:
        opts["patch_size"] = m.patch_size
    if m.local_up_to_layer is not None:
        opts["local_up_to_layer"] = m.local_up_to_layer
    return opts
