"""The gated feed-forward block of the Llama family (and of each expert of a mixture)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cpullm.model_executor.layers.linear import GateUpSiluLinear, RowParallelLinear
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig


class GatedMLP(nn.Module):
    """The Llama family's feed-forward block: down(silu(gate(x)) * up(x)), gate and up
    merged into one projection."""

    decode_view = True  # where step_fn has no kernels: forward only calls its parts

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, reduce: bool = True) -> None:
        """``reduce``: sum the tensor-parallel ranks' partial outputs (a mixture of experts
        sums all its experts' at once instead)."""
        super().__init__()
        self.gate_up_proj = GateUpSiluLinear(hidden_size, intermediate_size, bias, dtype, ops,
                                             quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           dtype=dtype, quant_config=quant_config, reduce=reduce)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gate-up product (where the projection has not applied SiLU-mul itself, as
        the grouped expert kernels leave it) -> the down projection's input."""
        return self.gate_up_proj.act(gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))

    def step_fn(self, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """forward in a decode step (layers/decode_step.py): the two products' kernels."""
        if type(self).forward is not GatedMLP.forward:
            return None
        made = [self.gate_up_proj.step_fn(dtype), self.down_proj.step_fn(dtype)]
        if made[0] is None or made[1] is None:
            return None
        (gate_up, gate_up_rows), (down, down_rows) = made
        return (lambda x: down(gate_up(x))), min(gate_up_rows, down_rows)
