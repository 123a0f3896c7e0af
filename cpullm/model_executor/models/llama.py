"""The Llama family: Llama (SmolLM2, Llama 3.x), Mistral, Qwen2, Qwen3, Granite and Phi-3.

They differ in three switches: bias on the QKV projection (Qwen2), an RMSNorm on each
query and key head (Qwen3), and bias on the output projection; and Granite's four
multipliers, read from its config (``embedding_multiplier`` on the embeddings,
``attention_multiplier`` as the attention scale, ``residual_multiplier`` on each block's
output before it joins the residual, ``logits_scaling`` dividing the logits), which other
configs lack. Parameter names mirror Hugging Face's, except that q/k/v and gate/up are
merged (see ``stacked_params``; Phi-3's checkpoints store them merged already).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from cpullm.model_executor.layers.attention import AttentionMetadata
from cpullm.model_executor.layers.embedding import LMHead, VocabEmbedding
from cpullm.model_executor.layers.mlp import GatedMLP
from cpullm.model_executor.layers.norm import RMSNorm
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.rotary import RotaryEmbedding
from cpullm.model_executor.layers.self_attention import LlamaAttention
from cpullm.model_executor.layers.stage import (
    StagedDecoder,
    build_layers,
    first_stage_only,
    last_stage_only,
)
from cpullm.model_executor.loader.weights import load_named_weights


def add_and_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm: (norm(hidden + residual), hidden + residual); the first layer,
    with no residual yet, starts it from its input."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class LlamaDecoderLayer(nn.Module):
    decode_view = True  # forward only calls its parts (layers/decode_step.py)

    def __init__(self, config: Any, rotary: RotaryEmbedding, flags: dict[str, bool],
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, index: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, dtype=dtype, ops=ops,
                                        quant_config=quant_config, **flags)
        self.mlp = self.make_mlp(config, index, dtype, ops, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                ops)
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # (no helper calls: this forward is also the decode step, layers/decode_step.py)
        if residual is None:  # the first layer starts the residual stream from its input
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        multiplier = self.residual_multiplier  # Granite's, on each block's output
        if multiplier != 1.0:
            hidden = hidden * multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return (hidden if multiplier == 1.0 else hidden * multiplier), residual

    @staticmethod
    def make_mlp(config: Any, index: int, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None) -> nn.Module:
        """Layer ``index``'s feed-forward block (a mixture of experts overrides it)."""
        return GatedMLP(config.hidden_size, config.intermediate_size,
                        getattr(config, "mlp_bias", False), dtype, ops, quant_config)


class LlamaModel(StagedDecoder):
    def __init__(self, config: Any, max_position: int, flags: dict[str, bool],
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        rotary = RotaryEmbedding(config, head_dim, max_position, ops)
        # Under pipeline parallelism, this stage's part (layers/stage.py): the table on the
        # first stage, and on the last where the LM head is tied to it.
        self.embed_tokens = first_stage_only(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size, dtype, quant_config),
            also_last=bool(getattr(config, "tie_word_embeddings", False)))
        self.layers = build_layers(config.num_hidden_layers, lambda i: layer_cls(
            config, rotary, flags, dtype, ops, quant_config, i))
        self.norm = last_stage_only(
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops))
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embedding_multiplier == 1.0 else hidden * self.embedding_multiplier


def windows_by_layer_type(config: Any) -> list[int]:
    """Per layer: the sliding window for a ``sliding_attention`` layer of ``layer_types``
    (Gemma 2/3, gpt-oss), 0 for the others."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * \
        config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    return [window if kind == "sliding_attention" else 0 for kind in kinds]


class LlamaForCausalLM(nn.Module):
    decoder_layer = LlamaDecoderLayer
    # per layer sliding windows, for families whose layers differ (None: the model's
    # ``sliding_window`` in every layer); loader/sizes.py reads it into ModelConfig
    layer_windows: Callable[[Any], list[int]] | None = None
    # checkpoint name -> (merged parameter, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        """``ops``: the compiled CPU kernels, or None for plain torch ops (enforce_eager);
        ``quant_config``: the checkpoint's quantization format, or None for dense weights."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_position, self.layer_flags(config), dtype, ops,
                                quant_config, self.decoder_layer)
        self.lm_head = last_stage_only(
            lambda: LMHead(config.vocab_size, config.hidden_size, dtype, quant_config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and isinstance(self.lm_head, LMHead):
            self.lm_head.tie(self.model.embed_tokens)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        load_named_weights(self, weights, self.stacked_params, skip)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with Granite's multipliers (see the module docstring)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4: Llama whose checkpoints store q/k/v and gate/up fused
    (``qkv_proj``, ``gate_up_proj``, gate first), loaded whole into the merged layers.
    Their LongRoPE and partial rotary are the rotary embedding's."""

    stacked_params: dict[str, tuple[str, str | int]] = {}
