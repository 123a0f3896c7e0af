"""Build a model for a ModelConfig and fill it from its checkpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from cpullm import distributed
from cpullm.config import ModelConfig
from cpullm.logger import init_logger
from cpullm.model_executor.layers.embedding import LMHead
from cpullm.model_executor.layers.linear import LinearBase
from cpullm.model_executor.layers.moe import SparseMoE
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm
from cpullm.model_executor.layers.quantization import get_quantization_config
from cpullm.model_executor.layers.quantization.kept import VNNI_MAX_ROWS
from cpullm.model_executor.loader.gguf_loader import iterate_gguf, prepared_ahead
from cpullm.model_executor.loader.safetensors_loader import iterate_pickle, iterate_safetensors
from cpullm.model_executor.models import get_model_class

logger = init_logger(__name__)


def get_model(config: ModelConfig, ops: KernelTable | None) -> nn.Module:
    """The model with its weights loaded; ``ops``: the compiled kernels it may use, or None
    for plain torch ops."""
    start = time.perf_counter()
    source = config.source
    logger.info("Loading the weights from %s%s", source.gguf_file or source.directory,
                f" ({config.quantization})" if config.quantization else "")
    model_class = get_model_class(config.architecture)
    quant_config = get_quantization_config(config.quantization, config.hf_config)
    model = model_class(config.mm_config if config.mm_config is not None else config.hf_config,
                        config.max_model_len, config.dtype, ops, quant_config)
    if config.lora is not None:  # (around the methods before they pack the weights)
        from cpullm.lora.manager import wrap_lora_layers
        wrap_lora_layers(model, config.dtype, config.lora)
    if source.gguf_path is not None:
        weights = iterate_gguf(source.gguf_path, config.num_heads, config.num_kv_heads)
        if distributed.layout().world_size == 1:  # (a rank takes apart only its parts)
            weights = prepared_ahead(weights, torch.get_num_threads())
    elif source.pickle:
        weights = iterate_pickle(source.directory)
    else:
        weights = iterate_safetensors(source.directory)
    if config.lm_head_quantization == "int8":
        for module in model.modules():
            if isinstance(module, LMHead):
                module.int8 = True
    with torch.no_grad():
        model.load_weights(weights)  # type: ignore[operator]
        finish_loading(model, ops)
    model.eval()
    _log_gemm_paths(model, config.dtype)
    logger.info("Loaded %s (%s, %.0f MB of weights, %s, %s) in %.2f s", config.architecture,
                source.gguf_file or source.directory, weight_bytes(model) / 1e6,
                str(config.dtype).removeprefix("torch."),
                "compiled kernels" if ops is not None else "eager torch ops",
                time.perf_counter() - start)
    return model


def finish_loading(model: nn.Module, ops: KernelTable | None) -> None:
    """Every module's post-load step (packing, quantized layouts), children first. The
    linear layers' steps, most of a quantized model's load, run on every core first: each
    is a leaf that reads nothing of another module's."""
    modules = [(name, module) for name, module in _children_first(model)
               if hasattr(module, "process_weights_after_loading")]
    leaves = [(name, module) for name, module in modules
              if isinstance(module, LinearBase)]
    with ThreadPoolExecutor(max(1, torch.get_num_threads()),
                            thread_name_prefix="finish-loading") as pool:
        for future in [pool.submit(_finish, name, module, ops) for name, module in leaves]:
            future.result()
    done = {id(module) for _, module in leaves}
    for name, module in modules:
        if id(module) not in done:
            _finish(name, module, ops)


def _finish(name: str, module: nn.Module, ops: KernelTable | None) -> None:
    try:
        with torch.no_grad():  # (grad mode is per thread)
            module.process_weights_after_loading(ops)  # type: ignore[operator]
    except ValueError as e:
        raise ValueError(f"cannot load {name}: {e}") from None


def _children_first(module: nn.Module, prefix: str = "",
                    seen: set[int] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """Every module once (as ``named_modules`` names it), after its submodules: a
    module's post-load step may read what its children's made (a mixture of experts its
    experts' packed weights), and a tied LM head the embedding table it shares."""
    seen = set() if seen is None else seen
    seen.add(id(module))
    for name, child in module.named_children():
        if id(child) not in seen:
            yield from _children_first(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def weight_bytes(model: nn.Module) -> int:
    """The memory the model's weights take, as loaded (packed copies and quantized blocks
    included; a tensor shared by two modules counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():  # the packed copies of the dense GEMMs, GGUF segments
        segments = getattr(module, "segments", [])
        held = [getattr(module, "gemm", None), *(s.gemm for s in segments),
                *(s.dense for s in segments)]
        for item in held:
            parts = item.tensors() if isinstance(item, PackedGemm) else (item,)
            for t in parts:
                if t is not None:
                    tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _log_gemm_paths(model: nn.Module, dtype: torch.dtype) -> None:
    """With VLLM_LOGGING_LEVEL=DEBUG: the kernel behind every linear layer."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            logger.debug("%s: %s [%d -> %d] %s via %s", name, type(module).__name__,
                         module.input_size, module.output_size,
                         str(dtype).removeprefix("torch."), module.method.describe(module))
        elif isinstance(module, SparseMoE):
            logger.debug("%s: SparseMoE, %d experts, top %d%s, %s: per step, %s", name,
                         module.num_experts, module.top_k,
                         " renormalised" if module.normalize else "",
                         "with a gated shared expert" if module.shared_expert is not None
                         else "no shared expert",
                         "the chosen experts' gate-ups in one grouped kernel call, then their "
                         f"downs (up to {module.grouped[2]} rows an expert)"
                         if module.grouped[0] else
                         "the chosen experts' kept-quantized gate-ups in one int8 kernel call, "
                         f"then their downs (up to {VNNI_MAX_ROWS} rows an expert)"
                         if module.kept_grouped is not None else "one gate-up and one down "
                         "GEMM per expert some token chose, over its tokens")
        elif isinstance(module, LMHead):
            logger.debug("%s: LMHead [%d -> %d] %s via %s", name, module.hidden_size,
                         module.vocab_size, str(dtype).removeprefix("torch."), module.describe())
