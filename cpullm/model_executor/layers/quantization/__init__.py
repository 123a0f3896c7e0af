"""The quantization seam: how a linear layer keeps its weight and multiplies by it.

Every linear layer owns one ``LinearMethod``. The method creates the layer's parameters (a
dense weight, or packed blocks with their scales), says how each checkpoint tensor loads
into them (through the parameters' ``weight_loader``, shard by shard for merged layers),
repacks them once after loading, and runs the matmul. A ``QuantizationConfig`` (one per
model, from the checkpoint's format) hands each layer its method; with none, layers are
dense (``DenseLinearMethod``). Formats (GGUF block types, AWQ/GPTQ int4, INT8 W8A8) and the
tensor-parallel linears plug in here, without touching the model files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from cpullm.model_executor.layers.ops import KernelTable

if TYPE_CHECKING:
    from cpullm.model_executor.layers.linear import LinearBase


class LinearMethod(ABC):
    """Parameters, loading, repacking and matmul of one linear layer's weight."""

    @abstractmethod
    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        """Register the layer's parameters, each with a ``weight_loader``."""

    @abstractmethod
    def process_weights_after_loading(self, layer: LinearBase, ops: KernelTable | None) -> None:
        """Repack the loaded parameters into the layout of the kernel that runs them."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` [..., input_size] -> [..., output_size], followed by the layer's
        fused activation if it has one (``layer.act``)."""

    @abstractmethod
    def describe(self, layer: LinearBase) -> str:
        """Which kernel runs this layer, for the debug log."""

    @staticmethod
    def create_bias(layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        """A dense bias [output_size] (every format keeps biases dense), or none."""
        if bias:
            layer.bias = torch.nn.Parameter(torch.empty(layer.output_size, dtype=dtype),
                                            requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
        else:
            layer.register_parameter("bias", None)


class QuantizationConfig(ABC):
    """A checkpoint's quantization format: hands every linear layer its method."""

    name: str  # as vLLM's --quantization spells it

    @abstractmethod
    def linear_method(self, layer: LinearBase) -> LinearMethod:
        """The method for ``layer``; a format may leave some layers dense."""
