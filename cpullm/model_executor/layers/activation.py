from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, on the merged gate-up output [..., 2 * d] -> [..., d]."""

    def __init__(self, ops: ModuleType | None = None) -> None:
        super().__init__()
        self.kernel = getattr(ops, "silu_and_mul_bf16", None)  # bit-identical to the ops below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if self.kernel is not None and x.dtype == torch.bfloat16 and x.is_contiguous() \
                and d % 16 == 0:
            out = x.new_empty(*x.shape[:-1], d)
            self.kernel(out, x)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
