"""``convit-scale eval``: top-1/top-5 of a checkpoint (ours, exported, or any timm model's weights), on data whose
format is read from the folder, optionally written to a JSON results file.

The images are seen as the run's own evaluation saw them: the checkpoint's ``data.eval_crop_ratio`` and
``data.interpolation`` (a run checkpoint's meta.json, an exported file's metadata), so that ``eval`` of a run's
checkpoint reports the top-1 the run logged; DeiT's view (0.875, bicubic) for weights that do not say.
``--crop-ratio`` and ``--interpolation`` change it; the view used is printed and written to the results file."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..files import write_json_atomic
from .argtypes import device, non_negative_int, positive_int

FORMAT_HELP = ("ffcv, wds or imagefolder (default: read from --data: its manifest.json's format, or imagefolder "
               "for a folder whose train/ holds class folders, or that holds the validation class folders itself)")


def _cmd_eval(args) -> int:
    from ..config import DataConfig
    from ..data import LoaderSpec, build_loader
    from ..data.formats import class_names, detect_format
    from ..evaluation import evaluate, resolve_device
    from ..trained import run_checkpoint

    fmt = args.format or detect_format(args.data)  # before the model: bad data is refused before any work
    _check_results_file(args.results_file)
    if args.crop_ratio is not None and not 0.0 < args.crop_ratio <= 1.0:
        raise BadInput(f"--crop-ratio {args.crop_ratio}: allowed: a number in (0, 1] (0.875: resize 256, crop 224)")
    on = resolve_device(args.device)
    checkpoint = run_checkpoint(args.checkpoint)
    name, model, img_size = _load(args, checkpoint)
    view, source = _view(args, checkpoint)
    d = DataConfig(format=fmt, train_path=args.data, val_path=args.data, num_workers=args.workers, **view)
    loader = build_loader(d, LoaderSpec("val", img_size, args.batch_size, pin_memory=on.type == "cuda"))
    r = evaluate(model.to(on).eval(), loader, on, num_classes=model.num_classes if args.results_file else None)
    print(f"{name}: top-1 {r['top1']:.2f}  top-5 {r['top5']:.2f}  ({r['samples']} images on {on}, {fmt} data, "
          f"{img_size} px, crop ratio {view['eval_crop_ratio']:g}, {view['interpolation']}: {source})")
    if r["undecodable"]:  # scored are the images that decoded; these are named, not replaced by others
        print(f"{len(r['undecodable'])} undecodable image(s) not scored: {', '.join(r['undecodable'])}")
    if str(checkpoint) != args.checkpoint:
        print(f"checkpoint: {checkpoint}")
    if args.results_file:
        names = class_names(args.data, fmt)
        per_class = [{"label": i, "class": names[i] if names and i < len(names) else None, **c}
                     for i, c in enumerate(r["per_class"]) if c["images"]]
        results = {"checkpoint": str(checkpoint), "model": name, "data": args.data, "format": fmt,
                   "images": r["samples"], "top1": r["top1"], "top5": r["top5"], "loss": r["loss"],
                   "img_size": img_size, **view, "num_classes": model.num_classes, "view_from": source,
                   "device": str(on), "undecodable": r["undecodable"], "per_class": per_class}
        path = Path(args.results_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, results)
        print(f"wrote {path}")
    return 0


def _check_results_file(path: str | None) -> None:
    if path and Path(path).is_dir():
        raise BadInput(f"--results-file {path} is a folder; allowed: a file name (JSON is written there)")


def _view(args, checkpoint) -> tuple[dict, str]:
    """The evaluation's resize and crop (``DataConfig`` fields) and where they came from."""
    from ..config import DataConfig
    from ..trained import eval_view

    own = eval_view(checkpoint)
    deit = DataConfig()
    view = {"eval_crop_ratio": own.get("eval_crop_ratio", deit.eval_crop_ratio),
            "interpolation": own.get("interpolation", deit.interpolation), "num_classes": own.get("num_classes")}
    flags = {"eval_crop_ratio": args.crop_ratio, "interpolation": args.interpolation}
    view.update({k: v for k, v in flags.items() if v is not None})
    changed = [f"--{k.replace('eval_', '').replace('_', '-')}" for k, v in flags.items() if v is not None]
    source = ("the checkpoint's" if own else "DeiT's default") + (f", {' and '.join(changed)}" if changed else "")
    return view, source


def _load(args, checkpoint):
    """(name, model, input size) of the checkpoint: ours by its config or --model, else a timm architecture."""
    from ..models import MODELS
    from ..models.weights import load_timm_model

    if args.model is None or args.model in MODELS:
        from ..trained import load_trained_model, model_section

        model = load_trained_model(checkpoint, args.model, args.num_classes, args.img_size)
        name = args.model or (model_section(checkpoint) or {}).get("name", "model")
        return name, model, model.patch_embed.img_size[0]
    # any timm architecture, e.g. a distillation teacher (regnety_160)
    model = load_timm_model(args.model, checkpoint, num_classes=args.num_classes or 1000, name_key="--model")
    return args.model, model, args.img_size or 224


def register(sub) -> None:
    p = sub.add_parser("eval", help="top-1/top-5 of a checkpoint (ours, exported, or any timm model's weights)")
    p.add_argument("--checkpoint", required=True,
                   help="a run folder (its newest checkpoint), RUN:latest, RUN:best, a checkpoint folder, an exported "
                        ".safetensors, or a weights file")
    p.add_argument("--model", help="model name (ours or any timm architecture); default: from the checkpoint")
    p.add_argument("--data", required=True, help="prepared folder (ffcv/wds) or ImageFolder root")
    p.add_argument("--format", choices=["ffcv", "wds", "imagefolder"], help=FORMAT_HELP)
    p.add_argument("--num-classes", type=positive_int,
                   help="classes of the model's head (default: the checkpoint's; 1000 for a timm architecture)")
    p.add_argument("--img-size", type=positive_int,
                   help="input size: the model is built at it, its position embedding resampled (default: the "
                        "checkpoint's model's; 224 for a timm architecture)")
    p.add_argument("--crop-ratio", type=float, metavar="R",
                   help="resize to size / R, then centre-crop (default: the checkpoint's data.eval_crop_ratio, else "
                        "DeiT's 0.875)")
    p.add_argument("--interpolation", choices=["bicubic", "bilinear"],
                   help="resize interpolation (default: the checkpoint's data.interpolation, else bicubic)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per forward")
    p.add_argument("--workers", type=non_negative_int, default=2, help="loader workers (0: in this process)")
    p.add_argument("--device", type=device, default="auto",
                   help="auto (the GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--results-file", metavar="PATH",
                   help="also write the results as JSON: top-1/top-5, loss, images, per-class top-1, checkpoint")
    p.set_defaults(func=_cmd_eval)
