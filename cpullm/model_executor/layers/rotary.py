"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Qwen)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # older configs: rope_theta + rope_scaling
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position, computed once."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int,
                 ops: KernelTable | None = None) -> None:
        super().__init__()
        self.ops = ops
        params = _rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported "
                             f"(supported: {', '.join(_STATIC_ROPE_TYPES)})")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            # transformers owns the scaling formulas (llama3, yarn, linear).
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim].
        The compiled kernel rotates q and k in place and returns them."""
        if self.ops is not None:
            self.ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
