"""The compiled CPU kernels against the torch ops they replace."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import amx_or_skip

from cpullm.model_executor.layers.ops import load_ops
from cpullm.model_executor.layers.packed_gemm import GemmPath, panels_of
from cpullm.platform import cpu_info

ops = load_ops()
needs_bf16 = pytest.mark.skipif(not cpu_info().supports_fast_bf16,
                                reason="the bfloat16 kernels need AVX512-BF16")


def test_kernels_build():
    assert ops is not None, "the C++ kernels did not build (is a C++ compiler installed?)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,window,softcap,sinks", [
    (6, 2, 64, 0, 0.0, False),     # SmolLM2-like: 3 query heads per KV head
    (9, 3, 64, 0, 0.0, False),     # SmolLM2's shape: on AMX, a sequence's 3 KV heads at once
    (32, 8, 64, 0, 0.0, False),    # a 1B Llama's: on AMX, 2 KV heads at a time
    (9, 9, 32, 0, 0.0, False),     # no grouping, one 32-wide chunk
    (32, 4, 128, 0, 0.0, False),   # 8 query heads per KV head, 128-wide heads
    (10, 2, 96, 0, 0.0, False),    # 96-wide heads: values in 32-wide passes
    (6, 2, 64, 50, 0.0, False),    # sliding window
    (12, 1, 64, 0, 0.0, False),    # more query heads per KV head than the bfloat16 kernel takes
    (8, 4, 64, 50, 1.5, False),    # Gemma 2: soft-capped scores, a window
    (12, 1, 64, 0, 1.5, False),    # soft-capped, in the generic kernel
    (8, 2, 64, 50, 0.0, True),     # gpt-oss: a sink logit per head, a window
    (12, 1, 64, 0, 0.0, True),     # sinks in the generic kernel
])
@pytest.mark.parametrize("kernel", ["decode_attention", "decode_attention_amx"])
def test_decode_attention_matches_sdpa(kernel, dtype, heads, kv_heads, dim, window, softcap,
                                       sinks):
    if kernel == "decode_attention_amx":
        amx_or_skip(ops.decode_attention_amx is not None, "amx_bf16", "the AMX decode attention")
    torch.manual_seed(0)
    seqs, block, blocks = 5, 32, 40
    key_cache = torch.randn(blocks, block, kv_heads, dim, dtype=dtype)
    value_cache = torch.randn(blocks, block, kv_heads, dim, dtype=dtype)
    tables = torch.randperm(blocks)[:seqs * 4].view(seqs, 4).contiguous()
    lens = torch.tensor([1, 31, 32, 77, 128])
    # q as the model passes it: a view into a wider fused QKV row
    q = torch.randn(seqs, (heads + 2) * dim, dtype=dtype)[:, :heads * dim].view(seqs, heads, dim)
    out = torch.empty(seqs, heads, dim, dtype=dtype)
    sink = torch.randn(heads) * 2 if sinks else None
    getattr(ops, kernel)(out, q, key_cache, value_cache, tables, lens, dim ** -0.5, window,
                         softcap, sink)
    # The reference in float64: a float32 matmul's rounding depends on the kernel that
    # oneDNN picks for the buffers' alignment (3e-5 apart between runs on an AMX Xeon).
    keys = key_cache[tables].view(seqs, -1, kv_heads, dim).transpose(1, 2).double()
    values = value_cache[tables].view(seqs, -1, kv_heads, dim).transpose(1, 2).double()
    positions = torch.arange(4 * block)[None]
    mask = positions < lens[:, None]
    if window:
        mask &= positions >= lens[:, None] - window
    if softcap or sinks:  # SDPA has neither soft-caps nor sinks: the scores in full
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = q.double().unsqueeze(2) @ keys.transpose(2, 3) * dim ** -0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        if sinks:  # one more logit per head in the denominator
            column = sink.double().view(1, heads, 1, 1).expand(seqs, heads, 1, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        expected = (probs @ values).squeeze(2)
    else:
        expected = F.scaled_dot_product_attention(q.unsqueeze(2).double(), keys, values,
                                                  attn_mask=mask[:, None, None, :],
                                                  enable_gqa=True).squeeze(2)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), expected, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_fused_draw_matches_torch_draw(vocab, dtype):
    """The fused draw equals the torch one; on bfloat16 logits (as the model computes
    them) it draws what it draws from their float32 copy."""
    from cpullm.sampling_params import SamplingParams
    from cpullm.worker.sampler import _draw

    generator = torch.Generator().manual_seed(0)
    rows = 64
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    logits[::3, : vocab // 2] = -float("inf")  # masked tokens: never drawn
    temperature = torch.rand(rows, generator=generator) + 0.3
    uniform = torch.rand(rows, generator=generator)
    uniform[0], uniform[1] = 0.0, 1.0 - 2 ** -24  # both ends of [0, 1)
    got = ops.sample_from_logits(logits, temperature, uniform)
    params = [SamplingParams(temperature=float(t)) for t in temperature]
    expected = _draw(logits, temperature, uniform, params)
    # Next to 1 the two summation orders may round to different last tokens.
    assert torch.equal(got[2:], expected[2:]) and got[0] == expected[0]
    assert bool((logits.gather(1, got[:, None]) > -float("inf")).all())
    if dtype != torch.float32:
        assert torch.equal(got, ops.sample_from_logits(logits.float(), temperature, uniform))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,partial,tokens", [(64, 1.0, 4), (80, 0.4, 3), (72, 1.0, 130)])
def test_rotary_matches_torch(dtype, head_dim, partial, tokens):
    """The kernel rotates q and k (strided views of a fused QKV row, as in the model) bit
    for bit as the unfused torch ops do, whole heads and a first share of each (32 of 80),
    where half the rotated width is a multiple of 16 and where it is not (36)."""
    from types import SimpleNamespace

    from cpullm.model_executor.layers.rotary import RotaryEmbedding

    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": partial})
    eager = RotaryEmbedding(config, head_dim, 256)
    kernel = RotaryEmbedding(config, head_dim, 256, ops)
    torch.manual_seed(head_dim + tokens)
    positions = torch.randint(0, 256, (tokens,))
    positions[0] = 255
    qkv = torch.randn(tokens, (6 + 2 * 2) * head_dim).to(dtype)
    q = qkv[:, :6 * head_dim].view(tokens, 6, head_dim)
    k = qkv[:, 6 * head_dim:8 * head_dim].view(tokens, 2, head_dim)
    expected_q, expected_k = eager(positions, q.clone(), k.clone())
    got_q, got_k = kernel(positions, q, k)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_bf16_norm_and_silu_are_bit_identical(rows):
    from cpullm.model_executor.layers.activation import SiluAndMul
    from cpullm.model_executor.layers.norm import RMSNorm

    torch.manual_seed(rows)
    norm_eager = RMSNorm(576, 1e-5, torch.bfloat16)
    norm_kernel = RMSNorm(576, 1e-5, torch.bfloat16, ops)
    norm_kernel.weight.data = norm_eager.weight.data = torch.randn(576, dtype=torch.bfloat16)
    x, residual = torch.randn(rows, 576, dtype=torch.bfloat16), torch.randn(
        rows, 576, dtype=torch.bfloat16)
    expected, expected_residual = norm_eager(x.clone(), residual.clone())
    got, got_residual = norm_kernel(x.clone(), residual.clone())
    assert torch.equal(got, expected) and torch.equal(got_residual, expected_residual)
    assert torch.equal(norm_kernel(x), norm_eager(x))
    gate_up = torch.randn(rows, 3072, dtype=torch.bfloat16) * 4
    assert torch.equal(SiluAndMul(ops)(gate_up), SiluAndMul()(gate_up))


@pytest.fixture
def amx_gemm():
    """Skips where the CPU, the library or the OS leaves out the AMX GEMM; fails where all
    of them have it and the table does not."""
    amx_or_skip(ops is not None and ops.gemm_bf16_amx is not None, "amx_bf16", "the AMX GEMM")


def _expected_path(amx: bool, output_size: int, input_size: int):
    """The path PackedGemm picks: AMX tiles where the CPU (or the test) says AMX and the
    tiles run here, for input sizes a multiple of 32; the older split on AMX CPUs else."""
    if output_size % 32:
        return GemmPath.ONEDNN
    if not amx:
        return GemmPath.OWN
    if input_size % 32 == 0 and ops.gemm_bf16_amx is not None:
        return GemmPath.AMX
    return GemmPath.OWN_THEN_ONEDNN


@needs_bf16
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 130, 600])
@pytest.mark.parametrize("output_size,input_size", [(960, 576), (968, 576), (960, 560)])
def test_packed_linear_matches_float32(rows, output_size, input_size, amx, monkeypatch):
    """cpullm's bf16 GEMM (output sizes a multiple of 32; row tiles of 12, blocks of 264;
    on AMX CPUs on AMX tiles, or with an input size off the tile depth only up to 8 rows)
    and oneDNN's on a prepacked weight (the rest), from rows of a wider tensor too."""
    from cpullm.model_executor.layers import packed_gemm
    from cpullm.model_executor.layers.linear import ReplicatedLinear

    monkeypatch.setattr(packed_gemm, "_has_amx", lambda: amx)
    table = ops if amx else ops.without_amx()  # (a CPU without AMX has no AMX kernels)
    torch.manual_seed(rows)
    layer = ReplicatedLinear(input_size, output_size, bias=True, dtype=torch.bfloat16)
    weight = torch.randn(output_size, input_size, dtype=torch.bfloat16) / 24
    layer.weight.data = weight
    layer.bias.data = torch.randn(output_size, dtype=torch.bfloat16)
    wide = torch.randn(rows, 640, dtype=torch.bfloat16)
    expected = F.linear(wide[:, :input_size].float(), weight.float(), layer.bias.float())
    layer.process_weights_after_loading(table)
    assert layer.gemm is not None and layer.weight.numel() == 0  # the packed copy only
    assert (layer.gemm.kernel is not None) == (output_size % 32 == 0)
    path = _expected_path(amx, output_size, input_size)
    assert layer.gemm.path == path and layer.gemm.own_rows == path.own_rows
    assert (layer.gemm.onednn is None) == (path in (GemmPath.OWN, GemmPath.AMX))
    for x in (wide[:, :input_size], wide[:, :input_size].contiguous().view(1, rows, input_size)):
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (*x.shape[:-1], output_size)
        assert torch.allclose(got.float().view(rows, -1), expected, atol=0.05, rtol=0.02)
        # float32 out (an LM head's logits): the sums whose rounding ``got`` is
        logits = layer.gemm(x, torch.float32)
        assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), got)


