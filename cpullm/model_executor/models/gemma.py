"""Gemma, Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's own parts.

- RMSNorm scales by (1 + weight): the checkpoint's weights are loaded plus one.
- GeGLU: down(gelu_tanh(gate) * up), the merged gate-up layer without a fused activation.
- The embeddings are multiplied by sqrt(hidden size) (in the compute dtype, as
  transformers rounds it); the LM head is the tied embedding table.
- Gemma 2 and 3: norms after attention and around the MLP (the block outputs are normed
  before they join the residual), the attention scale 1 / sqrt(query_pre_attn_scalar), two
  kinds of layers (``layer_types``): sliding ones with their window and full ones, and the
  optional soft-caps of the attention scores and of the final logits (Gemma 2 sets both).
- Gemma 3: an RMSNorm on each query and key head, and rope parameters per layer kind (the
  sliding layers have their own base).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.attention import AttentionMetadata
from cpullm.model_executor.layers.embedding import LMHead, VocabEmbedding
from cpullm.model_executor.layers.linear import MergedColumnLinear, RowParallelLinear
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
from cpullm.model_executor.models.llama import (
    LlamaForCausalLM,
    add_and_norm,
    windows_by_layer_type,
)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with the weight (1 + w) of the checkpoint's w."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 ops: KernelTable | None = None) -> None:
        super().__init__(hidden_size, eps, dtype, ops)
        self.weight.weight_loader = self.load_plus_one  # type: ignore[attr-defined]

    @staticmethod
    def load_plus_one(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
        param.data.copy_(1.0 + loaded.float())  # the sum in float32, as transformers adds it


class GemmaMLP(nn.Module):
    decode_view = True  # forward only calls its parts (layers/decode_step.py)

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden_size, [intermediate_size] * 2,
                                               dtype=dtype, quant_config=quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype=dtype,
                                           quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    decode_view = True  # forward only calls its parts (layers/decode_step.py)

    def __init__(self, config: Any, rotary: RotaryEmbedding, window: int | None,
                 version: int, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        scale = config.query_pre_attn_scalar ** -0.5 if version >= 2 else None
        softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.self_attn = LlamaAttention(config, rotary, bias, bias, version == 3, dtype, ops,
                                        quant_config, scale=scale, window=window,
                                        norm=GemmaRMSNorm, softcap=softcap)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, dtype, quant_config)
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = version >= 2
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        # Gemma 2 and 3: each block's output is normed before it joins the residual (the
        # next norm's residual add).
        hidden, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(StagedDecoder):
    def __init__(self, config: Any, max_position: int, version: int, dtype: torch.dtype,
                 ops: KernelTable | None, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        kinds = list(getattr(config, "layer_types", None)
                     or ["full_attention"] * config.num_hidden_layers)
        # Gemma 2 and 3: sliding layers have their window, full ones none; Gemma 3: rope
        # parameters per layer kind
        rotary = {kind: RotaryEmbedding(config, head_dim, max_position, ops,
                                        layer_type=kind if version == 3 else None)
                  for kind in dict.fromkeys(kinds)}
        windows = windows_by_layer_type(config) if version >= 2 else [None] * len(kinds)
        # the LM head is tied to the table: the last pipeline stage holds it too
        self.embed_tokens = first_stage_only(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size, dtype, quant_config),
            also_last=True)
        self.layers = build_layers(len(kinds), lambda i: GemmaDecoderLayer(
            config, rotary[kinds[i]], windows[i], version, dtype, ops, quant_config))
        self.norm = last_stage_only(
            lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # the scale rounded as transformers rounds it: to float32, then the compute dtype
        return hidden * torch.tensor(self.hidden_size ** 0.5).to(hidden.dtype)


class GemmaForCausalLM(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params
    version = 1
    layer_windows = None  # Gemma: every layer attends to the whole context

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in ("gelu_pytorch_tanh", "gelu"):  # "gelu": Gemma's legacy name for tanh
            raise ValueError(f"hidden activation {act!r} is not supported (gelu_pytorch_tanh)")
        self.config = config
        self.model = GemmaModel(config, max_position, self.version, dtype, ops, quant_config)
        self.lm_head = last_stage_only(
            lambda: LMHead(config.vocab_size, config.hidden_size, dtype, quant_config))
        if isinstance(self.lm_head, LMHead):
            self.lm_head.tie(self.model.embed_tokens)
        self.softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.stacked_params, {"lm_head.weight"})


class Gemma2ForCausalLM(GemmaForCausalLM):
    version = 2
    layer_windows = staticmethod(windows_by_layer_type)


class Gemma3ForCausalLM(GemmaForCausalLM):
    version = 3
    layer_windows = staticmethod(windows_by_layer_type)
