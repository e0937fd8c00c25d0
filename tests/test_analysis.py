"""Analysis mathematics: CKA, nonlocality, attention rows, masking; and the analyze report end to end."""

import math

import torch

from convit_scale import create_model
from convit_scale.analysis.attention import attention_maps, gating, head_distances, nonlocality, nonlocality_of
from convit_scale.analysis.cka import MinibatchCKA, hsic_unbiased, linear_cka
from convit_scale.analysis.report import analyze, masked
from convit_scale.models.convit import GPSA, relative_positions


def _hsic_loops(K, L):
    """Song et al.'s unbiased HSIC written out with explicit sums over indices (the direct computation)."""
    n = K.shape[0]
    Kt = [[0.0 if i == j else float(K[i, j]) for j in range(n)] for i in range(n)]
    Lt = [[0.0 if i == j else float(L[i, j]) for j in range(n)] for i in range(n)]
    trace = sum(Kt[i][j] * Lt[j][i] for i in range(n) for j in range(n))
    sk = sum(map(sum, Kt))
    sl = sum(map(sum, Lt))
    kl1 = sum(Kt[i][j] * Lt[j][q] for i in range(n) for j in range(n) for q in range(n))
    return (trace + sk * sl / ((n - 1) * (n - 2)) - 2 * kl1 / (n - 2)) / (n * (n - 3))


def test_hsic_estimator_matches_direct_computation():
    torch.manual_seed(0)
    x, y = torch.randn(9, 5), torch.randn(9, 7)
    K, L = x @ x.T, y @ y.T
    assert math.isclose(hsic_unbiased(K, L).item(), _hsic_loops(K, L), rel_tol=1e-9)


def test_cka_identity_orthogonal_and_scale_invariance():
    torch.manual_seed(0)
    x = torch.randn(40, 16, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    assert math.isclose(linear_cka(x, x), 1.0, abs_tol=1e-9)
    assert math.isclose(linear_cka(x, x @ q), 1.0, abs_tol=1e-9)
    assert math.isclose(linear_cka(x, 3.7 * x), 1.0, abs_tol=1e-9)
    y = torch.randn(40, 16, dtype=torch.float64)
    assert linear_cka(x, y) < 0.3  # independent data: near 0
    acc = MinibatchCKA(1, 1)
    for chunk in x.split(10):
        acc.update([chunk], [chunk @ q * 2])
    assert math.isclose(acc.compute().item(), 1.0, abs_tol=1e-9)


def test_nonlocality_of_conv_init_head_is_its_attention_centre_distance():
    grid = 8
    attn = GPSA(dim=36, num_heads=9, grid_size=grid, locality_strength=1.0)
    attn.init_weights()
    attn.locality_strength = 50.0  # a large alpha: each head attends to one offset (a 3x3 kernel)
    attn.local_init()
    with torch.no_grad():
        attn.gating_param.fill_(1e4)  # sigma = 1: purely positional
    a = attn.attention_map(torch.randn(2, grid * grid, 36))
    assert torch.allclose(a.sum(-1), torch.ones_like(a.sum(-1)), atol=1e-5)  # rows sum to 1
    d = nonlocality_of(a, grid)
    # Head (h1, h2) is peaked at the offset (h2 - 1, h1 - 1), so its Eq. 8 nonlocality over the queries
    # whose target lies inside the grid is the length of that offset.
    interior = torch.tensor([r * grid + c for r in range(1, grid - 1) for c in range(1, grid - 1)])
    dist = relative_positions(grid)[..., 2].sqrt()
    for h1 in range(3):
        for h2 in range(3):
            h = h1 + 3 * h2
            want = math.hypot(h2 - 1, h1 - 1)
            got = (a[:, h][:, interior] * dist[interior]).sum(-1).mean().item()
            assert abs(got - want) < 1e-3, (h, got, want)
    assert d[4].item() < 1e-3  # the centre head attends to its own patch everywhere
    assert d.max().item() < math.sqrt(2) + 1e-3


def test_masking_position_with_sigma_zero_is_content_only_output():
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        for blk in model.gpsa_blocks():
            blk.attn.gating_param.fill_(-1e4)  # sigma = 0
        ref = model(x)
        for blk in model.gpsa_blocks():
            blk.attn.gating_param.fill_(2.0)
        with masked(model, position_layers=len(model.gpsa_blocks())):
            out = model(x)
        assert torch.allclose(ref, out, atol=1e-5)
        with masked(model, pos_embed=True):
            assert torch.count_nonzero(model.pos_embed) == 0
        assert torch.count_nonzero(model.pos_embed) > 0  # restored


def test_report_writes_plots_and_numbers(tmp_path):
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4).eval()
    deit = create_model("deit_nano", num_classes=4).eval()
    batches = [(torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))) for _ in range(2)]
    res = analyze(model, batches, tmp_path, compare=deit, names=("convit", "deit"))
    for f in ("gating.png", "nonlocality.png", "attention_maps.png", "attention_distance.png", "cka_self.png",
              "cka_compare.png", "analysis.json"):
        assert (tmp_path / f).stat().st_size > 1000, f
    assert len(res["gating"]) == 2 and len(res["gating"][0]) == 4
    assert len(res["nonlocality"]) == 3
    cka = torch.tensor(res["cka_self"])
    assert torch.allclose(cka.diagonal(), torch.ones(3, dtype=cka.dtype), atol=1e-6)
    assert set(res["masking_top1"]) >= {"none", "position_embedding", "content_attention_first_2"}
    maps = attention_maps(model, batches[0][0])
    assert [m.shape for m in maps] == [(8, 4, 16, 16)] * 3
    assert gating(model) == res["gating"] and nonlocality(model, batches[0][0])[0] > 0


