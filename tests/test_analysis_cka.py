"""convit_scale/analysis/cka.py: minibatch CKA over any number of images."""

import math

import pytest
import torch

from convit_scale.analysis.cka import MinibatchCKA, hsic_unbiased, linear_cka
from convit_scale.errors import BadInput


@pytest.mark.parametrize("tail", [1, 2, 3])
def test_a_tail_minibatch_of_three_or_fewer_is_left_out_not_fatal(tail):
    # analyze measures 32 images at a time: --images 33, 34, 35 leave a last minibatch the unbiased HSIC cannot use
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 + tail, 20, generator=g)
    acc, full = MinibatchCKA(1, 1), MinibatchCKA(1, 1)
    for batch in (x[:32], x[32:]):
        acc.update([batch], [batch * 2 + 1])
    full.update([x[:32]], [x[:32] * 2 + 1])
    assert acc.skipped == tail and acc.examples == 32
    assert torch.equal(acc.compute(), full.compute())
    small = MinibatchCKA(1, 1)
    small.update([x[:3]], [x[:3]])
    with pytest.raises(BadInput, match="more than 3 examples"):
        small.compute()


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
