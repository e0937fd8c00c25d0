"""``convit-scale analyze``: gating, nonlocality, attention maps and distance, CKA and masking for a checkpoint
(the measurements live in convit_scale/analysis/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis import ANALYSIS_IMAGES
from ..runfolder import CHECKPOINTS
from .argtypes import device, positive_int
from .evaluate import FORMAT_HELP


def _cmd_analyze(args) -> int:
    from ..analysis.masking import gpsa_layers
    from ..analysis.report import FirstImages, analyze, eval_batches, eval_loader, load_compare
    from ..data.formats import detect_format
    from ..evaluation import Batches, resolve_device
    from ..trained import eval_view, load_trained_model, run_checkpoint

    fmt = args.format or detect_format(args.data)  # before the models: bad data is refused before any work
    on = resolve_device(args.device)
    checkpoint = run_checkpoint(args.checkpoint)
    model = load_trained_model(checkpoint, args.model).to(on)
    for spec in args.masking or ():  # every spec names GPSA layers the model has, before any image is read
        gpsa_layers(spec, len(model.gpsa_blocks()))
    compared = run_checkpoint(args.compare) if args.compare else None  # RUN, RUN:best, ... as --checkpoint
    compare = load_compare(compared, args.compare_model).to(on) if compared is not None else None
    view = eval_view(checkpoint)
    size = model.patch_embed.img_size[0]
    batches = eval_batches(args.data, fmt, size, args.images, **view)
    masking_data = None  # the analysis images, unless another number (or all) is asked for the masking
    if args.masking_images is not None:
        count = None if args.masking_images == ALL else args.masking_images
        held = count is not None and count <= args.images  # among the images in memory; else streamed
        masking_data = FirstImages(Batches(batches) if held else eval_loader(args.data, fmt, size, **view),
                                   count)
    run_dir = Path(args.run) if args.run else _run_dir_of(checkpoint)
    names = (args.name or _label(args.checkpoint, checkpoint, args.model),
             args.compare_name or (_label(args.compare, compared, args.compare_model) if compared else ""))
    result = analyze(model, batches, Path(args.out), compare=compare, run_dir=run_dir, names=names,
                     masking_data=masking_data, masking_specs=args.masking)
    masking = ", ".join(f"{k} {v:.2f}" for k, v in result["masking_top1"].items())
    print(f"{result['images']} validation images on {result['device']}; masking top-1 on "
          f"{result['masking_images']} images (%): {masking}")
    print("wrote " + ", ".join(result["files"]) + f", {Path(args.out) / 'analysis.json'}")
    return 0


ALL = "all"


def _images_or_all(text: str) -> int | str:
    """--masking-images: a number of validation images, or all of them."""
    return ALL if text == ALL else positive_int(text)


def _masking_spec(text: str) -> str:
    """--masking: the spec's form now (its layers against the model once it is loaded)."""
    from ..analysis.masking import SPEC, SPECS_HELP

    if SPEC.match(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {SPECS_HELP}")
    return text


def _label(spec: str, checkpoint: Path, model: str | None) -> str:
    """A model's name in the plots: its model and the run it comes from (``convit_small (run_a)``), not the checkpoint
    folder's name (``best``, ``step_000001000``); a file's stem otherwise."""
    from ..trained import model_section

    name = model or (model_section(checkpoint) or {}).get("name")
    run = _run_dir_of(checkpoint)
    where = run.name if run is not None else (checkpoint.stem if checkpoint.is_file() else checkpoint.name)
    return f"{name} ({where})" if name and name != where else where


def _run_dir_of(checkpoint: Path) -> Path | None:
    """runs/X/checkpoints/step_N -> runs/X (for the histories), if it looks like one."""
    if checkpoint.is_dir() and checkpoint.parent.name == CHECKPOINTS:
        return checkpoint.parent.parent
    return None


def register(sub) -> None:
    p = sub.add_parser("analyze", help="gating, nonlocality, attention maps/distance, CKA, masking for a checkpoint")
    p.add_argument("--checkpoint", required=True,
                   help="a run folder (its newest checkpoint), RUN:latest, RUN:best, a checkpoint folder, an exported "
                        ".safetensors, or weights")
    p.add_argument("--model", help="model name when the file holds no config (published weights)")
    p.add_argument("--compare", help="a second model: CKA between the two, layer by layer (a ConViT/DeiT checkpoint "
                                     "or weights, or a timm CNN's local weights with --compare-model, e.g. resnet50)")
    p.add_argument("--compare-model", help="model name of --compare when needed: one of this project's, or a timm "
                                           "CNN (resnet50: every residual block)")
    p.add_argument("--data", required=True, help="prepared folder (ffcv/wds) or ImageFolder root")
    p.add_argument("--format", choices=["ffcv", "wds", "imagefolder"], help=FORMAT_HELP)
    p.add_argument("--out", required=True, help="folder for the PNGs and analysis.json")
    p.add_argument("--run", help="run folder with metrics.jsonl for the histories (default: from the checkpoint)")
    p.add_argument("--images", type=positive_int, default=ANALYSIS_IMAGES,
                   help=f"validation images for nonlocality, attention distance, CKA and masking (default "
                        f"{ANALYSIS_IMAGES}; fewer if the split is smaller)")
    p.add_argument("--masking", nargs="+", type=_masking_spec, metavar="LAYERS",
                   help="GPSA layers whose content or positional attention is masked (Table 6), one measurement per "
                        "spec: firstK, last, lastK, all, or a list such as 0,4 (default: first1 last, the first half, "
                        "all)")
    p.add_argument("--masking-images", type=_images_or_all,
                   help="validation images of the masking (a number, or all: the whole split, streamed; default: "
                        "the --images of the other analyses)")
    p.add_argument("--device", type=device, default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    p.add_argument("--name", help="label of the model in plots")
    p.add_argument("--compare-name", help="label of the compared model in plots")
    p.set_defaults(func=_cmd_analyze)
