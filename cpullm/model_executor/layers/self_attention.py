"""The attention block of the Llama family and of the families built on its layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cpullm import distributed
from cpullm.model_executor.layers.attention import AttentionMetadata, PagedAttention
from cpullm.model_executor.layers.linear import QKVLinear, RowParallelLinear
from cpullm.model_executor.layers.norm import RMSNorm
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    """The Llama family's attention block (Gemma's, GLM's and gpt-oss' too): the merged
    QKV projection, optional q/k norms, the rotary embedding, paged attention (with a
    soft-cap, a sliding window or attention sinks where the family has them) and the
    output projection."""

    decode_view = True  # where step_fn has no kernels: forward only calls its parts

    def __init__(self, config: Any, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, dtype: torch.dtype, ops: KernelTable | None,
                 quant_config: QuantizationConfig | None, scale: float | None = None,
                 window: int | None = None, norm: type[RMSNorm] = RMSNorm,
                 softcap: float = 0.0, sinks: bool = False) -> None:
        """``scale``: of the attention scores (default: Granite's multiplier, else 1 / sqrt
        of the head size); ``window``: this layer's own sliding window (0: none; default:
        the model's); ``norm``: the q/k norm's class; ``softcap``: the scores' soft-cap;
        ``sinks``: a learned attention-sink logit per head (gpt-oss's ``sinks``)."""
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, num_heads,
                                  getattr(config, "num_key_value_heads", None) or num_heads,
                                  bias=qkv_bias, dtype=dtype, quant_config=quant_config)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias, dtype=dtype, quant_config=quant_config)
        if qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps, dtype, ops)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps, dtype, ops)
        self.qk_norm = qk_norm
        self.rotary = rotary
        # a reorder of each head's dims, applied to q and k before the rotary (GLM's
        # interleaved rotary where the checkpoint's rows cannot be reordered at load)
        self.qk_order: torch.Tensor | None = None
        if scale is None:
            scale = getattr(config, "attention_multiplier", None) or self.head_dim ** -0.5
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads,
                                   scale=scale, ops=ops, window=window, softcap=softcap)
        self.sinks: nn.Parameter | None = None
        if sinks:  # float32 whatever the dtype, as the softmax they join; this rank's heads
            self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
            first = distributed.tp_rank() * self.num_heads

            def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
                if loaded.shape != (num_heads,):
                    raise ValueError(f"checkpoint {tuple(loaded.shape)}, model ({num_heads},)")
                param.data.copy_(loaded[first:first + self.num_heads])

            self.sinks.weight_loader = load_sinks  # type: ignore[attr-defined]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_order is not None:
            q, k = q[..., self.qk_order], k[..., self.qk_order]
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta, self.sinks)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.view(-1, self.q_size))

    def step_fn(self, dtype: torch.dtype) -> tuple[Callable[..., torch.Tensor], int] | None:
        """forward in a decode step (layers/decode_step.py: every token a sequence's next,
        the tensors as the layer passes them), and the most tokens it holds for: the
        projections', the rotary's and the attention's kernels in forward's order with
        forward's arguments, in one function (the q/k norms and the reorder of q and k as
        forward calls them). None where forward does more, or has no compiled kernels."""
        attn = self.attn
        if (dtype != torch.bfloat16 or type(self).forward is not LlamaAttention.forward
                or type(attn).forward is not PagedAttention.forward
                or type(self.rotary).forward is not RotaryEmbedding.forward
                or self.rotary.ops is None or attn.decode_attention is None or attn.ops is None):
            return None
        products = [self.qkv_proj.step_fn(dtype), self.o_proj.step_fn(dtype)]
        if any(product is None for product in products):
            return None
        (qkv, _), (o_proj, _) = products
        q_size, sizes = self.q_size, [self.q_size, self.kv_size, self.kv_size]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        flat = (-1, kv_heads, head_dim)
        rotate, cos, sin = self.rotary.ops.rotary_embedding, self.rotary.cos, self.rotary.sin
        cache_kv, decode = attn.ops.cache_kv, attn.decode_attention
        scale, softcap, window, sinks = attn.scale, attn.softcap, attn.window, self.sinks
        qk_norm, order = self.qk_norm, self.qk_order
        # a quantized cache (--kv-cache-dtype): its store and decode kernels, int8's row
        # scales (fp8's layer scales are read at each call: the first prompt may set them)
        quant = attn.kv_quant
        store_quant, decode_quant = attn.ops.cache_kv_quant, attn.ops.decode_attention_quant
        rows = (None, None) if quant is None else quant.rows

        def attend(positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
            q, k, v = qkv(hidden).split(sizes, dim=-1)
            q, k = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)
            if qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if order is not None:
                q, k = q[..., order], k[..., order]
            rotate(positions, q, k, cos, sin)
            key_cache, value_cache = kv_cache[0], kv_cache[1]
            group = attn.kv_group
            tables, lens = meta.decode_block_tables[group], meta.decode_seq_lens
            layer_window = meta.sliding_window if window is None else window
            out = torch.empty_like(q)
            if quant is None:
                cache_kv(key_cache.view(flat), value_cache.view(flat), k,
                         v.view(-1, kv_heads, head_dim), meta.slot_mapping[group])
                decode(out, q, key_cache, value_cache, tables, lens, scale, layer_window,
                       softcap, sinks)
            else:
                store_quant(key_cache.view(flat), value_cache.view(flat), *rows, k,
                            v.view(-1, kv_heads, head_dim), meta.slot_mapping[group],
                            quant.k_scale, quant.v_scale)
                decode_quant(out, q, key_cache, value_cache, *rows, quant.k_scale,
                             quant.v_scale, tables, lens, scale, layer_window, softcap, sinks)
            return o_proj(out.view(-1, q_size))

        return attend, min(limit for _, limit in products)
