"""``convit-scale prep``: convert an ImageNet-style tree to FFCV or WebDataset, verify it, or build the
embedded Fashion-MNIST tree. One sub-command per kind, each with its own options: an option of another kind
(``prep ffcv --shard-size``) is refused, naming the kind it belongs to."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import BadInput
from ..hardware import usable_cpus
from .argtypes import fraction, int_between, positive_int

KINDS = ("ffcv", "wds", "index", "verify", "fashion-mnist")


def _cmd_convert(args) -> int:
    from data_prep import PrepOptions, prepare

    missing = [flag for flag, value in (("--src", args.src), ("--out", args.out)) if not value]
    if missing:
        raise BadInput(f"prep {args.fmt} needs {' and '.join(missing)}")
    if args.fmt == "wds":
        own = {"shard_size": args.shard_size, "seed": args.seed}
    else:
        own = {"max_resolution": args.max_resolution, "jpeg_quality": args.jpeg_quality, "write_mode": args.write_mode}
    opts = PrepOptions(fmt=args.fmt, subset_fraction=args.subset_fraction, num_classes=args.num_classes,
                       strict=args.strict, workers=args.workers, val_labels=args.val_labels,
                       val_synsets=args.val_synsets, image_column=args.image_column, label_column=args.label_column,
                       **own)
    manifest = prepare(args.src, args.out, opts)
    for split, info in manifest.splits.items():
        print(f"{split}: {info.num_samples} images in {len(info.files)} file(s), {len(info.skipped)} skipped")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    return 0


def _cmd_verify(args) -> int:
    from data_prep import verify

    if "://" not in args.dir and not Path(args.dir).is_dir():  # bad input (exit 2), not a problem found in the data
        raise FileNotFoundError(f"prep verify {args.dir}: no such folder; allowed: a folder `convit-scale prep` wrote")
    notes: list[str] = []
    checked: list[str] = []
    problems = verify(args.dir, src=args.src, ffcv_fields=args.ffcv_fields, notes=notes, checked=checked)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    what = "; ".join(checked) + (f", and the manifest matches {args.src}" if args.src else "")
    print(f"verified {args.dir}: {what}" if not problems else
          f"{args.dir}: {len(problems)} problem(s)" + (f" ({'; '.join(checked)})" if checked else ""))
    return 1 if problems else 0


def _ffcv_fields(text: str) -> tuple[str, str]:
    """``--ffcv-fields``: two field names, as the recipe's ``data.ffcv_fields`` (a YAML list ``[img, target]``; a
    bare ``img,target`` too)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",")]
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) and v for v in value)):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: the image and label fields' names, '[image, label]'")
    return value[0], value[1]


def _cmd_index(args) -> int:
    from data_prep.index import index

    manifest = index(args.src, args.out, label=args.label, split=args.split, workers=args.workers, shards=args.shards)
    for split, info in manifest.splits.items():
        print(f"{split}: {info.num_samples} samples in {len(info.files)} shard(s), {len(info.per_class)} labels")
    where = Path(args.out or args.src)
    print(f"manifest: {where / 'manifest.json'}; train from it with data.format=wds data.train_path={where}")
    return 0


def _cmd_fashion_mnist(args) -> int:
    from data_prep.fashion_mnist import build_tree

    limits = {"train": args.train_per_class, "val": args.val_per_class}
    build_tree(args.out, {k: v for k, v in limits.items() if v is not None} or None)
    print(f"Fashion-MNIST ImageFolder tree in {args.out}")
    return 0


def _convert_options(p, fmt: str) -> None:
    p.add_argument("--src", help="source: a tree with train/ and val/ (class folders, or a flat val/ with "
                                 "--val-labels), WebDataset shards (with manifest.json or _info.json) or Parquet files")
    p.add_argument("--out", help="output folder (new, empty, or an earlier `prep %s` output to resume)" % fmt)
    p.add_argument("--subset-fraction", type=fraction, default=1.0,
                   help="Table 2: first floor(n_c*f) files per class, f in (0, 1]")
    p.add_argument("--num-classes", type=positive_int, default=None,
                   help="keep only the first N classes (sorted), train and val: the appendix's 100-class experiments")
    p.add_argument("--strict", action="store_true", help="fail on unreadable files instead of skipping them")
    p.add_argument("--workers", type=positive_int, default=usable_cpus(),
                   help="parallel processes (default: the CPUs this process may use, here %(default)s)")
    p.add_argument("--val-labels", help="flat val/: LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt")
    p.add_argument("--val-synsets", help="with the devkit ground truth: wnids in ILSVRC id order")
    p.add_argument("--image-column", default="image", help="Parquet --src: the images' column (bytes, or structs "
                                                           "with bytes)")
    p.add_argument("--label-column", default="label", help="Parquet --src: the integer labels' column")
    p.set_defaults(fmt=fmt, func=_cmd_convert)


