"""Minibatch linear CKA with the unbiased HSIC estimator (Nguyen et al. 2021, as in Raghu et al. 2021).

CKA(X, Y) = sum_b HSIC_1(K_b, L_b) / sqrt(sum_b HSIC_1(K_b, K_b) * sum_b HSIC_1(L_b, L_b)),
K_b = X_b X_b^T and L_b = Y_b Y_b^T the linear Gram matrices of minibatch b (representations flattened
per example). Accumulating HSIC over minibatches makes the estimate independent of the batch size.
"""

from __future__ import annotations

import torch

from ..errors import BadInput


def hsic_unbiased(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Song et al. (2012) unbiased HSIC of two (n, n) Gram matrices, n > 3.

    HSIC_1 = [tr(K~L~) + (1'K~1)(1'L~1) / ((n-1)(n-2)) - 2/(n-2) 1'K~L~1] / (n(n-3)), K~ = K with zero diagonal.
    """
    n = K.shape[0]
    if n <= 3:
        raise ValueError(f"unbiased HSIC needs more than 3 examples per minibatch, got {n}")
    K = K.double().clone()
    L = L.double().clone()
    K.fill_diagonal_(0)
    L.fill_diagonal_(0)
    ones = torch.ones(n, 1, dtype=K.dtype, device=K.device)
    trace = (K * L.T).sum()
    sums = (ones.T @ K @ ones) * (ones.T @ L @ ones) / ((n - 1) * (n - 2))
    cross = (ones.T @ K @ L @ ones) * 2 / (n - 2)
    return ((trace + sums - cross) / (n * (n - 3))).squeeze()


class MinibatchCKA:
    """Accumulates HSIC terms for every pair of layers (rows: model A, columns: model B)."""

    def __init__(self, n_rows: int, n_cols: int):
        self.xy = torch.zeros(n_rows, n_cols, dtype=torch.float64)
        self.xx = torch.zeros(n_rows, dtype=torch.float64)
        self.yy = torch.zeros(n_cols, dtype=torch.float64)
        self.examples = self.skipped = 0

    @staticmethod
    def gram(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1).double()  # (n, features)
        return x @ x.T

    def update(self, rows: list[torch.Tensor], cols: list[torch.Tensor]) -> None:
        """Sums on the representations' device (the first update moves them there): no host sync per batch."""
        self.update_grams([self.gram(x) for x in rows], [self.gram(y) for y in cols])

    def update_grams(self, grams_r: list[torch.Tensor], grams_c: list[torch.Tensor]) -> None:
        """``update`` from the layers' Gram matrices (``gram``), which a caller may compute as each layer runs. A
        minibatch of 3 examples or fewer (the last of ``analyze --images 33``) has no unbiased HSIC: it is left out
        and counted in ``skipped``; the sum over the other minibatches stays an unbiased estimate."""
        n = grams_r[0].shape[0]
        if n <= 3:
            self.skipped += n
            return
        self.examples += n
        device = grams_r[0].device
        if self.xy.device != device:
            self.xy, self.xx, self.yy = self.xy.to(device), self.xx.to(device), self.yy.to(device)
        for i, K in enumerate(grams_r):
            self.xx[i] += hsic_unbiased(K, K)
            for j, L in enumerate(grams_c):
                self.xy[i, j] += hsic_unbiased(K, L)
        for j, L in enumerate(grams_c):
            self.yy[j] += hsic_unbiased(L, L)

    def compute(self) -> torch.Tensor:
        if self.examples == 0:
            raise BadInput(f"CKA needs a minibatch of more than 3 examples; got {self.skipped} example(s) in "
                           f"smaller ones")
        return self.xy / torch.sqrt(self.xx[:, None].clamp_min(1e-30) * self.yy[None, :].clamp_min(1e-30))


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """CKA of two representations of the same n examples (one minibatch)."""
    acc = MinibatchCKA(1, 1)
    acc.update([x], [y])
    return acc.compute().item()
