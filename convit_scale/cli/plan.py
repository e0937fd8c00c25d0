"""``convit-scale plan``: memory, communication and time per GPU for each layout of a recipe's job, and the layout to
run (the model is convit_scale/planner.py); ``--slurm-jobs``: the layout each Slurm script's job runs against it.

The job's shape (nodes, GPUs per node, CPU cores per GPU) defaults to the Slurm script that runs the recipe
(slurm/*.sh, ``RECIPE=${RECIPE:-...}``), and its CPU cores to ``SLURM_CPUS_PER_TASK`` inside a Slurm allocation:
never the cores of the machine the plan runs on (a login node, a laptop).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from ..cadence import advice_line
from ..errors import BadInput
from ..slurm_scripts import SlurmScript, job_scripts
from .argtypes import fraction, positive_float, positive_int, recipe


def _say(text: str) -> None:
    """A line of the plan's prose: folded to the width of a terminal (or ``COLUMNS``), continuations indented; in
    a log file (no terminal, no ``COLUMNS``), one line per fact, whole, for grep."""
    from ..console import console

    out = console()
    if not (out.is_terminal or os.environ.get("COLUMNS", "").isdigit()):
        print(text)
        return
    print(textwrap.fill(text, width=out.width, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False))


def slurm_jobs() -> list[SlurmScript]:
    """The job scripts of slurm/ that run a recipe of their own (``slurm_scripts.job_scripts``)."""
    return job_scripts()


def _tail(path: str | Path) -> tuple[str, ...]:
    """A recipe's path from its `recipes` folder on (the checkout's and the installed package's are the same)."""
    parts = Path(path).parts
    return parts[len(parts) - 1 - parts[::-1].index("recipes"):] if "recipes" in parts else parts


def slurm_job_of(recipe_path: str) -> SlurmScript | None:
    """The Slurm script that runs this recipe, if one does."""
    return next((j for j in slurm_jobs() if _tail(j.recipe) == _tail(Path(recipe_path).resolve())), None)


def cpus_per_gpu(flag: float | None, job: SlurmScript | None) -> tuple[float | None, str]:
    """The loader's CPU cores per GPU and where they come from: the flag, the Slurm allocation this runs in
    (``SLURM_CPUS_PER_TASK``, one task per GPU), the recipe's Slurm script, else none."""
    if flag:
        return flag, "--cpus-per-gpu"
    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm:
        try:
            return float(slurm), "SLURM_CPUS_PER_TASK"
        except ValueError:
            raise BadInput(f"SLURM_CPUS_PER_TASK = {slurm!r} is not a number; pass --cpus-per-gpu N") from None
    if job is not None:
        return float(job.cpus_per_task), f"--cpus-per-task of {job.path.name}"
    return None, ""


