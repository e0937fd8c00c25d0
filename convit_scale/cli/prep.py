"""``convit-scale prep``: convert an ImageNet-style tree to FFCV or WebDataset, verify it, or build the
embedded Fashion-MNIST tree."""

from __future__ import annotations

import sys
from pathlib import Path

from ..hardware import usable_cpus
from .argtypes import fraction, int_between, positive_int


NEEDS = {"ffcv": ("--src", "--out"), "wds": ("--src", "--out"), "verify": ("DIR",), "fashion-mnist": ("--out",)}
"""The paths each kind of prep needs."""


def _cmd_prep(args) -> int:
    from data_prep import PrepOptions, prepare, verify

    given = {"--src": args.src, "DIR": args.src, "--out": args.out}
    missing = [name for name in NEEDS[args.fmt] if not given[name]]
    if missing:
        raise ValueError(f"prep {args.fmt} needs {' and '.join(missing)}")
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
                       write_mode=args.write_mode, num_classes=args.num_classes, strict=args.strict, workers=args.workers,
                       val_labels=args.val_labels, val_synsets=args.val_synsets)
    manifest = prepare(args.src, args.out, opts)
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['num_samples']} images in {len(info['files'])} file(s), {len(info['skipped'])} skipped")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("prep", help="convert an ImageNet-style tree to FFCV or WebDataset, or verify the output")
    p.add_argument("fmt", choices=["ffcv", "wds", "verify", "fashion-mnist"],
                   help="ffcv/wds: convert; verify DIR: re-check against the manifest; "
                        "fashion-mnist: build the embedded tree")
    p.add_argument("src", nargs="?", help="(verify) the prepared folder")
    p.add_argument("--src", dest="src", help="source tree with train/ and val/")
    p.add_argument("--out", help="output folder")
    p.add_argument("--subset-fraction", type=fraction, default=1.0,
                   help="Table 2: first floor(n_c*f) files per class, f in (0, 1]")
    p.add_argument("--shard-size", type=positive_int, default=1000, help="wds: samples per shard")
    p.add_argument("--seed", type=int, default=0, help="wds: shuffle seed before sharding")
    p.add_argument("--write-mode", default="keep", choices=["keep", "jpg", "raw", "proportion", "smart"],
                   help="ffcv: keep (each JPEG's own bytes where the loader decodes them to PIL's pixels, the rest as "
                        "raw pixels) or one of ffcv's modes; the earlier default: --write-mode jpg --max-resolution 384")
    p.add_argument("--max-resolution", type=positive_int, default=None,
                   help="ffcv: shrink images whose longer side is above this (default: every image at its size)")
    p.add_argument("--jpeg-quality", type=int_between(1, 100), default=90,
                   help="ffcv: JPEG quality of the images prep encodes, 1..100 (kept JPEGs keep their own)")
    p.add_argument("--num-classes", type=positive_int, default=None,
                   help="keep only the first N classes (sorted), train and val: the appendix's 100-class experiments")
    p.add_argument("--strict", action="store_true", help="fail on unreadable files instead of skipping them")
    p.add_argument("--workers", type=positive_int, default=usable_cpus(),
                   help="parallel processes (default: the CPUs this process may use)")
    p.add_argument("--val-labels", help="flat val/: LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt")
    p.add_argument("--val-synsets", help="with the devkit ground truth: wnids in ILSVRC id order")
    p.add_argument("--train-per-class", type=positive_int,
                   help="fashion-mnist: images per class in train (all if unset)")
    p.add_argument("--val-per-class", type=positive_int, help="fashion-mnist: images per class in val (all if unset)")
    p.set_defaults(func=_cmd_prep)
