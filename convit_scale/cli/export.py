"""``convit-scale export``: one consolidated safetensors file from a (sharded) run checkpoint."""

from __future__ import annotations

from pathlib import Path


def _cmd_export(args) -> int:
    from ..trained import export, run_checkpoint

    checkpoint = run_checkpoint(args.checkpoint)
    if not checkpoint.exists():
        raise FileNotFoundError(f"--checkpoint {args.checkpoint}: {checkpoint} does not exist; allowed: a run folder, "
                                f"RUN:latest, RUN:best or a checkpoint folder (runs/X/checkpoints/step_...)")
    out = export(checkpoint, Path(args.out))
    print(f"wrote {out} (from {checkpoint})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="one consolidated safetensors file from a (sharded) run checkpoint")
    p.add_argument("--checkpoint", required=True,
                   help="a run folder (its newest checkpoint), RUN:latest, RUN:best, or a checkpoint folder "
                        "(runs/X/checkpoints/step_...)")
    p.add_argument("--out", required=True, help="output .safetensors path")
    p.set_defaults(func=_cmd_export)
