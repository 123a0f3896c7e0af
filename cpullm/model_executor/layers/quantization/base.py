"""The bases of the quantization seam (quantization/__init__.py says how it works): a linear
layer's ``LinearMethod`` and a checkpoint format's ``QuantizationConfig``. Every method
and format module imports them from here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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

    def step_fn(self, layer: LinearBase, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """``apply`` for a 2-D contiguous x of ``dtype`` as one function of x with the
        choices that do not depend on x made once, and the most rows of x it holds for; None
        where the method has no such function (a decode step then calls ``apply``)."""
        return None

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
