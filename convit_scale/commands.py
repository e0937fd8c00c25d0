"""Sub-commands that start work: prep, train, eval, export, analyze, bench, demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


# -- prep ---------------------------------------------------------------------------------------------
def _cmd_prep(args) -> int:
    from data_prep import PrepError, PrepOptions, prepare, verify

    try:
        if args.fmt == "verify":
            problems = verify(args.src)
            for p in problems:
                print(f"error: {p}", file=sys.stderr)
            print("verified: every file matches the manifest" if not problems else f"{len(problems)} problem(s)")
            return 1 if problems else 0
        if args.fmt == "fashion-mnist":
            from data_prep.fashion_mnist import build_tree

            limits = {"train": args.train_per_class, "val": args.val_per_class}
            build_tree(args.out, {k: v for k, v in limits.items() if v is not None} or None)
            print(f"Fashion-MNIST ImageFolder tree in {args.out}")
            return 0
        opts = PrepOptions(fmt=args.fmt, subset_fraction=args.subset_fraction, shard_size=args.shard_size,
                           seed=args.seed, max_resolution=args.max_resolution, jpeg_quality=args.jpeg_quality,
                           write_mode=args.write_mode, strict=args.strict, workers=args.workers,
                           val_labels=args.val_labels, val_synsets=args.val_synsets)
        manifest = prepare(args.src, args.out, opts)
    except PrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['num_samples']} images in {len(info['files'])} file(s), {len(info['skipped'])} skipped")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    return 0


def _add_prep(sub) -> None:
    p = sub.add_parser("prep", help="convert an ImageNet-style tree to FFCV or WebDataset, or verify the output")
    p.add_argument("fmt", choices=["ffcv", "wds", "verify", "fashion-mnist"],
                   help="ffcv/wds: convert; verify DIR: re-check against the manifest; fashion-mnist: build the embedded tree")
    p.add_argument("src", nargs="?", help="(verify) the prepared folder")
    p.add_argument("--src", dest="src", help="source tree with train/ and val/")
    p.add_argument("--out", help="output folder")
    p.add_argument("--subset-fraction", type=float, default=1.0, help="Table 2: first floor(n_c*f) files per class")
    p.add_argument("--shard-size", type=int, default=1000, help="wds: samples per shard")
    p.add_argument("--seed", type=int, default=0, help="wds: shuffle seed before sharding")
    p.add_argument("--max-resolution", type=int, default=384, help="ffcv: max image side (see data_prep/convert.py)")
    p.add_argument("--jpeg-quality", type=int, default=90, help="ffcv: JPEG quality of re-encoded images")
    p.add_argument("--write-mode", default="jpg", choices=["jpg", "raw", "proportion", "smart"], help="ffcv write mode")
    p.add_argument("--strict", action="store_true", help="fail on unreadable files instead of skipping them")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes")
    p.add_argument("--val-labels", help="flat val/: LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt")
    p.add_argument("--val-synsets", help="with the devkit ground truth: wnids in ILSVRC id order")
    p.add_argument("--train-per-class", type=int, help="fashion-mnist: images per class in train (all if unset)")
    p.add_argument("--val-per-class", type=int, help="fashion-mnist: images per class in val (all if unset)")
    p.set_defaults(func=_cmd_prep)


# -- train ----------------------------------------------------------------------------------------------
def _cmd_train(args) -> int:
    from .config import load_config
    from .data import DataError
    from .models.checkpoints import CheckpointMismatch
    from .train.launch import preflight, run_recipe

    cfg = load_config(args.recipe, args.overrides)  # refused here, before any process starts
    try:
        preflight(cfg)
    except (DataError, CheckpointMismatch, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run_recipe(args.recipe, args.overrides, args.nproc_per_node or 1, in_process=True, checked=True)
    except ValueError as e:  # refused before any process starts (world size, global batch)
        print(f"error: {e}", file=sys.stderr)
        return 2


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a recipe (alone, under torchrun, srun or accelerate launch)")
    p.add_argument("--recipe", required=True)
    p.add_argument("--nproc-per-node", type=int, default=0,
                   help="start this many local ranks with torchrun (default: run as launched)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.strategy=zero3")
    p.set_defaults(func=_cmd_train)


# -- eval / export -----------------------------------------------------------------------------------------
def _cmd_eval(args) -> int:
    import torch

    from .config import DataConfig
    from .data import LoaderSpec, build_loader
    from .models import MODELS, read_state_dict
    from .models.checkpoints import check_state_dict

    if args.model is None or args.model in MODELS:
        from .train.export import load_trained_model

        model = load_trained_model(args.checkpoint, args.model, args.num_classes)
        name = args.model or "model"
        img_size = model.patch_embed.img_size[0]
    else:  # any timm architecture, e.g. a distillation teacher (regnety_160)
        import timm

        name = args.model
        model = timm.create_model(name, pretrained=False, num_classes=args.num_classes or 1000)
        state = read_state_dict(args.checkpoint)
        check_state_dict(state, model, args.checkpoint)
        model.load_state_dict(state)
        img_size = args.img_size or 224
    d = DataConfig(format=args.format, train_path=args.data, val_path=args.data, num_workers=args.workers)
    loader = build_loader(d, LoaderSpec("val", args.img_size or img_size, args.batch_size))
    model.eval()
    correct1 = correct5 = n = 0
    seen = 0
    with torch.no_grad():
        for x, y in loader.epoch(0):
            real = (torch.arange(len(y)) + seen) < loader.num_real
            seen += len(y)
            logits = model(x)
            top = logits.topk(min(5, logits.shape[1]), dim=1).indices
            correct1 += (top[:, 0] == y)[real].sum().item()
            correct5 += (top == y[:, None]).any(1)[real].sum().item()
            n += real.sum().item()
    print(f"{name}: top-1 {100 * correct1 / n:.2f}  top-5 {100 * correct5 / n:.2f}  ({n} images)")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="top-1/top-5 of a checkpoint (ours, exported, or any timm model's weights)")
    p.add_argument("--checkpoint", required=True, help="run checkpoint dir, exported .safetensors, or weights file")
    p.add_argument("--model", help="model name (ours or any timm architecture); default: from the checkpoint")
    p.add_argument("--data", required=True, help="prepared folder (ffcv/wds) or ImageFolder root")
    p.add_argument("--format", default="wds", choices=["ffcv", "wds", "imagefolder"])
    p.add_argument("--num-classes", type=int)
    p.add_argument("--img-size", type=int)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.set_defaults(func=_cmd_eval)


def _cmd_export(args) -> int:
    from .train.export import export

    out = export(Path(args.checkpoint), Path(args.out))
    print(f"wrote {out}")
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="one consolidated safetensors file from a (sharded) run checkpoint")
    p.add_argument("--checkpoint", required=True, help="a checkpoint dir (runs/X/checkpoints/step_...)")
    p.add_argument("--out", required=True, help="output .safetensors path")
    p.set_defaults(func=_cmd_export)


def add_subcommands(sub) -> None:
    """Register the work commands on the ``convit-scale`` parser."""
    _add_prep(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_export(sub)
    from . import bench, demo, planner
    from .analysis import cli as analysis_cli

    analysis_cli.add_subcommand(sub)
    bench.add_subcommand(sub)
    demo.add_subcommand(sub)
    planner.add_subcommand(sub)
