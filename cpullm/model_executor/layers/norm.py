"""RMSNorm, with the residual add folded in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cpullm.model_executor.layers.decode_step import UNLIMITED
from cpullm.model_executor.layers.ops import KernelTable


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 ops: KernelTable | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        # The fused bfloat16 kernel (bit-identical to the ops below), where it was built.
        self.kernel = ops.rms_norm_bf16 if ops is not None and hidden_size % 16 == 0 else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the compute dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual);
        the kernel computes that pair in place, in x and residual."""
        if (self.kernel is not None and x.dtype == torch.bfloat16 and x.is_contiguous()
                and (residual is None or residual.is_contiguous())):
            if residual is None:
                out = torch.empty_like(x)
                self.kernel(out, x, None, self.weight, self.eps)
                return out
            self.kernel(x, x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def step_fn(self, dtype: torch.dtype) -> tuple[Callable[..., Any], int] | None:
        """forward in a decode step (layers/decode_step.py), whose residual is contiguous:
        with a residual, the kernel's in-place call without forward's other checks."""
        if (type(self).forward is not RMSNorm.forward or self.kernel is None
                or dtype != torch.bfloat16 or self.weight.dtype != dtype):
            return None
        kernel, weight, eps, forward = self.kernel, self.weight, self.eps, self.forward

        def norm(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
            if residual is None or not x.is_contiguous():  # (a head's q or k: a view)
                return forward(x, residual)
            kernel(x, x, residual, weight, eps)
            return x, residual

        return norm, UNLIMITED
