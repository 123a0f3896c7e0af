"""What a model config needs to know of its model class, the kernels and the checkpoint's
files, resolved once when the engine's config is made (``resolve_model_config``), so that
``ModelConfig`` stays plain data: no property of it imports the model registry, loads the
kernel library or reads a file."""

from __future__ import annotations

import dataclasses
import glob
import os

import torch

from cpullm.config import ModelConfig
from cpullm.model_executor.layers.ops import chosen_level
from cpullm.model_executor.layers.rotary import longrope_edge
from cpullm.model_executor.loader.gguf_loader import gguf_weight_bytes
from cpullm.model_executor.loader.safetensors_loader import mxfp4_bytes, safetensors_numel
from cpullm.model_executor.models import get_model_class


def resolve_model_config(config: ModelConfig) -> ModelConfig:
    """``config`` with its resolved fields set: is_encoder, layer_windows, longrope_edge,
    keeps_quantized and weight_bytes."""
    model_class = get_model_class(config.architecture)
    windows = getattr(model_class, "layer_windows", None)
    config = dataclasses.replace(
        config, is_encoder=bool(getattr(model_class, "is_encoder", False)),
        layer_windows=tuple(windows(config.hf_config) if windows is not None
                            else [config.sliding_window or 0] * config.num_layers),
        longrope_edge=longrope_edge(config.hf_config, config.max_model_len),
        keeps_quantized=keeps_quantized(config))
    return dataclasses.replace(config, weight_bytes=weight_bytes(config))


def keeps_quantized(config: ModelConfig) -> bool:
    """Whether quantized weights stay quantized: where the quantized kernels run (AVX2, FMA
    and F16C; AVX-512 BF16 for FP8; the library CPULLM_KERNEL_ISA names; bfloat16 compute;
    see layers/quantization/kept.py and fp8.py)."""
    level = chosen_level()
    needs = {"avx512_bf16"} if config.quantization == "fp8" else set()
    runs = level is not None and needs <= level.needs
    return config.dtype == torch.bfloat16 and not config.enforce_eager and runs


def weight_bytes(config: ModelConfig) -> int:
    """Memory the weights take once loaded: a GGUF file's tensors as kept (blocks stay
    quantized), a quantized folder's files as they are, a folder's tensors in the compute
    dtype (``config.keeps_quantized`` resolved)."""
    source, dtype = config.source, config.dtype
    if config.quantization == "gguf" and source.gguf_path is not None:
        return gguf_weight_bytes(source.gguf_path, dtype, config.keeps_quantized)
    files = sorted(glob.glob(os.path.join(source.directory, "*.safetensors")))
    if config.quantization is not None and config.keeps_quantized:
        if config.quantization == "mxfp4":  # 4-bit codes kept as 8-bit ones, and scales
            # of 2 bytes (quantization/mxfp4.py): twice the MXFP4 tensors' bytes
            return sum(os.path.getsize(f) for f in files) + mxfp4_bytes(files)
        return sum(os.path.getsize(f) for f in files)
    element = torch.tensor([], dtype=dtype).element_size()
    if files and config.quantization in (None, "fp8", "mxfp4"):
        # every tensor of the folder in the compute dtype, whatever the architecture
        return safetensors_numel(files) * element
    # packed integers dequantized at load, or no weights to read: the Llama layout's count
    c = config.hf_config
    hidden, inter = c.hidden_size, c.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    embeddings = config.vocab_size * hidden * (
        1 if getattr(c, "tie_word_embeddings", False) else 2)
    return (config.num_layers * per_layer + embeddings + hidden) * element