@pytest.mark.parametrize("rows", [1, 16, 17, 47, 1000])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("input_size", [576, 2048, 4160])
def test_amx_gemm_matches_the_avx512_gemm(rows, silu_mul, input_size, amx_gemm):
    """The AMX GEMM on the AVX-512 GEMM's panels: row tails under a tile (zero-padded),
    several row blocks (1000 rows), K in slices (2048 and 4160: two whole slices and a
    short one), bias and silu(gate) * up in the same stores; both within bfloat16 rounding
    of float32, and close to each other."""
    torch.manual_seed(rows)
    n = 256
    weight = torch.randn(n, input_size, dtype=torch.bfloat16) / input_size ** 0.5
    bias = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(rows, input_size + 64, dtype=torch.bfloat16)[:, :input_size]
    if silu_mul:  # gate 0-15, up 0-15, gate 16-31, ...: the GEMM's interleaved order
        order = torch.arange(n).view(2, n // 32, 16).transpose(0, 1).reshape(n)
        packed_weight, packed_bias = weight[order], bias[order]
    else:
        packed_weight, packed_bias = weight, bias
    panels = panels_of(packed_weight)
    width = n // 2 if silu_mul else n
    got, avx = (torch.empty(rows, width, dtype=torch.bfloat16) for _ in range(2))
    ops.gemm_bf16_amx(got, x, panels, packed_bias, silu_mul)
    ops.gemm_bf16(avx, x, panels, packed_bias, silu_mul)
    expected = F.linear(x.float(), weight.float(), bias.float())
    if silu_mul:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    assert torch.allclose(got.float(), expected, atol=0.1, rtol=0.03)
    assert torch.allclose(got.float(), avx.float(), atol=0.1, rtol=0.03)
    if not silu_mul:  # float32 out (logits): the very sums each GEMM rounds otherwise
        for kernel, rounded in ((ops.gemm_bf16_amx, got), (ops.gemm_bf16, avx)):
            logits = torch.empty(rows, width)
            kernel(logits, x, panels, packed_bias, False)
            assert torch.equal(logits.bfloat16(), rounded)


def test_amx_gemm_refuses_an_input_size_off_the_tile_depth(amx_gemm):
    panels = torch.zeros(1, 280, 32, 2, dtype=torch.bfloat16)  # K = 560
    with pytest.raises(RuntimeError, match="multiple of 32|no AMX tiles"):
        ops.gemm_bf16_amx(torch.empty(2, 32, dtype=torch.bfloat16),
                          torch.zeros(2, 560, dtype=torch.bfloat16), panels, None, False)


@needs_bf16
@pytest.mark.parametrize("hidden", [64, 576, 2056])
def test_tied_table_reads_its_rows_from_the_head_panels(hidden):
    """A table tied to a packed LM head keeps one copy: the lookup reads the head's panels
    (every row, a K that is not a multiple of 32 pairs, ids in any order, repeated) and gives
    the table's rows bit for bit; the head's logits are unchanged; an id off the table is
    refused."""
    from cpullm.model_executor.layers.embedding import LMHead, VocabEmbedding

    torch.manual_seed(hidden)
    vocab = 320
    table = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    embedding = VocabEmbedding(vocab, hidden, torch.bfloat16)
    embedding.weight.data.copy_(table)
    head = LMHead(vocab, hidden, torch.bfloat16)
    head.tie(embedding)
    head.process_weights_after_loading(ops)
    assert embedding.weight.numel() == 0 and embedding.panels is head.gemm.panels
    ids = torch.cat([torch.arange(vocab), torch.tensor([5, 5, 319, 0])])[torch.randperm(vocab + 4)]
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding(ids.view(2, -1)), table[ids].view(2, -1, hidden))
    x = torch.randn(3, hidden, dtype=torch.bfloat16)
    logits = head.compute_logits(x)
    assert logits.dtype == torch.float32  # unrounded: bfloat16 would tie close tokens
    assert torch.allclose(logits, x.float() @ table.float().T, atol=0.05 * hidden ** 0.5,
                          rtol=0.02)
    assert torch.equal(logits.bfloat16(), head.gemm(x))
    with pytest.raises(RuntimeError, match="outside the table"):
        embedding(torch.tensor([vocab]))


