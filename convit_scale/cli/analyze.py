"""``convit-scale analyze``: gating, nonlocality, attention maps and distance, CKA and masking for a checkpoint
(the measurements live in convit_scale/analysis/)."""

from __future__ import annotations

from pathlib import Path

from ..analysis import ANALYSIS_IMAGES
from .argtypes import device, positive_int
from .evaluate import FORMAT_HELP


def _cmd_analyze(args) -> int:
    from ..analysis.report import analyze, eval_batches
    from ..data.formats import detect_format
    from ..evaluation import resolve_device
    from ..trained import eval_view, load_trained_model

    fmt = args.format or detect_format(args.data)  # before the models: bad data is refused before any work
    on = resolve_device(args.device)
    model = load_trained_model(args.checkpoint, args.model).to(on)
    compare = load_trained_model(args.compare, args.compare_model).to(on) if args.compare else None
    batches = eval_batches(args.data, fmt, model.patch_embed.img_size[0], args.images,
                           **eval_view(args.checkpoint))
    run_dir = Path(args.run) if args.run else _run_dir_of(Path(args.checkpoint))
    names = (args.name or Path(args.checkpoint).name,
             args.compare_name or (Path(args.compare).name if args.compare else ""))
    result = analyze(model, batches, Path(args.out), compare=compare, run_dir=run_dir, names=names)
    print(f"{result['images']} validation images on {result['device']}; masking top-1: {result['masking_top1']}")
    print("wrote " + ", ".join(result["files"]) + f", {Path(args.out) / 'analysis.json'}")
    return 0


def _run_dir_of(checkpoint: Path) -> Path | None:
    """runs/X/checkpoints/step_N -> runs/X (for the histories), if it looks like one."""
    if checkpoint.is_dir() and checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return None


def register(sub) -> None:
    p = sub.add_parser("analyze", help="gating, nonlocality, attention maps/distance, CKA, masking for a checkpoint")
    p.add_argument("--checkpoint", required=True, help="run checkpoint dir, exported .safetensors, or weights")
    p.add_argument("--model", help="model name when the file holds no config (published weights)")
    p.add_argument("--compare", help="a second checkpoint: CKA between the two models")
    p.add_argument("--compare-model", help="model name of --compare when needed")
    p.add_argument("--data", required=True, help="prepared folder (ffcv/wds) or ImageFolder root")
    p.add_argument("--format", choices=["ffcv", "wds", "imagefolder"], help=FORMAT_HELP)
    p.add_argument("--out", required=True, help="folder for the PNGs and analysis.json")
    p.add_argument("--run", help="run folder with metrics.jsonl for the histories (default: from the checkpoint)")
    p.add_argument("--images", type=positive_int, default=ANALYSIS_IMAGES,
                   help=f"validation images for nonlocality, attention distance, CKA and masking (default "
                        f"{ANALYSIS_IMAGES}; fewer if the split is smaller)")
    p.add_argument("--device", type=device, default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    p.add_argument("--name", help="label of the model in plots")
    p.add_argument("--compare-name", help="label of the compared model in plots")
    p.set_defaults(func=_cmd_analyze)
