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


# --quantization's values, as vLLM names them (marlin: vLLM's GPU kernels for the same
# checkpoints, accepted for the flags to carry over)
QUANTIZATION_METHODS = ("gguf", "awq", "gptq", "compressed-tensors", "fp8", "mxfp4")
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


def canonical_method(name: str) -> str:
    return _ALIASES.get(name.lower(), name.lower())


def get_quantization_config(method: str | None, hf_config: object) -> QuantizationConfig | None:
    """The config of a checkpoint in format ``method`` (GGUF, or one whose config.json has
    a ``quantization_config``); None for dense weights. An unsupported scheme of a
    supported format is refused by name (ValueError)."""
    if method is None:
        return None
    if method == "gguf":
        from cpullm.model_executor.layers.quantization.gguf import GGUFConfig

        return GGUFConfig()
    from cpullm.model_executor.layers.quantization.awq import AWQConfig
    from cpullm.model_executor.layers.quantization.compressed_tensors import (
        CompressedTensorsConfig,
        FP8Config,
    )
    from cpullm.model_executor.layers.quantization.gptq import GPTQConfig
    from cpullm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

    configs: dict[str, type[QuantizationConfig]] = {
        "awq": AWQConfig, "gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig,
        "fp8": FP8Config, "mxfp4": Mxfp4Config}
    config = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(config, dict):
        config = config.to_dict()
    return configs[method](config)  # type: ignore[call-arg]
