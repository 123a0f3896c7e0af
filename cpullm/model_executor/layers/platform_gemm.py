"""The packed GEMM of a dense weight for this machine (``create_gemm``): ``PackedGemm``, and
on the AMD Zen platform zentorch's linear (ZenDNN) for a weight where, and for the row
counts where, it is measured faster than cpullm's own GEMM on this machine.

Each weight shape is timed once per process, at 1 row (a decode step of one sequence) and
at 128 (a batch of decodes, a prompt chunk), both ways; zentorch takes a side only when it
is at least 10% faster there, so that noise never trades a kernel for a slower one. On two
Zen 5 cores (AMD EPYC, AVX-512 BF16) zentorch 2.13.0.2 was slower than the own GEMM for
almost every shape of SmolLM2-135M and all-MiniLM-L6-v2 (1.05-1.9x the time; 0.89-0.95x at
1 and 512 rows of the LM head and at 512 rows of two MiniLM shapes), so there this keeps
the own GEMM nearly everywhere; docs/deployment.md has the table.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import torch

from cpullm.logger import init_logger
from cpullm.model_executor.layers.activation import SiluAndMul
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm
from cpullm.platform.zen import weight_prepack, zen_platform

logger = init_logger(__name__)

_SMALL_ROWS = 16  # up to here the 1-row timing decides, above it the 128-row one
_TIMED_ROWS = (1, 128)
_MARGIN = 0.9  # zentorch must take at most this share of the own GEMM's time
_choices: dict[tuple[Any, ...], tuple[bool, bool]] = {}


class ZenGemm(PackedGemm):
    """A packed weight that zentorch's linear runs for small batches, large ones or both
    (``zen_small``, ``zen_large``); the own packed GEMM runs the rest."""

    zentorch: ModuleType
    zen_weight: torch.Tensor
    zen_small: bool
    zen_large: bool

    def describe(self) -> str:
        zen = "zentorch linear (ZenDNN)"
        if self.zen_small and self.zen_large:
            where = zen
        elif self.zen_small:
            where = f"{zen} up to {_SMALL_ROWS} rows, {self.path.value} above"
        else:
            where = f"{self.path.value} up to {_SMALL_ROWS} rows, {zen} above"
        return where + (", with SiLU-mul" if self.silu_mul else "")

    def tensors(self) -> list[torch.Tensor | None]:
        return [*super().tensors(), self.zen_weight]

    def zen(self, x: torch.Tensor) -> torch.Tensor:
        out = self.zentorch_linear(x, self.zen_weight, self.bias,
                                   is_weight_prepacked=self.prepacked)
        return self.act(out) if self.act is not None else out

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.zen_small if rows.shape[0] <= _SMALL_ROWS else self.zen_large:
            out = self.zen(rows).view(*x.shape[:-1], self.output_size)
            return out if out_dtype is None else out.to(out_dtype)
        return super().__call__(x, out_dtype)


def create_gemm(weight: torch.Tensor, bias: torch.Tensor | None, ops: KernelTable | None,
                silu_mul: SiluAndMul | None = None) -> PackedGemm | None:
    """``PackedGemm.create``'s packed weight, on the AMD Zen platform with zentorch's linear
    where it measures faster."""
    gemm = PackedGemm.create(weight, bias, ops, silu_mul)
    zentorch = zen_platform() if gemm is not None else None
    return gemm if zentorch is None else zen_gemm(gemm, weight, bias, zentorch)


def zen_gemm(own: PackedGemm, weight: torch.Tensor, bias: torch.Tensor | None,
             zentorch: ModuleType) -> PackedGemm:
    """``own``, or the same weight with zentorch's linear where it measures faster."""
    if weight.dtype == torch.float16 and not zentorch._C.is_fp16_supported():
        return own
    gemm = ZenGemm.__new__(ZenGemm)
    gemm.__dict__.update(own.__dict__)
    gemm.zentorch_linear = torch.ops.zentorch.zentorch_linear_unary
    gemm.prepacked = weight_prepack()
    gemm.zen_weight = (torch.ops.zentorch.zentorch_weight_prepack_for_linear(weight)
                       if gemm.prepacked else weight.contiguous())
    key = (*weight.shape, weight.dtype, own.silu_mul, bias is not None, gemm.prepacked)
    if key not in _choices:
        _choices[key] = _measure(own, gemm, weight.shape[1], weight.dtype)
        logger.debug("zentorch for %s weights: %s", tuple(weight.shape), _choices[key])
    gemm.zen_small, gemm.zen_large = _choices[key]
    if not (gemm.zen_small or gemm.zen_large):
        return own  # the zentorch copy is dropped
    if gemm.zen_small and gemm.zen_large:  # the own copies are dropped
        gemm.panels = gemm.panel_bias = gemm.onednn = None
    return gemm


def _measure(own: PackedGemm, gemm: ZenGemm, k: int, dtype: torch.dtype) -> tuple[bool, bool]:
    """(zentorch at the small size, zentorch at the large size)."""
    wins = []
    for rows in _TIMED_ROWS:
        x = torch.randn(rows, k).to(dtype)
        wins.append(_seconds(gemm.zen, x) < _MARGIN * _seconds(own, x))
    return wins[0], wins[1]


def _seconds(f: Any, x: torch.Tensor, budget: float = 0.05) -> float:
    """The best of a few calls, within about ``budget`` seconds after a warm-up."""
    f(x)
    best, spent = float("inf"), 0.0
    for _ in range(20):
        start = time.perf_counter()
        f(x)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget and best < float("inf"):
            break
    return best
