"""Mixture-of-experts members of the Llama family: Qwen3-MoE (``Qwen3MoeForCausalLM``),
Qwen2-MoE (``Qwen2MoeForCausalLM``, with a shared expert behind a sigmoid gate) and Mixtral
(``MixtralForCausalLM``, whose checkpoints name the block ``block_sparse_moe`` and an
expert's projections w1, w3 and w2). Their sparse blocks are ``layers/moe.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from cpullm.model_executor.layers.moe import SparseMoE
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama-family layer whose feed-forward block is sparse where the config says so
    (every ``decoder_sparse_step``-th layer, but those in ``mlp_only_layers``)."""

    @staticmethod
    def make_mlp(config: Any, index: int, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        sparse = (index not in (getattr(config, "mlp_only_layers", None) or [])
                  and num_experts > 0 and (index + 1) % step == 0)
        if not sparse:
            return LlamaDecoderLayer.make_mlp(config, index, dtype, ops, quant_config)
        expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return SparseMoE(config.hidden_size, expert_size, num_experts,
                         config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", True)),
                         dtype, ops, quant_config,
                         getattr(config, "shared_expert_intermediate_size", 0) or 0)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MoeDecoderLayer
    stacked_params = {**LlamaForCausalLM.stacked_params,
                      "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = ((name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj."),
                    tensor) for name, tensor in weights)
        super().load_weights(renamed)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_layer = MoeDecoderLayer


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    decoder_layer = MoeDecoderLayer

