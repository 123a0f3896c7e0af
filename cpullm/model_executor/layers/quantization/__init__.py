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

from cpullm.model_executor.layers.quantization.base import QuantizationConfig

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
