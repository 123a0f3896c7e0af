from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable


class SiluAndMul(nn.Module):
    """silu(gate) * up, on the merged gate-up output [..., 2 * d] -> [..., d]."""

    def __init__(self, ops: KernelTable | None = None) -> None:
        super().__init__()
        # bit-identical to the ops below
        self.kernel = ops.silu_and_mul_bf16 if ops is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if self.kernel is not None and x.dtype == torch.bfloat16 and x.is_contiguous() \
                and d % 16 == 0:
            out = x.new_empty(*x.shape[:-1], d)
            self.kernel(out, x)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
