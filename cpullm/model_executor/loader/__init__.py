"""Build a model for a ModelConfig and fill it from its checkpoint."""

from __future__ import annotations

import time

import torch
from torch import nn

from cpullm.config import ModelConfig
from cpullm.logger import init_logger
from cpullm.model_executor.layers.ops import load_ops
from cpullm.model_executor.loader.gguf_loader import iterate_gguf
from cpullm.model_executor.loader.safetensors_loader import iterate_safetensors
from cpullm.model_executor.models import get_model_class

logger = init_logger(__name__)


def get_model(config: ModelConfig) -> nn.Module:
    start = time.perf_counter()
    model_class = get_model_class(config.architecture)
    ops = None if config.enforce_eager else load_ops()
    model = model_class(config.hf_config, config.max_model_len, config.dtype, ops)
    source = config.source
    if source.gguf_path is not None:
        weights = iterate_gguf(source.gguf_path, config.num_heads, config.num_kv_heads)
    else:
        weights = iterate_safetensors(source.directory)
    with torch.no_grad():
        model.load_weights(weights)  # type: ignore[operator]
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("Loaded %s (%s, %.1fM parameters, %s, %s) in %.2f s", config.architecture,
                source.gguf_file or source.directory, num_params / 1e6,
                str(config.dtype).removeprefix("torch."),
                "compiled kernels" if ops is not None else "eager torch ops",
                time.perf_counter() - start)
    return model
