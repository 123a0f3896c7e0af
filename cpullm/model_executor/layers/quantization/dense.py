"""Dense weights (float32, bfloat16, float16): the method every linear layer has unless a
quantization format gives it another; its packed GEMMs are in layers/packed_gemm.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.platform_gemm import create_gemm
from cpullm.model_executor.layers.quantization.base import LinearMethod

if TYPE_CHECKING:
    from cpullm.model_executor.layers.linear import LinearBase


class DenseLinearMethod(LinearMethod):
    """A weight [output_size, input_size] in the model's dtype. After loading, a bfloat16 or
    float16 weight moves into the layout of the GEMM that runs it (``PackedGemm``, kept as
    ``layer.gemm``) and the plain copy is dropped; float32 stays with ATen's GEMM."""

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size,
                                                dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
        self.create_bias(layer, bias, dtype)
        layer.gemm = None

    def process_weights_after_loading(self, layer: LinearBase, ops: KernelTable | None) -> None:
        bias = None if layer.bias is None else layer.bias.data
        layer.gemm = create_gemm(layer.weight.data, bias, ops, layer.act)
        if layer.gemm is not None:
            layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype),
                                        requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(torch.empty(0, dtype=layer.bias.dtype),
                                          requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if layer.gemm is not None:
            return layer.gemm(x)
        out = F.linear(x, layer.weight, layer.bias)
        return layer.act(out) if layer.act is not None else out

    def step_fn(self, layer: LinearBase, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """The packed weight itself (it picks its kernel by rows at each call)."""
        return (layer.gemm, 1 << 30) if layer.gemm is not None else None

    def describe(self, layer: LinearBase) -> str:
        if layer.gemm is not None:
            return layer.gemm.describe()
        if layer.weight.dtype == torch.float32 and torch.backends.mkl.is_available():
            return "MKL sgemm"
        return "ATen linear"
