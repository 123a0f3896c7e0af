"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): a Llama-layout decoder whose
every feed-forward block is a mixture of experts, with

- attention: biased q/k/v/o, a learned sink logit per head (one more term of each
  softmax denominator, attached to no value), and layers that alternate between a sliding
  window (``layer_types``) and the whole context; YaRN rotary (the rotary embedding's);
- a router with a bias, whose top-k logits are softmaxed (not all of them);
- experts with biases and a clamped SwiGLU: gate and up come interleaved (even and odd
  columns) in the checkpoint, gate is clipped above at ``swiglu_limit``, up to
  +-``swiglu_limit``, and the output is (up + 1) * gate * sigmoid(``swiglu_alpha`` * gate).

Checkpoints store each layer's experts stacked: ``experts.gate_up_proj`` [experts, hidden,
2 x intermediate] and ``experts.down_proj`` [experts, intermediate, hidden] (transposed
against a linear layer's weight), with biases; OpenAI's releases store the two weights in
MXFP4 (``*_blocks``: 4-bit e2m1 values, two a byte, 32 to a block; ``*_scales``: a power of
two per block, e8m0), which ``quant_method: mxfp4`` keeps quantized
(layers/quantization/mxfp4.py). They load into one ordinary linear layer per expert and
projection (de-interleaved, gate rows then up rows), so the experts run as those of the
other mixtures do (``SparseMoE``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.linear import MergedColumnLinear, RowParallelLinear
from cpullm.model_executor.layers.moe import SparseMoE
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.rotary import RotaryEmbedding
from cpullm.model_executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    windows_by_layer_type,
)


class GptOssExpert(nn.Module):
    """One expert: gate-up (gate rows, then up rows) and down, both biased, around the
    clamped SwiGLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float,
                 dtype: torch.dtype, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = MergedColumnLinear(hidden_size, [intermediate_size] * 2, bias=True,
                                               dtype=dtype, quant_config=quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=True,
                                           dtype=dtype, quant_config=quant_config, reduce=False)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gate-up projection's output -> the down projection's input."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(self.gate_up_proj(x)))


class GptOssMoE(SparseMoE):
    """Routed by the top-k of the router's biased logits, softmaxed among themselves."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [tokens, num_experts]
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return experts, F.softmax(top, dim=-1, dtype=top.dtype)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, rotary: RotaryEmbedding, flags: dict[str, bool],
                 dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, index: int = 0) -> None:
        window = windows_by_layer_type(config)[index]
        super().__init__(config, rotary, {**flags, "window": window, "sinks": True}, dtype,
                         ops, quant_config, index)

    @staticmethod
    def make_mlp(config: Any, index: int, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None) -> nn.Module:
        def expert() -> GptOssExpert:
            return GptOssExpert(config.hidden_size, config.intermediate_size,
                                config.swiglu_alpha, config.swiglu_limit, dtype, quant_config)

        return GptOssMoE(config.hidden_size, config.intermediate_size,
                         config.num_local_experts, config.num_experts_per_tok, True, dtype,
                         ops, quant_config, expert=expert, gate_bias=True)


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer
    layer_windows = staticmethod(windows_by_layer_type)

    @staticmethod
    def layer_flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's names and tensors as the model's: the router as the gate, each
    layer's stacked experts as tensors per expert, [out, in] (MXFP4 ones as their blocks and
    scales, which quantization/mxfp4.py loads), the interleaved gate-up as gate_proj and
    up_proj (the merged layer's shards, which tensor parallelism splits each)."""
    for name, tensor in weights:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        if ".mlp.experts." not in name:
            yield name, tensor
            continue
        prefix, _, leaf = name.rpartition(".")
        if leaf.endswith(("_blocks", "_scales")):
            # MXFP4 is stored [experts, out, ...]: a linear layer's [out, ...] per expert
            projection, _, part = leaf.rpartition("_")
            yield from _split_experts(prefix, projection, tensor, False, f"weight_{part}")
        else:  # [experts, in, out] weights, [experts, out] biases
            bias = leaf.endswith("_bias")
            yield from _split_experts(prefix, leaf.removesuffix("_bias"), tensor, not bias,
                                      "bias" if bias else "weight")


def _split_experts(prefix: str, projection: str, tensor: torch.Tensor, transposed: bool,
                   leaf: str) -> Iterator[tuple[str, torch.Tensor]]:
    if projection not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"checkpoint tensor {prefix}.{projection}: not a gpt-oss expert "
                         "projection")
    for expert, part in enumerate(tensor.unbind(0)):
        if transposed:
            part = part.t()  # [out, in]
        if projection == "gate_up_proj":  # even rows gate, odd rows up: the merged layer's
            yield f"{prefix}.{expert}.gate_proj.{leaf}", part[0::2].contiguous()  # shards
            yield f"{prefix}.{expert}.up_proj.{leaf}", part[1::2].contiguous()
        else:
            yield f"{prefix}.{expert}.{projection}.{leaf}", part.contiguous()