def _add_kinds(prep_sub) -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    p = parsers["ffcv"] = prep_sub.add_parser("ffcv", help="ImageNet-style tree -> FFCV .beton files",
                                              description="Convert to FFCV: one .beton per split, each JPEG's own "
                                                          "bytes kept where the loader decodes them as PIL does.")
    _convert_options(p, "ffcv")
    p.add_argument("--write-mode", default="keep", choices=["keep", "jpg", "raw", "proportion", "smart"],
                   help="keep (each JPEG's own bytes where the loader decodes them to PIL's pixels, the rest as raw "
                        "pixels) or one of ffcv's modes; the earlier default: --write-mode jpg --max-resolution 384")
    p.add_argument("--max-resolution", type=positive_int, default=None,
                   help="shrink images whose longer side is above this (default: every image at its size)")
    p.add_argument("--jpeg-quality", type=int_between(1, 100), default=90,
                   help="JPEG quality of the images prep encodes, 1..100 (kept JPEGs keep their own)")
    p = parsers["wds"] = prep_sub.add_parser("wds", help="ImageNet-style tree -> WebDataset tar shards",
                                             description="Convert to WebDataset: tar shards of the original JPEG "
                                                         "bytes.")
    _convert_options(p, "wds")
    p.add_argument("--shard-size", type=positive_int, default=1000, help="samples per shard")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed before sharding")
    p = parsers["index"] = prep_sub.add_parser(
        "index", help="index WebDataset shards another tool wrote, to train on them where they lie",
        description="Read each shard once (tar headers and label members, no image decoded) and write a "
                    "manifest.json: samples per shard and per class. The shards are not copied or changed.")
    p.add_argument("src", metavar="SRC", help="a folder of WebDataset shards (*.tar; KEY.jpg with KEY.cls or "
                                              "KEY.json), or a URL template with {name} (pipe:..., https://...)")
    p.add_argument("--out", help="write the manifest here instead of into SRC (a read-only SRC); train from --out")
    p.add_argument("--label", default="cls", help="where a sample's label is: cls (KEY.cls, the default) or "
                                                   "json:FIELD (a field of KEY.json, e.g. json:label)")
    p.add_argument("--shards", help="the shards' names as a brace pattern ('train-{000000..000146}.tar'): needed for a "
                                    "URL template, a selection of a folder's")
    p.add_argument("--split", help="the split of every shard (default: read from each shard's name: train, val or "
                                   "validation in it)")
    p.add_argument("--workers", type=positive_int, default=usable_cpus(),
                   help="parallel processes (default: the CPUs this process may use, here %(default)s)")
    p.set_defaults(func=_cmd_index)
    p = parsers["verify"] = prep_sub.add_parser("verify", help="re-read a prepared folder, compare it to its manifest",
                                                description="Re-read every file of DIR and compare it with DIR's "
                                                            "manifest.json; with --src, also the source tree.")
    p.add_argument("dir", metavar="DIR", help="the prepared folder (a `prep ffcv` or `prep wds` output)")
    p.add_argument("--src", help="the source tree DIR was converted from: also check that the manifest has its "
                                 "classes and accounts for every one of its images (written or listed as skipped)")
    p.add_argument("--ffcv-fields", type=_ffcv_fields, default=("image", "label"), metavar="FIELDS",
                   help="FFCV files another tool wrote: their image and label fields' names, as the recipe's "
                        "data.ffcv_fields ('[img, target]'; default: [image, label])")
    p.set_defaults(func=_cmd_verify)
    p = parsers["fashion-mnist"] = prep_sub.add_parser(
        "fashion-mnist", help="build the embedded Fashion-MNIST ImageFolder tree (Debian's dataset-fashion-mnist)")
    p.add_argument("--out", required=True, help="folder for the tree (train/ and val/ class folders)")
    p.add_argument("--train-per-class", type=positive_int, help="images per class in train (all if unset)")
    p.add_argument("--val-per-class", type=positive_int, help="images per class in val (all if unset)")
    p.set_defaults(func=_cmd_fashion_mnist)
    return parsers


def _refused_here(owners: str, kind: str):
    """An option that other kinds of prep have and ``kind`` has not: refused, never silently ignored."""
    class OtherKinds(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                             help=argparse.SUPPRESS)

        def __call__(self, parser, namespace, values, option_string=None):
            raise argparse.ArgumentError(self, f"is an option of `prep {owners}`, not of `prep {kind}` "
                                               f"(its options: convit-scale prep {kind} --help)")

    return OtherKinds


def register(sub) -> None:
    p = sub.add_parser("prep", help="convert an ImageNet-style tree to FFCV or WebDataset, or verify the output",
                       description="Convert once, train many times. Each kind has its own options: "
                                   "convit-scale prep KIND --help.")
    parsers = _add_kinds(p.add_subparsers(dest="kind", required=True, metavar="KIND"))
    flags = {kind: {o for a in q._actions for o in a.option_strings} for kind, q in parsers.items()}
    for kind, q in parsers.items():
        for flag in sorted(set().union(*flags.values()) - flags[kind]):
            owners = " / ".join(k for k in KINDS if flag in flags[k])
            q.add_argument(flag, action=_refused_here(owners, kind))