def test_head_distances_over_batches_equal_the_whole_set():
    """`analyze` measures 1,024 images a batch at a time: the weighted mean over batches is the whole set's."""
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4, img_size=16).eval()
    x = torch.randn(11, 3, 16, 16)
    per_head, n = head_distances(model, [(x[:4], None), (x[4:7], None), (x[7:], None)])
    whole = [nonlocality_of(a, model.grid_size).tolist() for a in attention_maps(model, x)]
    assert n == 11 and torch.allclose(torch.tensor(per_head, dtype=torch.float64),
                                      torch.tensor(whole, dtype=torch.float64), atol=1e-6)


def test_analyze_command_measures_the_images_asked_for(fm_wds, tmp_path, capsys):
    """Default: at least 1,000 validation images, on the GPU when there is one; here 40 on the CPU, and a device
    the machine does not have is refused before any work."""
    import json

    from safetensors.torch import save_file

    from convit_scale.analysis.report import ANALYSIS_IMAGES
    from convit_scale.cli import build_parser, main

    args = build_parser().parse_args(["analyze", "--checkpoint", "m", "--data", "d", "--out", "o"])
    assert args.images == ANALYSIS_IMAGES >= 1000 and args.device == "auto"
    weights = tmp_path / "m.safetensors"
    save_file(create_model("convit_nano", num_classes=10).state_dict(), str(weights))
    out = tmp_path / "analysis"
    argv = ["analyze", "--checkpoint", str(weights), "--model", "convit_nano", "--data", str(fm_wds),
            "--out", str(out), "--images", "40"]
    assert main([*argv, "--device", "cpu"]) == 0
    result = json.loads((out / "analysis.json").read_text())
    assert result["images"] == 40 and result["device"] == "cpu" and len(result["attention_distance_px"]) == 3
    capsys.readouterr()
    bad = f"cuda:{torch.cuda.device_count()}"
    assert main([*argv, "--device", bad]) == 2
    assert f"'{bad}'" in capsys.readouterr().err
