"""`convit-scale analyze` and `convit-scale experiment sample-efficiency`."""

from __future__ import annotations

from pathlib import Path


def eval_batches(data: str, fmt: str, img_size: int, n_batches: int, batch_size: int = 32) -> list:
    """The first ``n_batches`` validation batches (eval transform), kept in memory for every analysis."""
    from ..config import DataConfig
    from ..data import LoaderSpec, build_loader

    d = DataConfig(format=fmt, train_path=data, val_path=data, num_workers=0)
    loader = build_loader(d, LoaderSpec("val", img_size, batch_size))
    batches = []
    for x, y in loader.epoch(0):
        batches.append((x, y))
        if len(batches) >= n_batches:
            break
    return batches


def _cmd_analyze(args) -> int:
    from ..train.export import load_trained_model
    from .report import analyze

    model = load_trained_model(args.checkpoint, args.model)
    compare = load_trained_model(args.compare, args.compare_model) if args.compare else None
    batches = eval_batches(args.data, args.format, model.patch_embed.img_size[0], args.batches)
    run_dir = Path(args.run) if args.run else _run_dir_of(Path(args.checkpoint))
    names = (args.name or Path(args.checkpoint).name, args.compare_name or (Path(args.compare).name if args.compare else ""))
    result = analyze(model, batches, Path(args.out), compare=compare, run_dir=run_dir, names=names)
    print(f"masking top-1: {result['masking_top1']}")
    print("wrote " + ", ".join(result["files"]) + f", {Path(args.out) / 'analysis.json'}")
    return 0


def _run_dir_of(checkpoint: Path) -> Path | None:
    """runs/X/checkpoints/step_N -> runs/X (for the histories), if it looks like one."""
    if checkpoint.is_dir() and checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return None


def _cmd_experiment(args) -> int:
    from .sample_efficiency import run_sample_efficiency

    table = run_sample_efficiency(Path(args.out), fractions=[float(f) for f in args.fractions.split(",")],
                                  base_epochs=args.base_epochs, models=args.models.split(","),
                                  nproc=args.nproc, train_per_class=args.train_per_class)
    print(table["markdown"])
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("analyze", help="gating, nonlocality, attention maps/distance, CKA, masking for a checkpoint")
    p.add_argument("--checkpoint", required=True, help="run checkpoint dir, exported .safetensors, or weights")
    p.add_argument("--model", help="model name when the file holds no config (published weights)")
    p.add_argument("--compare", help="a second checkpoint: CKA between the two models")
    p.add_argument("--compare-model", help="model name of --compare when needed")
    p.add_argument("--data", required=True, help="prepared folder (ffcv/wds) or ImageFolder root")
    p.add_argument("--format", default="wds", choices=["ffcv", "wds", "imagefolder"])
    p.add_argument("--out", required=True, help="folder for the PNGs and analysis.json")
    p.add_argument("--run", help="run folder with metrics.jsonl for the histories (default: from the checkpoint)")
    p.add_argument("--batches", type=int, default=4, help="validation batches of 32 to analyse")
    p.add_argument("--name", help="label of the model in plots")
    p.add_argument("--compare-name", help="label of the compared model in plots")
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser("experiment", help="small replications anyone can run on CPU")
    p.add_argument("which", choices=["sample-efficiency"])
    p.add_argument("--out", default="runs/sample_efficiency")
    p.add_argument("--fractions", default="0.05,0.1,0.3,1")
    p.add_argument("--models", default="convit_micro,deit_micro")
    p.add_argument("--base-epochs", type=float, default=2, help="epochs at f = 1 (each f trains base/f epochs)")
    p.add_argument("--train-per-class", type=int, default=1000, help="Fashion-MNIST train images per class")
    p.add_argument("--nproc", type=int, default=1, help="processes per training run")
    p.set_defaults(func=_cmd_experiment)


