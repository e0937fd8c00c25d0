"""``convit-scale plan``: memory per GPU, micro-batch, step time and GPU-hours per strategy for a recipe
(the model of memory and time is convit_scale/planner.py)."""

from __future__ import annotations

import os

from .argtypes import fraction, positive_float, positive_int, recipe


def _cmd_plan(args) -> int:
    from ..console import print_table
    from rich.table import Table

    from ..config import load_config
    from ..planner import loader_check, plan

    cfg = load_config(args.recipe, args.overrides)
    rows = plan(cfg, args.nodes, args.gpus_per_node, args.gpu, args.mfu)
    world = args.nodes * args.gpus_per_node
    t = Table(title=f"{cfg.model.name} on {args.nodes} x {args.gpus_per_node} {args.gpu}, global batch "
                    f"{cfg.data.global_batch_size}, {cfg.parallel.precision}, MFU {args.mfu:.0%} (estimates)")
    for col in ("strategy", "params", "grads", "optim", "activations", "total GiB/GPU", "max micro", "micro x accum",
                "step (s)", "GPU-hours", "wall-clock (h)"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["strategy"], f"{r['params_gib']:.2f}", f"{r['grads_gib']:.2f}", f"{r['optimizer_gib']:.2f}",
                  "-" if r["activations_gib"] is None else f"{r['activations_gib']:.2f}", f"{r['total_gib']:.2f}",
                  str(r["max_micro_batch"]),
                  "does not fit" if r["micro_batch"] is None else f"{r['micro_batch']} x {r['grad_accumulation']}",
                  f"{r['step_s']:.3f}", f"{r['gpu_hours']:.0f}", f"{r['wall_clock_h']:.1f}")
    print_table(t)  # folded to the terminal's width, names whole
    if cfg.data.global_batch_size % world:
        print(f"note: global batch {cfg.data.global_batch_size} does not divide over {world} GPUs")
    cpus = args.cpus_per_gpu or _default_cpus_per_gpu(args.gpus_per_node)
    lc = loader_check(cfg, args.gpu, cpus, args.mfu, world)
    print(f"loader: the GPUs need {lc['gpu_images_per_s']:,.0f} images/s each (step {lc['step_s']:.3f} s); "
          f"{cpus:g} CPU cores per GPU give {lc['loader_images_per_s']:,.0f} images/s ({lc['format']}, "
          f"{lc['cpu_ms_per_image']:.2f} CPU ms per image, augmentation on the {lc['augment_on']})")
    if lc["bottleneck"] == "loader":
        print(f"warning: the loader is slower than the GPUs ({lc['loader_images_per_s'] / lc['gpu_images_per_s']:.2f}x "
              f"of what they need): more CPU cores per GPU, data.format=ffcv, or data.augment_on=device")
    else:
        print("the GPUs are slower than the loader: it is not the bottleneck")
    return 0


def _default_cpus_per_gpu(gpus_per_node: int) -> float:
    """Slurm's CPUs per task (one task per GPU) when set, else the CPUs this process may use shared by the GPUs."""
    from ..hardware import usable_cpus

    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    if not slurm:
        return usable_cpus() / gpus_per_node
    try:
        return float(slurm)
    except ValueError:
        raise SystemExit(f"error: SLURM_CPUS_PER_TASK = {slurm!r} is not a number; pass --cpus-per-gpu N") from None


def register(sub) -> None:
    from ..hardware import GPUS

    p = sub.add_parser("plan", help="memory per GPU, micro-batch, step time and GPU-hours for a recipe")
    p.add_argument("--recipe", required=True, type=recipe,
                   help="a recipe file or a shipped recipe's name (recipes/table1/convit_base.yaml)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes (>= 1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (>= 1)")
    p.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS), metavar="GPU",
                   help=f"the GPU, for its memory and peak FLOP/s (convit_scale/hardware.py): {', '.join(sorted(GPUS))}")
    p.add_argument("--mfu", type=fraction, default=0.4, help="assumed model FLOPs utilisation, in (0, 1]")
    p.add_argument("--cpus-per-gpu", type=positive_float, default=None,
                   help="CPU cores feeding each GPU's loader (> 0; default SLURM_CPUS_PER_TASK, else cores / GPUs)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.global_batch_size=2048")
    p.set_defaults(func=_cmd_plan)
