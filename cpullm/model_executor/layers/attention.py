"""Attention over the paged KV cache.

The tokens of one step arrive flat: first the decode tokens (one query per request), then
the prompt chunks (several queries per request). Both groups read their keys and values
from the paged cache after this step's K/V have been written to it:

    slot of position p of a request = block_table[p // block_size] * block_size
                                      + p % block_size

    key_cache [num_blocks, block_size, num_kv_heads, head_dim]
    block_table [3, 7]  ->  positions 0..127 live in block 3, 128..255 in block 7

Decode tokens go through a C++ kernel that reads the blocks in place. In bfloat16 on a
CPU without AMX, prompt chunks do too: one fused kernel computes their causal attention
from the cache, skipping the keys past each query (on a quantized cache, wherever it is
compiled: each item dequantizes the rows it reads into a buffer of its thread's).
Elsewhere they gather their requests' blocks into a padded [num_seqs, max_len] view
(dequantized from a quantized cache); in bfloat16 with the compiled kernels, two
batched bfloat16 matmuls (on AMX tiles where the CPU has them) around a C++ causal softmax
attend over it (torch's SDPA runs its CPU flash kernel in float32, several times slower at
these sizes), otherwise one masked scaled-dot-product attention does. There is no Python
loop over requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.logger import init_logger
from cpullm.model_executor.layers.ops import Kernel, KernelTable

logger = init_logger(__name__)

# Largest score matrix (elements) the bfloat16 prompt path builds at once; larger chunks
# take SDPA, which tiles.
_MAX_SCORES = 1 << 26


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout, built once by the model runner and shared by all layers."""

    # Per KV cache group (config.KVCacheGroups; a layer reads its group's), tables of one
    # width in every group:
    slot_mapping: list[torch.Tensor]  # [num_tokens] cache slot of every new token
    decode_block_tables: list[torch.Tensor]  # [num_decodes, max_blocks]
    prefill_block_tables: list[torch.Tensor]  # [num_prefills, max_blocks]
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-query requests
    decode_seq_lens: torch.Tensor  # [num_decodes] context length including the new token
    sliding_window: int  # 0: attend to the whole context
    prefill_query_index: torch.Tensor  # [num_prefill_tokens] index into [num_prefills * max_q]
    prefill_max_query_len: int
    prefill_starts: torch.Tensor  # [num_prefills] position of each chunk's first token
    prefill_query_lens: torch.Tensor  # [num_prefills] tokens in each chunk
    prefill_fresh: bool  # every chunk starts its request: nothing earlier is cached
    block_size: int
    # The boolean masks of the plain torch paths, built on first use (the compiled kernels
    # take lengths instead) and then shared by all layers with that window.
    _decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, window: int) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size]: the key positions each decode
        token sees (``window``: the last so many, or all with 0)."""
        if window not in self._decode_masks:
            key_pos = torch.arange(self.decode_block_tables[0].shape[1] * self.block_size)[None]
            lens = self.decode_seq_lens[:, None]
            mask = key_pos < lens
            if window:
                mask &= key_pos >= lens - window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]

    def prefill_mask(self, window: int) -> torch.Tensor:
        """[num_prefills, 1, max_q, max_blocks * block_size]: causal, within the window."""
        if window not in self._prefill_masks:
            key_pos = torch.arange(self.prefill_block_tables[0].shape[1] * self.block_size)
            query_pos = (self.prefill_starts[:, None]
                         + torch.arange(self.prefill_max_query_len)[None, :])[:, :, None]
            mask = key_pos <= query_pos
            if window:
                mask &= key_pos > query_pos - window
            self._prefill_masks[window] = mask[:, None]
        return self._prefill_masks[window]


def decode_kernel(ops: KernelTable) -> Kernel:
    """The decode attention kernel for this CPU: with AMX tiles, the one whose bfloat16 scores
    run on them (16 keys against a KV head's query group per tile instruction, no reduction
    across lanes): on 2 cores of a Xeon with AMX 7-16% less time than the BF16 dot products
    for 16-128 sequences of 192-1024 tokens (SmolLM2's and the 1B model's heads), the
    offline SmolLM2 run 2-3.5% faster. Else the AVX-512 BF16 one. Each takes every dtype and
    shape: what its bfloat16 path does not cover goes to the generic loop."""
    amx = ops.decode_attention_amx is not None
    path = ("the bfloat16 scores on AMX tiles" if amx else
            "the bfloat16 scores as AVX-512 BF16 dot products where the build has them")
    if path not in _logged_paths:
        _logged_paths.add(path)
        logger.debug("decode attention: %s", path)
    return ops.decode_attention_amx if amx else ops.decode_attention


def prefill_kernel(ops: KernelTable) -> Kernel | None:
    """The fused prompt attention kernel where it is the faster path: AVX-512 BF16 without
    AMX (2 Zen 4 cores, against the batched matmuls around prefill_softmax_bf16: 32 prompts
    of 128 tokens of SmolLM2's heads 5.0 -> 2.55 ms a layer, 8 of 512 of a 1B Llama's 102
    -> 31 ms). Where the CPU has AMX the batched matmuls run on its tiles; they stay there
    until the fused kernel is measured against them."""
    if ops.prefill_attention_bf16 is None or ops.amx:
        return None
    return ops.prefill_attention_bf16


_logged_paths: set[str] = set()

# --calculate-kv-scales: the first prompt's largest |k| becomes 200 (|v|: 100) of e4m3's
# 448, vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT, room for later tokens' larger ones
_K_SCALE_RANGE, _V_SCALE_RANGE = 200.0, 100.0


@dataclass(slots=True)
class KVCacheQuant:
    """How one layer's KV cache is quantized (--kv-cache-dtype; the model runner sets it):
    int8 rows with a float16 scale per token and KV head, or fp8 values with one K and one
    V scale for the layer (attention/kv_quant.cpp has the formats)."""

    dtype: torch.dtype  # torch.int8, torch.float8_e4m3fn or torch.float8_e5m2
    # int8: [2, num_blocks, block_size, kv_heads] float16, K's and V's scale per row
    scales: torch.Tensor | None = None
    k_scale: float = 1.0  # fp8: x = value * k_scale
    v_scale: float = 1.0
    calculate: bool = False  # fp8: set the scales from the first prompt's keys and values

    @property
    def rows(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """int8's K and V row scales as the kernels take them (any contiguous shape with
        one scale per row); fp8: (None, None)."""
        return (None, None) if self.scales is None else (self.scales[0], self.scales[1])

    def take_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """--calculate-kv-scales: the layer's scales from these keys and values, once."""
        self.k_scale = max(k.abs().max().item() / _K_SCALE_RANGE, 1e-6)
        self.v_scale = max(v.abs().max().item() / _V_SCALE_RANGE, 1e-6)
        self.calculate = False

    def store(self, cache: torch.Tensor, which: int, x: torch.Tensor,
              slots: torch.Tensor) -> None:
        """The plain torch store: rows ``x`` [tokens, kv_heads, head_dim] quantized into
        ``cache`` (K: which 0, V: 1) at ``slots``, as cache_kv_quant stores them."""
        x = x.float()
        if self.scales is not None:
            scale = (x.abs().amax(-1) / 127).half()
            inv = torch.where(scale > 0, scale.float().reciprocal(), 0.0)
            data = torch.round(x * inv[..., None]).clamp_(-127, 127).to(torch.int8)
            self.scales[which].view(-1, x.shape[1]).index_copy_(0, slots, scale)
        else:
            top = torch.finfo(self.dtype).max
            data = (x / (self.k_scale if which == 0 else self.v_scale)).clamp_(-top, top)
            data = data.to(self.dtype)
        cache.view(-1, *x.shape[1:]).view(torch.uint8).index_copy_(
            0, slots, data.view(torch.uint8))

    def gather(self, cache: torch.Tensor, which: int, tables: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        """The rows of the blocks in ``tables`` [n, blocks], dequantized:
        [n, blocks * block_size, kv_heads, head_dim] in ``dtype``."""
        rows = cache[tables].float().flatten(1, 2)
        if self.scales is not None:
            rows *= self.scales[which][tables].flatten(1, 2).float()[..., None]
        else:
            rows *= self.k_scale if which == 0 else self.v_scale
        return rows.to(dtype)


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 ops: KernelTable | None = None, window: int | None = None,
                 softcap: float = 0.0) -> None:
        """``window``: this layer's sliding window (0: none), for models whose layers differ
        (Gemma 2 and 3); None: the model's, from the step's metadata. ``softcap`` > 0: each
        scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
        super().__init__()
        self.window = window
        self.softcap = softcap
        self.ops = ops  # compiled kernels, or None for plain torch ops
        self.prefill_softmax = ops.prefill_softmax_bf16 if ops is not None else None
        self.decode_attention = decode_kernel(ops) if ops is not None else None
        # The fused prompt kernel takes heads of a multiple of 32 up to 256, up to 16 query
        # heads per KV head, no soft-cap (sinks come per call).
        fused_shape = (not softcap and head_dim % 32 == 0 and head_dim <= 256
                       and num_heads // num_kv_heads <= 16)
        self.prefill_attention = (
            prefill_kernel(ops) if ops is not None and fused_shape else None)
        # On a quantized cache the fused kernel runs on every CPU with AVX-512 BF16 (AMX
        # included): the other path gathers and dequantizes the context, and builds scores
        # too large for its bfloat16 matmuls past a few thousand tokens (SDPA then).
        self.prefill_attention_quant = (
            ops.prefill_attention_quant if ops is not None and fused_shape else None)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_group = 0  # whose block tables this layer reads (the model runner sets it)
        self.kv_quant: KVCacheQuant | None = None  # a quantized cache's (the runner sets it)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. ``sinks``: [num_heads]
        float32 logits of an attention sink per head (gpt-oss): each is one more term of its
        head's softmax denominator, attached to no value."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        window = meta.sliding_window if self.window is None else self.window
        group = self.kv_group
        prefill_tables = meta.prefill_block_tables[group]
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        slots = meta.slot_mapping[group]
        quant = self.kv_quant
        if quant is not None:
            self._store_quantized(quant, key_cache, value_cache, k, v, slots,
                                  meta.num_decode_tokens < q.shape[0])
        elif (self.ops is not None and k.dtype == v.dtype == key_cache.dtype
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and slots.dtype == torch.long and slots.is_contiguous()
                and k.stride(-1) == v.stride(-1) == 1
                and k.stride(-2) == v.stride(-2) == self.head_dim):
            self.ops.cache_kv(key_cache.view(flat_shape), value_cache.view(flat_shape), k, v,
                              slots)
        else:
            key_cache.view(flat_shape).index_copy_(0, slots, k)
            value_cache.view(flat_shape).index_copy_(0, slots, v)

        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd and quant is not None and self.ops is not None:
            # reads the one-byte rows in place, as the kernel below reads bfloat16 ones
            self.ops.decode_attention_quant(
                out[:nd], q[:nd], key_cache, value_cache, *quant.rows, quant.k_scale,
                quant.v_scale, meta.decode_block_tables[group], meta.decode_seq_lens,
                self.scale, window, self.softcap, sinks)
        elif nd and self.decode_attention is not None and quant is None:
            # Reads each sequence's blocks in place: no gather, no padding.
            self.decode_attention(out[:nd], q[:nd], key_cache, value_cache,
                                  meta.decode_block_tables[group], meta.decode_seq_lens,
                                  self.scale, window, self.softcap, sinks)
        elif nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache, meta, window, sinks)
        if (nd < q.shape[0] and quant is not None and self.prefill_attention_quant is not None
                and sinks is None and q.dtype == torch.bfloat16):
            self.prefill_attention_quant(out[nd:], q[nd:], key_cache, value_cache, *quant.rows,
                                         quant.k_scale, quant.v_scale, prefill_tables,
                                         meta.prefill_starts, meta.prefill_query_lens,
                                         self.scale, window)
        elif (nd < q.shape[0] and self.prefill_attention is not None and sinks is None
                and q.dtype == key_cache.dtype == value_cache.dtype == torch.bfloat16
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            self.prefill_attention(out[nd:], q[nd:], key_cache, value_cache, prefill_tables,
                                   meta.prefill_starts, meta.prefill_query_lens, self.scale,
                                   window)
        elif nd < q.shape[0]:
            num_prefills = prefill_tables.shape[0]
            max_q = meta.prefill_max_query_len
            # Chunks shorter than the longest are padded to it; equal chunks need no copy.
            dense = q.shape[0] - nd == num_prefills * max_q
            if dense:
                padded = q[nd:]
            else:
                padded = q.new_zeros(num_prefills * max_q, self.num_heads, self.head_dim)
                padded[meta.prefill_query_index] = q[nd:]
            max_len = prefill_tables.shape[1] * key_cache.shape[1]
            if (self.prefill_softmax is not None and q.dtype == torch.bfloat16
                    and num_prefills * self.num_heads * max_q * max_len <= _MAX_SCORES):
                # Whole fresh prompts of one length: their keys and values are this step's.
                fresh = (k[nd:], v[nd:]) if dense and meta.prefill_fresh else None
                result = self._attend_bf16(padded, key_cache, value_cache, meta, fresh, window,
                                           sinks)
            else:
                # [num_prefills, num_heads, max_q, head_dim]
                query = padded.view(num_prefills, max_q, self.num_heads,
                                    self.head_dim).transpose(1, 2)
                result = self._attend(query, key_cache, value_cache, prefill_tables,
                                      meta.prefill_mask(window), sinks).transpose(1, 2)
            if dense:  # one copy, straight from the permuted view
                out[nd:].view(result.shape).copy_(result)
            else:
                out[nd:] = result.reshape(-1, self.num_heads, self.head_dim)[
                    meta.prefill_query_index]
        return out

    def _attend_bf16(self, padded: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, meta: AttentionMetadata,
                     fresh: tuple[torch.Tensor, torch.Tensor] | None, window: int,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        """padded: [num_prefills * max_q, num_heads, head_dim] queries ->
        [num_prefills, max_q, num_heads, head_dim]. The query heads that share a KV head
        are stacked into one matrix, so each (request, KV head) is one matmul. ``fresh``:
        this step's keys and values, [num_prefills * max_q, kv_heads, head_dim], when they
        are all there is to attend to (no gather from the cache then)."""
        tables = meta.prefill_block_tables[self.kv_group]
        num_prefills, max_q = tables.shape[0], meta.prefill_max_query_len
        kv_heads, dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        batch = num_prefills * kv_heads
        # [num_prefills, max_len, kv_heads, dim] -> keys transposed [batch, dim, max_len]
        if fresh is not None:
            keys = fresh[0].view(num_prefills, max_q, kv_heads, dim)
            values = fresh[1].view(num_prefills, max_q, kv_heads, dim)
        else:
            keys = self._gather(key_cache, 0, tables, padded.dtype)
            values = self._gather(value_cache, 1, tables, padded.dtype)
        keys_t = keys.permute(0, 2, 3, 1).reshape(batch, dim, -1)
        values = values.transpose(1, 2).reshape(batch, -1, dim)
        # [num_prefills, max_q, kv_heads, group, dim] -> [batch, group * max_q, dim]
        query = padded.view(num_prefills, max_q, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        scores = torch.bmm(query.reshape(batch, group * max_q, dim), keys_t)
        self.prefill_softmax(scores, meta.prefill_starts, meta.prefill_query_lens, kv_heads,
                             max_q, self.scale, window, self.softcap, sinks)
        out = torch.bmm(scores, values)  # [batch, group * max_q, dim]
        return out.view(num_prefills, kv_heads, group, max_q, dim).permute(0, 3, 1, 2, 4)

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, window: int,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query per request: two batched matmuls per KV head group. For a single query
        row this is several times faster than the flash kernel of SDPA on CPU."""
        num_seqs = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        # [num_seqs, max_len, num_kv_heads, head_dim]
        tables = meta.decode_block_tables[self.kv_group]
        keys = self._gather(key_cache, 0, tables, q.dtype)
        values = self._gather(value_cache, 1, tables, q.dtype)
        query = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)
        scores = torch.einsum("skgd,stkd->skgt", query, keys)  # [seqs, kv_heads, group, len]
        scores = self._soft_cap(scores.float() * self.scale).masked_fill_(
            ~meta.decode_mask(window), float("-inf"))
        probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(
            1, self.num_kv_heads, group, 1)).to(q.dtype)
        out = torch.einsum("skgt,stkd->skgd", probs, values)
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, mask: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        # [num_seqs, max_len, kv_heads, d], from the blocks of each sequence
        keys = self._gather(key_cache, 0, block_tables, query.dtype)
        values = self._gather(value_cache, 1, block_tables, query.dtype)
        if self.softcap or sinks is not None:
            # SDPA has neither soft-caps nor sinks: the scores in full, as transformers does
            group = self.num_heads // self.num_kv_heads
            keys_t = keys.permute(0, 2, 3, 1).repeat_interleave(group, dim=1)  # [s, h, d, len]
            scores = self._soft_cap(torch.matmul(query, keys_t) * self.scale)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(-1, dtype=torch.float32) if sinks is None else \
                _softmax_with_sinks(scores.float(), sinks.view(1, -1, 1, 1))
            values_h = values.transpose(1, 2).repeat_interleave(group, dim=1)
            return torch.matmul(probs.to(query.dtype), values_h)
        return F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)

    def _gather(self, cache: torch.Tensor, which: int, tables: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """[n, max_len, kv_heads, head_dim]: the rows of the blocks in ``tables``."""
        if self.kv_quant is not None:
            return self.kv_quant.gather(cache, which, tables, dtype)
        return cache[tables].view(tables.shape[0], -1, self.num_kv_heads, self.head_dim)

    def _store_quantized(self, quant: KVCacheQuant, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slots: torch.Tensor, prompt: bool) -> None:
        if quant.calculate and prompt:  # (not from a startup probe's decode rows)
            quant.take_scales(k, v)
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        if (self.ops is not None and slots.dtype == torch.long and slots.is_contiguous()
                and k.stride(-1) == v.stride(-1) == 1
                and k.stride(-2) == v.stride(-2) == self.head_dim):
            self.ops.cache_kv_quant(key_cache.view(flat_shape), value_cache.view(flat_shape),
                                    *quant.rows, k, v, slots, quant.k_scale, quant.v_scale)
        else:
            quant.store(key_cache, 0, k, slots)
            quant.store(value_cache, 1, v, slots)

    def _soft_cap(self, scores: torch.Tensor) -> torch.Tensor:
        if not self.softcap:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of float32 ``scores``; with ``sinks`` (broadcast to
    scores[..., :1]) each row's denominator has one more term, exp(sink), as gpt-oss
    trains it: a query may attend to nothing."""
    if sinks is None:
        return scores.softmax(dim=-1)
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1).float()], dim=-1)
    return combined.softmax(dim=-1)[..., :-1]
