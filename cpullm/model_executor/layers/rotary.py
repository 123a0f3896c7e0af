"""Rotary position embedding (rotate-half layout, as Hugging Face Llama/Qwen), over the
whole head or its first ``partial_rotary_factor`` share (Phi-4-mini, GLM)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None)
    if layer_type is not None:  # one set per layer type (Gemma 3)
        params = params[layer_type]
    if params is None:  # older configs: rope_theta + rope_scaling
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def longrope_edge(hf_config: Any, max_len: int) -> int | None:
    """For LongRoPE (Phi-3's ``longrope`` / ``su``): the pretraining length past which a
    sequence runs on the long factors, where sequences of ``max_len`` tokens can pass it;
    else None."""
    params = _rope_parameters(hf_config)
    if params["rope_type"] != "longrope":
        return None
    edge = params.get("original_max_position_embeddings",
                      getattr(hf_config, "original_max_position_embeddings", None))
    return edge if edge is not None and max_len > edge else None


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position, computed once."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int,
                 ops: KernelTable | None = None, layer_type: str | None = None) -> None:
        """``layer_type``: for configs with rope parameters per layer type (Gemma 3's
        "sliding_attention" and "full_attention"), the one these tables are for."""
        super().__init__()
        self.ops = ops
        params = _rope_parameters(hf_config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported "
                             f"(supported: {', '.join(_STATIC_ROPE_TYPES)})")
        partial = params.get("partial_rotary_factor",
                             getattr(hf_config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * partial)  # the first rotary_dim of each head turn
        positions = torch.arange(max_position, dtype=torch.float)
        factors = getattr(hf_config, "rope_freq_factors", None)  # a GGUF file's rope_freqs
        if factors is not None and rope_type != "default":
            raise ValueError(f"rope frequency factors with rope type {rope_type!r} are not "
                             "supported (only with the default type)")
        if rope_type == "default":
            base, dim = params["rope_theta"], self.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            if factors is not None:  # as llama.cpp applies them: each frequency divided
                if len(factors) != dim // 2:
                    raise ValueError(f"{len(factors)} rope frequency factors for a rotary "
                                     f"dimension of {dim}: {dim // 2} expected")
                inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
            cos, sin = self._tables(positions, inv_freq, 1.0)
        else:
            # transformers owns the scaling formulas (llama3, yarn, linear, longrope).
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            rope_init = ROPE_INIT_FUNCTIONS[rope_type]

            def init(config: Any, device: torch.device, **kwargs: Any) -> tuple:
                if layer_type is not None:
                    kwargs["layer_type"] = layer_type
                return rope_init(config, device, **kwargs)

            cos, sin = self._tables(positions, *init(hf_config, torch.device("cpu")))
            edge = longrope_edge(hf_config, max_position)
            if edge is not None:
                # LongRoPE: a sequence up to the pretraining length runs on the short
                # factors, a longer one on the long factors throughout (the model runner
                # adds ``edge`` to its positions; the scheduler recomputes a sequence that
                # outgrows the length), as transformers does: the tables hold the short
                # factors' first ``edge`` positions, then the long factors' every position.
                long_cos, long_sin = self._tables(positions, *init(
                    hf_config, torch.device("cpu"), seq_len=edge + 1))
                cos, sin = torch.cat([cos[:edge], long_cos]), torch.cat([sin[:edge], long_sin])
        assert cos.shape[1] == self.rotary_dim
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        return emb.cos() * scaling, emb.sin() * scaling

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim].
        The compiled kernel rotates q and k in place and returns them."""
        if self.ops is not None:
            self.ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        dim = self.rotary_dim
        if dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q, k = (torch.cat((x[..., :dim] * cos + _rotate_half(x[..., :dim]) * sin, x[..., dim:]),
                          dim=-1) for x in (q, k))
        return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