@needs_bf16
@pytest.mark.parametrize("rows", [15, 16, 300])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemm_of_rows_4k_apart_equals_the_same_rows_elsewhere(rows, silu_mul):
    """Rows of x a multiple of 4 KiB apart (a hidden size of 2048; from 16 rows the GEMM
    runs them on a copy with the rows further apart): the same bits as the same rows
    lying elsewhere, contiguous or in a wider tensor, and the float32 product."""
    torch.manual_seed(rows)
    k, n = 2048, 64
    weight = torch.randn(n, k, dtype=torch.bfloat16) / 48
    panels = panels_of(weight)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    elsewhere = torch.empty(rows, k + 64, dtype=torch.bfloat16)[:, :k]
    wider = torch.empty(rows, 2 * k, dtype=torch.bfloat16)[:, :k]
    width = n // 2 if silu_mul else n
    outs = []
    for rows_of_x in (x, elsewhere, wider):
        rows_of_x.copy_(x)
        outs.append(torch.empty(rows, width, dtype=torch.bfloat16))
        ops.gemm_bf16(outs[-1], rows_of_x, panels, None, silu_mul)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[1])
    if not silu_mul:
        expected = F.linear(x.float(), weight.float())
        assert torch.allclose(outs[0].float(), expected, atol=0.05, rtol=0.02)


