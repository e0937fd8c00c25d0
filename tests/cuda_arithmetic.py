"""What a GPU computes differently from the CPU, emulated on the CPU for the device data path's tests."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.overrides import TorchFunctionMode


class CudaScalarDivision(TorchFunctionMode):
    """The GPU's true division by a number, on the CPU: CUDA divides a tensor by a Python number as a multiplication
    by the number's reciprocal (ATen's ``div_true_kernel_cuda``: ``a * (1 / b)`` in the op's math type), which
    differs from the CPU's division in the last bit unless the number is a power of two. The device data path rounds
    and truncates to whole pixel levels and indices, where a last bit moves a value by one: its CPU tests run under
    this mode and see what a GPU computes, and ``inexact`` lists the divisors whose reciprocal is not exact (a
    path that divides by none computes the same on both). ``number / tensor`` is ``reciprocal() * number`` on every
    device (torch's ``Tensor.__rdiv__``), so it needs no emulation. Code that runs on the host in a GPU run too (the
    augmentation's plan, drawn on the CPU) runs inside ``host()``, with the CPU's division."""

    DIVISIONS = frozenset({torch.Tensor.div, torch.Tensor.div_, torch.div, torch.Tensor.true_divide,
                           torch.Tensor.true_divide_, torch.true_divide})

    def __init__(self):
        super().__init__()
        self.inexact: list[float] = []
        self._host = False

    @contextlib.contextmanager
    def host(self):
        """What runs inside divides as the CPU does: code that a GPU run keeps on the host."""
        self._host = True
        try:
            yield
        finally:
            self._host = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._host and func in self.DIVISIONS and len(args) == 2 and isinstance(args[0], torch.Tensor) \
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool) \
                and kwargs.get("rounding_mode") is None and "out" not in kwargs:
            a, b = args
            dtype = torch.result_type(a, b)
            if dtype.is_floating_point:
                if b == 0 or math.frexp(abs(b))[0] != 0.5:  # not a power of two
                    self.inexact.append(b)
                opmath = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
                inverse = torch.tensor(1.0, dtype=opmath) / torch.tensor(float(b), dtype=opmath)
                out = (a.to(opmath) * inverse).to(dtype)
                return a.copy_(out) if func in (torch.Tensor.div_, torch.Tensor.true_divide_) else out
        return func(*args, **kwargs)
