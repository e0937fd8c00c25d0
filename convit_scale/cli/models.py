"""``convit-scale models``: every model's heads, width, parameters and GMACs beside the paper's Table 1."""

from __future__ import annotations


def model_table_rows() -> list[dict]:
    """Heads, width, parameters and GMACs counted from the modules (meta device), beside Table 1."""
    from ..models import MODELS, create_model, forward_flops

    rows = []
    for name, spec in MODELS.items():
        model = create_model(name, device="meta")
        rows.append(dict(
            name=name, heads=spec.num_heads, head_dim=spec.head_dim, width=spec.embed_dim,
            gpsa_layers=spec.local_up_to_layer, img_size=spec.img_size,
            params_m=sum(p.numel() for p in model.parameters()) / 1e6,
            gmacs=forward_flops(name) / 2e9,
            paper_params_m=spec.paper_params_m, paper_gmacs=spec.paper_gmacs, paper_top1=spec.paper_top1,
        ))
    return rows


def _cmd_models(args) -> int:
    from rich.table import Table

    from ..console import print_table

    table = Table(title="ConViT / DeiT models (counted from the modules; paper = Table 1)")
    for col in ("model", "heads", "head dim", "width", "GPSA layers", "input", "params (M)", "paper",
                "GMACs", "paper", "paper top-1"):
        table.add_column(col, justify="left" if col == "model" else "right")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in model_table_rows():
        table.add_row(r["name"], str(r["heads"]), str(r["head_dim"]), str(r["width"]), str(r["gpsa_layers"]),
                      str(r["img_size"]), f"{r['params_m']:.2f}", fmt(r["paper_params_m"], "g"),
                      f"{r['gmacs']:.2f}", fmt(r["paper_gmacs"], "g"), fmt(r["paper_top1"], ".1f"))
    print_table(table)  # folded to the terminal's width, names whole
    return 0


def register(sub) -> None:
    p = sub.add_parser("models", help="table of every model: heads, width, params, GMACs vs the paper")
    p.set_defaults(func=_cmd_models)