@needs_bf16
@pytest.mark.parametrize("silu_mul", [False, True])
def test_grouped_gemm_on_views_of_wider_rows(silu_mul):
    """gemm_bf16_grouped reads x and writes out where each is a view of wider rows (a
    mixture's gathered tokens, laid 64 bytes further apart than 4 KiB): the same bits as on
    contiguous rows, and out's columns past the view untouched."""
    torch.manual_seed(7)
    k, n, counts = 2048, 64, [20, 3, 33]
    weights = [torch.randn(n, k, dtype=torch.bfloat16) / 48 for _ in counts]
    panels = [panels_of(w) for w in weights]
    offsets = [0, *itertools.accumulate(counts)]
    x = torch.randn(offsets[-1], k, dtype=torch.bfloat16)
    width = n // 2 if silu_mul else n
    contiguous = torch.empty(offsets[-1], width, dtype=torch.bfloat16)
    ops.gemm_bf16_grouped(contiguous, x, panels, offsets, silu_mul)
    wide_x = torch.empty(offsets[-1], k + 32, dtype=torch.bfloat16)[:, :k]
    wide_x.copy_(x)
    wide_out = torch.full((offsets[-1], width + 32), 7.0, dtype=torch.bfloat16)
    ops.gemm_bf16_grouped(wide_out[:, :width], wide_x, panels, offsets, silu_mul)
    assert torch.equal(wide_out[:, :width], contiguous)
    assert bool((wide_out[:, width:] == 7.0).all())
    for weight_panels, start, end in zip(panels, offsets, offsets[1:], strict=False):
        alone = torch.empty(end - start, width, dtype=torch.bfloat16)
        ops.gemm_bf16(alone, x[start:end].contiguous(), weight_panels, None, silu_mul)
        assert torch.equal(contiguous[start:end], alone)