def check_shape(cfg, nodes: int, gpus: int) -> None:
    """The launcher's own checks of the world size (``check_world``: the strategy, the canonical groups, the
    micro-batch), refused as the launcher refuses them, with the node counts that work at this many GPUs per node."""
    from ..train.distributed import check_world

    try:
        check_world(cfg, nodes * gpus)
    except BadInput as e:
        fits = []
        for n in range(1, max(cfg.data.groups // gpus, 1) + 1):
            try:
                check_world(cfg, n * gpus)
                fits.append(n)
            except BadInput:
                pass
        counts = ", ".join(map(str, fits)) if fits else "none (change --gpus-per-node)"
        raise BadInput(f"{nodes} node(s) x {gpus} GPUs: {e}; node counts that work with {gpus} GPUs per node: "
                       f"{counts}") from None


def _cmd_plan(args) -> int:
    from ..config import load_config
    from ..planner import Links

    if not args.dry_run and (args.json or args.steps is not None):
        raise BadInput("--json and --steps are options of --dry-run (the simulated run); add --dry-run")
    if args.dry_run and args.slurm_jobs:
        raise BadInput("--dry-run simulates one recipe's job: pass --recipe, not --slurm-jobs")
    links = Links.of(args.gpu, args.intra_gbytes_per_s, args.inter_gbytes_per_s)
    if args.slurm_jobs:
        if args.nodes or args.gpus_per_node:
            raise BadInput("--nodes / --gpus-per-node are not allowed with --slurm-jobs: each job has its script's")
        return _slurm_jobs_table(args, links)
    cfg = load_config(args.recipe, args.overrides)
    job = slurm_job_of(args.recipe)
    nodes = args.nodes or (job.nodes if job else 1)
    gpus = args.gpus_per_node or (job.gpus_per_node if job else 8)
    cpus, cpus_from = cpus_per_gpu(args.cpus_per_gpu, job)
    if job and not args.nodes and not args.gpus_per_node:
        _say(f"the job's shape from slurm/{job.path.name}: {job.nodes} node(s) x {job.gpus_per_node} GPUs")
    check_shape(cfg, nodes, gpus)
    if args.dry_run:
        from .dryrun import run_dry

        return run_dry(cfg, args, nodes, gpus)
    _print_plan(cfg, args, nodes, gpus, links, cpus)
    _print_links(args.gpu, links)
    _print_loader(cfg, args, nodes * gpus, cpus, cpus_from)
    _say(advice_line(cfg.run.output_dir, nodes * gpus, args.mtbf_hours))
    _print_job_time(cfg, args, nodes, gpus, links, cpus)
    return 0


def _print_job_time(cfg, args, nodes: int, gpus: int, links, cpus) -> None:
    """The job's wall-clock beside its steps: the saves the recipe makes (by epochs, and by time at its
    checkpoint.every_minutes, 'auto' being the advice above), its evaluations and per-epoch analyses (forward passes
    at the MFU), and the share of each."""
    from ..cadence import every_minutes_of, job_time, save_s_of
    from ..hardware import GPUS
    from ..planner import model_facts, plan

    own = next(r for r in plan(cfg, nodes, gpus, args.gpu, args.mfu, links=links, cpus_per_gpu=cpus)
               if r["recipe_layout"])
    if own["micro_batch"] is None:
        return
    ck, world = cfg.checkpoint, nodes * gpus
    every = every_minutes_of(ck.every_minutes, cfg.run.output_dir, world, args.mtbf_hours)
    forward_s = model_facts(cfg).fwd_flops_per_image / (GPUS[args.gpu].peak_tflops * 1e12 * args.mfu * world)
    evals = cfg.schedule.epochs // cfg.run.eval_every_epochs
    t = job_time(own["wall_clock_h"] * 3600, cfg.schedule.epochs, ck.every_epochs, every, evals,
                 VAL_IMAGES_PER_CLASS * cfg.model.num_classes * forward_s, cfg.log.analysis_images * forward_s,
                 save_s_of(cfg.run.output_dir))
    how = f"every {ck.every_epochs} epoch(s)" if ck.every_epochs else "by time only"
    timed = (f", every {every:.0f} min by time (checkpoint.every_minutes={ck.every_minutes}"
             f"{': the advice above' if ck.every_minutes == 'auto' else ''}; {t['timed_saves']} such saves)"
             if every else "")
    share, secs = t["share"], t["seconds"]
    _say(f"the job: {t['total_s'] / 3600:.1f} h wall-clock at the recipe's layout: steps {share['train']:.1%}, "
         f"{t['evaluations']} evaluations {share['evaluation']:.1%} ({secs['evaluation'] / 60:.0f} min), per-epoch "
         f"analyses {share['analysis']:.1%}, {t['saves']} saves {share['saves']:.1%} ({secs['saves'] / 3600:.1f} h at "
         f"the save time above; the recipe saves {how}{timed}, and at the end"
         f"{', beside training: the time is what a save holds the step' if ck.async_save else ''})")


VAL_IMAGES_PER_CLASS = 50
"""ImageNet's validation split: 50 images per class (50,000 for 1,000 classes)."""


def _print_plan(cfg, args, nodes: int, gpus: int, links, cpus) -> None:
    from ..config import shares_note
    from ..planner import plan, recommend

    rows = plan(cfg, nodes, gpus, args.gpu, args.mfu, links=links, cpus_per_gpu=cpus)
    title = (f"{cfg.model.name} on {nodes} x {gpus} {args.gpu}, global batch {cfg.data.global_batch_size}, "
             f"{cfg.parallel.precision}, MFU {args.mfu:.0%} (estimates)")
    _memory_table(rows, f"Memory per GPU (GiB): {title}")
    _time_table(rows, f"Time per step (ms): {title}")
    extra = [x for x, on in (("+1 forward (activation checkpointing)", cfg.parallel.activation_checkpointing),
                             (f"+ the teacher's forward ({cfg.distill.teacher_model})", cfg.distill.enabled)) if on]
    _say(f"time: compute = 3 x forward FLOPs{' ' + ' '.join(extra) if extra else ''} at an assumed MFU of "
          f"{args.mfu:.0%} of the GPU's peak (--mfu; `convit-scale bench mfu` measures it on the GPU); the hours leave "
          f"out evaluation, checkpoints, start-up and queueing")
    note = shares_note(cfg.data.groups, nodes * gpus)
    if note:  # the step's time above is the busiest rank's
        _say(f"note: {note}")
    best, own = recommend(rows), next(r for r in rows if r["recipe_layout"])
    if best is None:
        _say("recommended: none: no layout fits in memory (more GPUs, or parallel.activation_checkpointing=true)")
    elif best is own:
        _say(f"recommended: {best['layout']}, the recipe's layout: {best['step_s'] * 1e3:.1f} ms per step, bound by "
              f"{best['bound_by']}")
    else:
        theirs = "does not fit" if own["micro_batch"] is None else f"{own['step_s'] * 1e3:.1f} ms"
        _say(f"recommended: {best['layout']} ({' '.join(best['overrides'])}): {best['step_s'] * 1e3:.1f} ms per step, "
              f"bound by {best['bound_by']}; the recipe's {own['layout']}: {theirs}")


def _gib(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _memory_table(rows: list[dict], title: str) -> None:
    from rich.table import Table

    from ..console import print_table


    t = Table(title=title)
    for col in ("layout", "params", "grads", "optim", "activations", "total", "max micro", "micro x accum"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        t.add_row(_name(r), _gib(r["params_gib"]), _gib(r["grads_gib"]), _gib(r["optimizer_gib"]),
                  _gib(r["activations_gib"]), _gib(r["total_gib"]), str(r["max_micro_batch"]),
                  "does not fit" if r["micro_batch"] is None else f"{r['micro_batch']} x {r['grad_accumulation']}")
    print_table(t)  # folded to the terminal's width, names whole


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _name(r: dict) -> str:
    return f"{r['layout']} (recipe)" if r["recipe_layout"] else r["layout"]


def _time_table(rows: list[dict], title: str) -> None:
    from rich.table import Table

    from ..console import print_table


    t = Table(title=title, caption="comm: a GPU's collectives end to end: bandwidth (NVLink | network) and latency; "
                                   "exposed: not hidden by compute; GB: sent + received")
    for col in ("layout", "compute", "comm", "bandwidth", "latency", "exposed", "GB intra | inter", "loader",
                "bound by", "step", "GPU-hours", "wall-clock h"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        fits = r["micro_batch"] is not None
        t.add_row(_name(r), _ms(r["compute_s"]), _ms(r["comm_s"]), f"{_ms(r['intra_s'])} | {_ms(r['inter_s'])}",
                  _ms(r["latency_s"]), _ms(r["exposed_s"]),
                  f"{r['intra_bytes'] / 1e9:.2f} | {r['inter_bytes'] / 1e9:.2f}", _ms(r["loader_s"]), r["bound_by"],
                  _ms(r["step_s"]) if fits else "-", f"{r['gpu_hours']:.0f}" if fits else "-",
                  f"{r['wall_clock_h']:.1f}" if fits else "-")
    print_table(t)  # folded to the terminal's width, names whole


def _print_links(gpu: str, links) -> None:
    from ..hardware import GPUS

    g = GPUS[gpu]
    _say(f"links per GPU, one direction: {g.intra_link} {links.intra_gbytes_s:g} GB/s, network "
          f"{links.inter_gbytes_s:g} GB/s (data sheet: {g.intra_gbytes_s:g} and {g.inter_gbytes_s:g}; "
          f"--intra-gbytes-per-s / --inter-gbytes-per-s take a cluster's nccl-tests busbw)")


def _print_loader(cfg, args, world: int, cpus: float | None, cpus_from: str) -> None:
    from ..planner import loader_check

    if cpus is None:
        _say("loader: not checked: no Slurm script runs this recipe and this is no Slurm allocation; "
              "pass --cpus-per-gpu N (the job's CPU cores per GPU)")
        return
    lc = loader_check(cfg, args.gpu, cpus, args.mfu, world)
    if lc["decode_warning"]:
        _say(f"warning: {lc['decode_warning']}")
    _say(f"loader: the GPUs need {lc['gpu_images_per_s']:,.0f} images/s each (compute {lc['step_s']:.3f} s per step); "
          f"{cpus:g} CPU cores per GPU ({cpus_from}), {lc['loader_cores']:g} for data.num_workers = "
          f"{cfg.data.num_workers}, give {lc['loader_images_per_s']:,.0f} images/s "
          f"({lc['format']}, mode {lc['mode']}, {lc['cpu_ms_per_image']:.2f} CPU ms per image)")
    _say("loader: CPU cores per GPU each mode needs: " + ", ".join(
        f"{m} {v['cores_per_gpu']:.1f} ({v['cpu_ms_per_image']:.2f} ms/image)" for m, v in lc["modes"].items()))
    if lc["bottleneck"] == "loader":
        _say(f"warning: the loader is slower than the GPUs ({lc['loader_images_per_s'] / lc['gpu_images_per_s']:.2f}x "
              f"of what they need): {_loader_remedy(cfg, lc, cpus)}")
    else:
        _say("the GPUs are slower than the loader: it is not the bottleneck")


def _loader_remedy(cfg, lc: dict, cpus: float) -> str:
    """What keeps the GPUs fed: the mode that does at the job's cores (``loader_check``'s ``fed_by``), with the
    cores it needs and the workers to give them, else the cores the cheapest mode needs."""
    overrides = {"pixels": "data.augment_on=device data.resize_on=cpu", "box": "data.resize_on=device",
                 "decode-on-device": "data.decode_on=device", "cpu": "data.augment_on=cpu"}
    m = lc["fed_by"]
    if m is None:
        cheapest = min(lc["modes"], key=lambda k: lc["modes"][k]["cores_per_gpu"])
        return (f"no mode keeps them fed with {cpus:g} cores per GPU: mode {cheapest} ({overrides[cheapest]}) needs "
                f"{lc['modes'][cheapest]['cores_per_gpu']:.1f}")
    cores = lc["modes"][m]["cores_per_gpu"]
    workers = max(1, int(cores + 0.999))
    more = f" data.num_workers={workers}" if workers > cfg.data.num_workers else ""
    return (f"mode {m} ({overrides[m]}{more}) keeps them fed with {cores:.1f} of the {cpus:g} cores per GPU"
            + ("" if m == lc["mode"] else f" (the recipe's mode {lc['mode']} needs "
                                          f"{lc['modes'][lc['mode']]['cores_per_gpu']:.1f})"))


def _slurm_jobs_table(args, links) -> int:
    """One row per Slurm script: its job's shape, the layout it runs and the planner's, with that layout's figures."""
    from rich.table import Table

    from ..config import find_recipe, load_config
    from ..console import print_table
    from ..planner import plan, recommend

    t = Table(title=f"The Slurm jobs on {args.gpu}, MFU {args.mfu:.0%} (estimates; figures of the recommended layout)")
    for col in ("script", "nodes x GPUs", "layout (recipe)", "recommended", "compute ms", "comm ms", "exposed ms",
                "loader ms", "bound by", "step ms", "wall-clock h", "GPU-hours"):
        t.add_column(col, justify="left" if col in ("script", "layout (recipe)", "recommended") else "right")
    for job in slurm_jobs():
        cfg = load_config(find_recipe(job.recipe), args.overrides)  # from any folder: the shipped recipe
        cpus, _ = cpus_per_gpu(args.cpus_per_gpu, job)
        rows = plan(cfg, job.nodes, job.gpus_per_node, args.gpu, args.mfu, links=links, cpus_per_gpu=cpus)
        best, own = recommend(rows), next(r for r in rows if r["recipe_layout"])
        t.add_row(job.path.name, f"{job.nodes} x {job.gpus_per_node}", own["layout"],
                  "none fits" if best is None else ("same" if best is own else best["layout"]),
                  *(["-"] * 8 if best is None else
                    [_ms(best["compute_s"]), _ms(best["comm_s"]), _ms(best["exposed_s"]), _ms(best["loader_s"]),
                     best["bound_by"], _ms(best["step_s"]), f"{best['wall_clock_h']:.1f}", f"{best['gpu_hours']:.0f}"]))
    print_table(t)  # folded to the terminal's width, names whole
    _print_links(args.gpu, links)
    return 0


def register(sub) -> None:
    from ..hardware import GPUS, LINK_EFFICIENCY

    p = sub.add_parser("plan", help="memory, communication and time per GPU for each layout of a recipe's job")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--recipe", type=recipe,
                       help="a recipe file or a shipped recipe's name (recipes/table1/convit_base.yaml)")
    which.add_argument("--slurm-jobs", action="store_true",
                       help="every slurm/*.sh job at its shape: the layout it runs against the recommended one")
    p.add_argument("--nodes", type=positive_int, default=None,
                   help="nodes (>= 1; default: the recipe's Slurm script's, else 1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (>= 1; default: the recipe's Slurm script's, else 8)")
    p.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS), metavar="GPU",
                   help=f"the GPU, for its memory, peak FLOP/s and links (convit_scale/hardware.py): "
                        f"{', '.join(sorted(GPUS))} (default: %(default)s)")
    p.add_argument("--mfu", type=fraction, default=0.4,
                   help="model FLOPs utilisation of the compute alone, in (0, 1]; communication is added to it")
    p.add_argument("--cpus-per-gpu", type=positive_float, default=None,
                   help="CPU cores feeding each GPU's loader (> 0; default: SLURM_CPUS_PER_TASK inside an allocation, "
                        "else the recipe's Slurm script's --cpus-per-task)")
    p.add_argument("--intra-gbytes-per-s", type=positive_float, default=None,
                   help="GB/s (bytes) each GPU moves to the others of its node, one direction (default: "
                        f"{LINK_EFFICIENCY * 100:.0f}%% of the GPU's NVLink/xGMI/PCIe data sheet rate)")
    p.add_argument("--inter-gbytes-per-s", type=positive_float, default=None,
                   help="GB/s (bytes) each GPU moves to other nodes, one direction: its share of the node's NICs "
                        f"(default: {LINK_EFFICIENCY * 100:.0f}%% of the reference node's NIC per GPU)")
    p.add_argument("--mtbf-hours", type=positive_float, default=None,
                   help="the job's mean time between failures in hours, for the checkpoint interval (default: 7.9 h "
                        "at 1,024 GPUs, Meta's clusters, scaled to the job's GPUs)")
    p.add_argument("--dry-run", action="store_true",
                   help="run the recipe's own training step (a few steps, then an evaluation) on simulated GPUs at "
                        "this world size in this process: the peak memory per rank beside the model, the host waits "
                        "per step, pageable copies, CPU tensors in collectives, device mismatches (docs/planning.md)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="with --dry-run: training steps (default 4; the census counts those after the first two)")
    p.add_argument("--json", action="store_true", help="with --dry-run: the figures as JSON")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.global_batch_size=2048")
    p.set_defaults(func=_cmd_plan)
