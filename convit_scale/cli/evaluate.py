"""``convit-scale eval``: top-1/top-5 of a checkpoint (ours, exported, or any timm model's weights)."""

from __future__ import annotations

from .argtypes import device, non_negative_int, positive_int


def _cmd_eval(args) -> int:
    from ..config import DataConfig
    from ..data import LoaderSpec, build_loader
    from ..evaluation import evaluate, resolve_device
    from ..models import MODELS
    from ..models.weights import load_timm_model

    on = resolve_device(args.device)
    if args.model is None or args.model in MODELS:
        from ..trained import load_trained_model

        model = load_trained_model(args.checkpoint, args.model, args.num_classes)
        name = args.model or "model"
        img_size = model.patch_embed.img_size[0]
    else:  # any timm architecture, e.g. a distillation teacher (regnety_160)
        name = args.model
        model = load_timm_model(name, args.checkpoint, num_classes=args.num_classes or 1000, name_key="--model")
        img_size = args.img_size or 224
    d = DataConfig(format=args.format, train_path=args.data, val_path=args.data, num_workers=args.workers)
    loader = build_loader(d, LoaderSpec("val", args.img_size or img_size, args.batch_size,
                                        pin_memory=on.type == "cuda"))
    r = evaluate(model.to(on).eval(), loader, on)
    print(f"{name}: top-1 {r['top1']:.2f}  top-5 {r['top5']:.2f}  ({r['samples']} images on {on})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("eval", help="top-1/top-5 of a checkpoint (ours, exported, or any timm model's weights)")
    p.add_argument("--checkpoint", required=True, help="run checkpoint dir, exported .safetensors, or weights file")
    p.add_argument("--model", help="model name (ours or any timm architecture); default: from the checkpoint")
    p.add_argument("--data", required=True, help="prepared folder (ffcv/wds) or ImageFolder root")
    p.add_argument("--format", default="wds", choices=["ffcv", "wds", "imagefolder"])
    p.add_argument("--num-classes", type=positive_int)
    p.add_argument("--img-size", type=positive_int)
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--workers", type=non_negative_int, default=2)
    p.add_argument("--device", type=device, default="auto",
                   help="auto (the GPU when there is one), cpu, cuda or cuda:N (default: %(default)s)")
    p.set_defaults(func=_cmd_eval)