@needs_bf16
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", [1, 13, 300])
@pytest.mark.parametrize("intermediate", [1536, 1544])
def test_gate_up_silu_fused_matches_unfused(rows, intermediate, amx, monkeypatch):
    """silu(gate) * up in the GEMM's store (1536: interleaved panels; on AMX tiles with AMX)
    equals the merged GEMM followed by the SiLU-mul kernel bit for bit; 1544 (not a
    multiple of 16) runs oneDNN's GEMM, then the kernel."""
    from cpullm.model_executor.layers import packed_gemm
    from cpullm.model_executor.layers.activation import SiluAndMul
    from cpullm.model_executor.layers.linear import GateUpSiluLinear, MergedColumnLinear

    monkeypatch.setattr(packed_gemm, "_has_amx", lambda: amx)
    table = ops if amx else ops.without_amx()  # (a CPU without AMX has no AMX kernels)
    torch.manual_seed(rows)
    weight = torch.randn(2 * intermediate, 576, dtype=torch.bfloat16) / 24
    bias = torch.randn(2 * intermediate, dtype=torch.bfloat16)
    fused = GateUpSiluLinear(576, intermediate, bias=True, dtype=torch.bfloat16, ops=table)
    merged = MergedColumnLinear(576, [intermediate] * 2, bias=True, dtype=torch.bfloat16)
    for layer in (fused, merged):
        layer.weight.data, layer.bias.data = weight.clone(), bias.clone()
        layer.process_weights_after_loading(table)
    assert fused.gemm is not None and fused.gemm.silu_mul
    assert (fused.gemm.kernel is not None) == (intermediate % 16 == 0)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    got = fused(x)
    assert got.shape == (rows, intermediate)
    assert torch.equal(got, SiluAndMul(table)(merged(x)))
    gate, up = F.linear(x.float(), weight.float(), bias.float()).chunk(2, dim=-1)
    assert torch.allclose(got.float(), F.silu(gate) * up, atol=0.1, rtol=0.03)


