"""GLM-4 (``GlmForCausalLM``, glm-4-9b) and GLM-4-0414 (``Glm4ForCausalLM``): the Llama
layout with biased q/k/v, a gate-up projection stored fused (gate first), and rotary
embeddings on the first ``partial_rotary_factor`` of each head in GLM's interleaved layout
(pairs of neighbouring dims turn together). GLM-4-0414 also norms each block's output before
it joins the residual.

Interleaved pairs (2i, 2i + 1) at frequency i are rotate-half pairs (i, i + rotary_dim / 2)
once each head's rotary dims are reordered [0, 2, 4, ..., 1, 3, 5, ...]; q . k does not
change when q and k are reordered alike. So the q and k rows (and biases) are reordered as
they load, and the rotate-half kernels run GLM as they run Llama. A quantized checkpoint's
rows are packed (AWQ packs its output columns eight to a word), so there q and k are
reordered after the projection instead, at each step (two small gathers a layer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from cpullm.model_executor.layers.attention import AttentionMetadata
from cpullm.model_executor.layers.norm import RMSNorm
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.rotary import RotaryEmbedding
from cpullm.model_executor.layers.stage import stage_layers
from cpullm.model_executor.loader.weights import load_named_weights
from cpullm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    add_and_norm,
)


def rotate_half_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims that turns GLM's interleaved pairs into rotate-half ones."""
    return torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)])


class GlmForCausalLM(LlamaForCausalLM):
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v")}  # gate_up_proj comes fused

    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        return {"qkv_bias": bool(getattr(config, "attention_bias", True)), "o_bias": False,
                "qk_norm": False}

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, max_position, dtype, ops, quant_config)
        self.quantized = quant_config is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        config = self.config
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        first = stage_layers(config.num_hidden_layers)[0]  # this stage's first layer
        rotary_dim = self.model.layers[first].self_attn.rotary.rotary_dim
        order = rotate_half_order(head_dim, rotary_dim)

        def reorder(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                  "k_proj.bias")):
                return tensor
            rows = tensor.view(-1, head_dim, *tensor.shape[1:])  # [heads, head_dim, (hidden)]
            return rows[:, order].reshape(tensor.shape)

        if self.quantized:  # q and k reordered as they run
            for layer in stage_layers(config.num_hidden_layers):
                self.model.layers[layer].self_attn.qk_order = order
        else:
            weights = ((name, reorder(name, t)) for name, t in weights)
        load_named_weights(self, weights, self.stacked_params,
                           {"lm_head.weight"} if self.tie_word_embeddings else set())


class Glm4DecoderLayer(LlamaDecoderLayer):
    """GLM-4-0414: norms after attention and after the MLP, before the residual add."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, flags: dict[str, bool],
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, index: int = 0) -> None:
        super().__init__(config, rotary, flags, dtype, ops, quant_config, index)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                dtype, ops)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer = Glm4DecoderLayer
