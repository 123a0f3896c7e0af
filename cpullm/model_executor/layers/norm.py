"""RMSNorm, with the residual add folded in."""

from __future__ import annotations

import torch
from torch import nn

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