@needs_bf16
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("shapes", [
    [(20, 1), (47, 1), (0, 33), (30, 9), (16, 70)],  # chunks of different lengths
    [(20, 1), (0, 40), (25, 40)],  # equal chunks: no padding
    [(20, 1), (0, 40), (0, 40)],  # equal fresh prompts: keys and values of this step
])
@pytest.mark.parametrize("fused,heads,kv_heads,dim", [
    (True, 6, 2, 64),    # the fused kernel: 5 positions of 3 heads per item
    (True, 12, 1, 128),  # one position of 12 heads per item, 128-wide heads
    (True, 8, 8, 32),    # no grouping: 16 positions per item
    (False, 6, 2, 64),   # the batched matmuls around prefill_softmax_bf16 (AMX CPUs)
])
def test_bf16_prompt_attention_matches_sdpa(window, shapes, fused, heads, kv_heads, dim):
    """Decode tokens and prompt chunks (fresh, and continuing a cached prefix) in one step:
    each compiled bfloat16 prompt path against SDPA over the same cache."""
    from types import SimpleNamespace

    from cpullm.model_executor.layers.attention import PagedAttention
    from cpullm.sampling_params import SamplingParams
    from cpullm.worker.model_runner import ModelRunner
    from cpullm.worker.request_state import RequestState

    torch.manual_seed(0)
    block, blocks = 16, 64
    # shapes: (tokens already in the cache, tokens computed this step) per request
    tables = torch.randperm(blocks).tolist()
    items, used = [], 0
    for done, new in shapes:
        count = -(-(done + new) // block)
        item = RequestState(str(len(items)), [1] * (done + new), SamplingParams())
        item.num_computed_tokens, item.num_tokens = done, new
        item.block_tables = [tables[used:used + count]]
        items.append(item)
        used += count
    runner = SimpleNamespace(block_size=block, sliding_window=window or None,
                             long_rope_offset=None)
    _, _, meta, _ = ModelRunner._prepare_inputs(runner, items)
    num_tokens = sum(new for _, new in shapes)
    kv_cache = torch.randn(2, blocks, block, kv_heads, dim).bfloat16()
    q = torch.randn(num_tokens, heads, dim).bfloat16()
    k = torch.randn(num_tokens, kv_heads, dim).bfloat16()
    v = torch.randn(num_tokens, kv_heads, dim).bfloat16()
    expected = PagedAttention(heads, dim, kv_heads, dim ** -0.5)(q, k, v, kv_cache.clone(), meta)
    attention = PagedAttention(heads, dim, kv_heads, dim ** -0.5, ops)
    attention.prefill_attention = ops.prefill_attention_bf16 if fused else None
    got = attention(q, k, v, kv_cache.clone(), meta)
    assert torch.allclose(got.float(), expected.float(), atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_kv_writes_what_index_copy_writes(dtype):
    """A step's keys and values, strided views into a fused QKV output, land in their
    cache slots as index_copy_ puts them; a slot outside the cache is refused."""
    torch.manual_seed(0)
    slots_total, kv_heads, dim, tokens = 64, 2, 16, 9
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim).to(dtype)
    k = qkv[:, 4 * dim:6 * dim].view(tokens, kv_heads, dim)
    v = qkv[:, 6 * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(slots_total)[:tokens]
    expected_k, expected_v = (torch.zeros(slots_total, kv_heads, dim, dtype=dtype)
                              for _ in range(2))
    expected_k.index_copy_(0, slots, k)
    expected_v.index_copy_(0, slots, v)
    got_k, got_v = torch.zeros_like(expected_k), torch.zeros_like(expected_v)
    ops.cache_kv(got_k, got_v, k, v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.cache_kv(got_k, got_v, k, v, torch.full((tokens,), slots_total))


def test_kernel_table_lists_the_build():
    """Every kernel the module binds is a field of the table, and this CPU's build has all
    of those its instruction sets allow."""
    import dataclasses

    from cpullm.model_executor.layers.ops import AMX_KERNELS, KernelTable

    assert ops is not None
    bound = {name for name in dir(ops.module) if not name.startswith("_")} - {"isa"}
    if not ops.amx:  # the library binds them; a CPU without AMX tiles runs none of them
        bound -= set(AMX_KERNELS)
    assert bound == set(ops.available) <= {f.name for f in dataclasses.fields(KernelTable)}
    if "avx512_bf16" in cpu_info().flags:
        assert ops.gemm_bf16 is not None and ops.rms_norm_bf16 is not None
        assert ops.isa == "avx512_bf16"


def test_build_is_keyed_on_the_cpu_and_the_install(monkeypatch, tmp_path):
    """Another CPU (other instruction sets), or another install of the same sources, gets
    a build of its own, not this one's."""
    import shutil

    from cpullm.model_executor.layers import kernel_build
    from cpullm.model_executor.layers import ops as ops_py
    from cpullm.platform.cpu import CpuInfo

    mine = ops_py.build_name()
    assert mine == ops_py.build_name() and mine.startswith("cpullm_ops_")
    shutil.copytree(kernel_build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(kernel_build, "CSRC", str(tmp_path / "csrc"))
    assert ops_py.build_name() != mine
    monkeypatch.undo()
    info = cpu_info()
    other = CpuInfo(info.vendor, info.model_name, info.flags - {"avx512_bf16", "amx_bf16"}
                    | {"avx2"})
    monkeypatch.setattr(ops_py, "cpu_info", lambda: other)
    assert ops_py.build_name() != mine


def test_prebuilt_level_follows_the_cpu_flags():
    from cpullm.model_executor.layers.ops import ISA_LEVELS, best_level

    avx2, avx512, avx512_bf16 = ISA_LEVELS
    assert best_level(set()) is None  # another ISA: the JIT build (or torch ops)
    assert best_level(set(avx2.needs)) is avx2
    assert best_level(set(avx512.needs) | {"sse4_2"}) is avx512
    assert best_level(set(avx512_bf16.needs) | {"amx_bf16"}) is avx512_bf16
    assert best_level(set(avx512_bf16.needs) - {"avx512_vnni"}) is avx2


def test_kernel_isa_can_be_lowered_by_name(monkeypatch):
    """CPULLM_KERNEL_ISA picks a lower level's library; a name that is not a level, or a
    level this CPU cannot run, is refused by name."""
    from cpullm.model_executor.layers import ops as ops_py
    from cpullm.platform.cpu import CpuInfo

    avx2, avx512, _ = ops_py.ISA_LEVELS
    monkeypatch.setattr(ops_py, "cpu_info", lambda: CpuInfo("x", "x", avx512.needs))
    assert ops_py.chosen_level() is avx512
    monkeypatch.setenv("CPULLM_KERNEL_ISA", "avx2")
    assert ops_py.chosen_level() is avx2
    monkeypatch.setenv("CPULLM_KERNEL_ISA", "sse2")
    with pytest.raises(ValueError, match="choose from avx2, avx512, avx512_bf16"):
        ops_py.chosen_level()
    monkeypatch.setenv("CPULLM_KERNEL_ISA", "avx512_bf16")
    with pytest.raises(ValueError, match="lacks avx512_bf16"):
        ops_py.chosen_level()


def test_prebuilt_libraries_run_here():
    """Every level's library that the install built and this CPU runs: it loads, its table
    has what its instruction sets allow, and its rotary kernel equals torch's."""
    import glob

    from cpullm.model_executor.layers.ops import (
        _PREBUILT,
        ISA_LEVELS,
        KernelTable,
        load_prebuilt,
    )
    from cpullm.model_executor.layers.rotary import RotaryEmbedding

    runnable = [level for level in ISA_LEVELS if level.needs <= cpu_info().flags]
    if not runnable:
        pytest.skip("none are prebuilt for CPUs without AVX2")
    assert glob.glob(os.path.join(_PREBUILT, "cpullm_ops_*.so")), \
        "the install built no kernels (pip install -v shows why)"
    loaded = {level.name: load_prebuilt(level) for level in runnable}
    if not any(loaded.values()):
        pytest.skip("the prebuilt kernels are of other sources (edited since the install; "
                    "python -m cpullm.model_executor.layers.ops rebuilds them)")
    from types import SimpleNamespace

    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(5)
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    expected = RotaryEmbedding(config, 64, 32)(positions, q.clone(), k.clone())
    for name, module in loaded.items():
        if module is None:
            continue
        table = KernelTable.of(module)
        assert table.isa == name and table.quant_gemm_tiled_int8 is not None  # AVX2's too
        assert (table.gemm_bf16 is not None) == (name == "avx512_bf16")
        got = RotaryEmbedding(config, 64, 32, table)(positions, q.clone(), k.clone())
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), name


def test_prebuilt_library_of_other_sources_is_not_used(monkeypatch, tmp_path):
    import shutil

    from cpullm.model_executor.layers import kernel_build
    from cpullm.model_executor.layers import ops as ops_py

    level = ops_py.ISA_LEVELS[0]
    mine = ops_py.prebuilt_name(level)
    shutil.copytree(kernel_build.CSRC, tmp_path / "csrc")
    (tmp_path / "csrc" / "threads.cpp").write_text(
        (tmp_path / "csrc" / "threads.cpp").read_text() + "\n// edited\n")
    monkeypatch.setattr(kernel_build, "CSRC", str(tmp_path / "csrc"))
    assert ops_py.prebuilt_name(level) != mine
    assert ops_py.load_prebuilt(level) is None  # sources edited since setup: the JIT build
