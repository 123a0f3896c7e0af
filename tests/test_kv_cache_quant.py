"""The quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2): the store and the
decode kernel of every library this CPU runs against the plain torch store and a float
reference on the dequantized rows, the capacity, the flags, and greedy generation end to
end against the compute-dtype cache."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_pool_free, hf_greedy, kernels_or_skip, prebuilt_libraries

from cpullm.config import KV_CACHE_DTYPES
from cpullm.engine_args import EngineArgs
from cpullm.model_executor.layers.attention import KVCacheQuant
from cpullm.model_executor.layers.ops import KernelTable

FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def libraries() -> list[KernelTable]:
    """Every prebuilt library this CPU runs: each has its own build of the quantized-cache
    kernels (AVX2's and AVX-512's vector loads)."""
    tables = prebuilt_libraries()
    if not tables:
        pytest.skip("no prebuilt kernel library runs on this CPU")
    return tables


def make_quant(fmt: str, num_blocks: int, block_size: int, kv_heads: int, k_scale: float = 0.37,
               v_scale: float = 1.7) -> KVCacheQuant:
    if fmt == "int8":
        scales = torch.zeros(2, num_blocks, block_size, kv_heads, dtype=torch.float16)
        return KVCacheQuant(torch.int8, scales)
    return KVCacheQuant(FORMATS[fmt], None, k_scale, v_scale)


def store(ops: KernelTable, quant: KVCacheQuant, caches: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, slots: torch.Tensor) -> None:
    kv_heads, dim = k.shape[1:]
    rows = (None, None) if quant.scales is None else \
        (quant.scales[0].view(-1, kv_heads), quant.scales[1].view(-1, kv_heads))
    ops.cache_kv_quant(caches[0].view(-1, kv_heads, dim), caches[1].view(-1, kv_heads, dim),
                       *rows, k, v, slots, quant.k_scale, quant.v_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_matches_torch(fmt, dtype):
    """cache_kv_quant writes the bytes (and int8's float16 scales) the plain torch store
    writes, bit for bit, on every library: rows of zeros, outliers past fp8's range,
    head sizes off the vector width."""
    torch.manual_seed(0)
    for ops in libraries():
        for kv_heads, dim in ((2, 64), (3, 40), (1, 128)):
            tokens, num_blocks, block_size = 37, 4, 32
            k = (torch.randn(tokens, kv_heads, dim) * 4).to(dtype)
            v = torch.randn(tokens, kv_heads, dim).to(dtype)
            k[3] = 0  # a zero row: scale 0, zeros stored
            k[5, 0, 1] = 3e4  # past e4m3's 448 * k_scale: saturates
            slots = torch.randperm(num_blocks * block_size)[:tokens]
            got_q = make_quant(fmt, num_blocks, block_size, kv_heads)
            want_q = make_quant(fmt, num_blocks, block_size, kv_heads)
            shape = (2, num_blocks, block_size, kv_heads, dim)
            got = torch.zeros(shape, dtype=FORMATS[fmt])
            want = torch.zeros(shape, dtype=FORMATS[fmt])
            store(ops, got_q, got, k, v, slots)
            want_q.store(want[0], 0, k, slots)
            want_q.store(want[1], 1, v, slots)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (ops.isa, dim)
            if fmt == "int8":
                assert torch.equal(got_q.scales, want_q.scales), (ops.isa, dim)
            back = want_q.gather(want[0], 0, torch.arange(num_blocks)[None], torch.float32)
            rows = back.view(-1, kv_heads, dim)[slots]
            assert torch.isfinite(rows).all()
            ok = torch.ones(tokens, dtype=torch.bool)
            ok[5] = False  # (the saturated outlier's row)
            err = (rows[ok] - k[ok].float()).abs().amax() / k[ok].float().abs().amax()
            assert err < (0.01 if fmt == "int8" else 0.07 if fmt == "fp8_e4m3" else 0.13), err


def reference_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     tables: torch.Tensor, lens: list[int], scale: float, window: int,
                     softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float32 attention of each sequence's one query over its dequantized rows
    (keys/values: [num_blocks, block_size, kv_heads, dim])."""
    heads, dim = q.shape[1:]
    kv_heads = keys.shape[2]
    out = []
    for s, length in enumerate(lens):
        first = max(0, length - window) if window else 0
        k = keys[tables[s]].flatten(0, 1)[first:length]
        v = values[tables[s]].flatten(0, 1)[first:length]
        query = q[s].float().view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("kgd,tkd->kgt", query, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.view(kv_heads, -1, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :k.shape[0]]
        out.append(torch.einsum("kgt,tkd->kgd", probs, v).reshape(heads, dim))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_reference(fmt, dtype):
    """decode_attention_quant of every library against float32 attention on the rows it
    reads, dequantized: lengths off the block and vector sizes, GQA groups of 1-8, head
    sizes of the vector loops (16, 64, 128) and off them (40), windows, soft-caps, sinks."""
    torch.manual_seed(1)
    lens = [1, 17, 64, 161]
    for ops in libraries():
        for heads, kv_heads, dim, block_size in ((9, 3, 64, 32), (32, 4, 128, 64),
                                                 (4, 2, 16, 32), (6, 2, 40, 32), (2, 2, 64, 32)):
            num_blocks = 24
            quant = make_quant(fmt, num_blocks, block_size, kv_heads)
            caches = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=FORMATS[fmt])
            per_seq = -(-max(lens) // block_size)
            tables = torch.randperm(num_blocks)[:len(lens) * per_seq].view(len(lens), per_seq)
            for s, length in enumerate(lens):
                slots = torch.tensor([int(tables[s, t // block_size]) * block_size
                                      + t % block_size for t in range(length)])
                store(ops, quant, caches, (torch.randn(length, kv_heads, dim) * 2).to(dtype),
                      torch.randn(length, kv_heads, dim).to(dtype), slots)
            every = torch.arange(num_blocks)[None]
            keys = quant.gather(caches[0], 0, every, torch.float32)[0].view(caches.shape[1:])
            values = quant.gather(caches[1], 1, every, torch.float32)[0].view(caches.shape[1:])
            q = torch.randn(len(lens), heads, dim).to(dtype)
            scale = 1 / math.sqrt(dim)
            for window, softcap, sinks in ((0, 0.0, None), (50, 0.0, None), (0, 30.0, None),
                                           (0, 0.0, torch.randn(heads))):
                out = torch.empty_like(q)
                key_rows, value_rows = (None, None) if quant.scales is None else quant.scales
                ops.decode_attention_quant(out, q, caches[0], caches[1], key_rows, value_rows,
                                           quant.k_scale, quant.v_scale, tables,
                                           torch.tensor(lens), scale, window, softcap, sinks)
                want = reference_decode(q, keys, values, tables, lens, scale, window, softcap,
                                        sinks)
                tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
                err = (out.float() - want).abs().amax().item()
                assert err < tol * max(1.0, want.abs().amax().item()), \
                    (ops.isa, heads, kv_heads, dim, window, softcap, err)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_prompt_attention_reads_the_quantized_rows(fmt):
    """prefill_attention_quant gives, bit for bit, what the bfloat16 kernel gives on a
    bfloat16 cache of the same rows dequantized: chunks of odd lengths, one starting past
    cached blocks, GQA groups, windows."""
    tables_with = [ops for ops in libraries() if ops.prefill_attention_quant is not None]
    kernels_or_skip(tables_with, {"avx512_bf16"}, "the fused prompt attention")
    torch.manual_seed(2)
    for ops in tables_with:
        for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 128), (4, 4, 32)):
            block_size, num_blocks = 32, 16
            quant = make_quant(fmt, num_blocks, block_size, kv_heads)
            caches = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=FORMATS[fmt])
            tables = torch.randperm(num_blocks)[:12].view(3, 4)
            starts, lens = torch.tensor([0, 45, 3]), torch.tensor([37, 50, 1])
            for s in range(3):
                length = int(starts[s] + lens[s])
                slots = torch.tensor([int(tables[s, t // block_size]) * block_size
                                      + t % block_size for t in range(length)])
                store(ops, quant, caches, (torch.randn(length, kv_heads, dim) * 3).bfloat16(),
                      torch.randn(length, kv_heads, dim).bfloat16(), slots)
            every = torch.arange(num_blocks)[None]
            plain = [quant.gather(caches[i], i, every, torch.bfloat16)[0].view(
                caches.shape[1:]).contiguous() for i in (0, 1)]
            q = torch.randn(int(lens.sum()), heads, dim).bfloat16()
            for window in (0, 20):
                got, want = torch.empty_like(q), torch.empty_like(q)
                key_rows, value_rows = (None, None) if quant.scales is None else quant.scales
                ops.prefill_attention_quant(got, q, caches[0], caches[1], key_rows, value_rows,
                                            quant.k_scale, quant.v_scale, tables, starts, lens,
                                            dim ** -0.5, window)
                ops.prefill_attention_bf16(want, q, plain[0], plain[1], tables, starts, lens,
                                           dim ** -0.5, window)
                assert torch.equal(got, want), (ops.isa, heads, dim, window)


def test_kv_cache_dtype_sizes_and_refusals(tiny_model):
    """int8 and fp8 hold about twice the tokens of bfloat16 in the same KV cache memory
    (int8's float16 row scales cost 2 bytes a row); bad names and mismatches are refused
    by name."""
    model = str(tiny_model("llama"))

    def blocks(**kwargs) -> int:
        args = EngineArgs(model=model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                          max_model_len=256, **kwargs)
        return args.create_engine_config().cache.num_blocks

    bf16 = blocks()
    assert blocks(kv_cache_dtype="bfloat16") == bf16
    assert blocks(kv_cache_dtype="fp8") == blocks(kv_cache_dtype="fp8_e5m2") >= 2 * bf16 - 1
    # the tiny model's rows are 16 wide: 32 bytes in bfloat16, 16 + 2 in int8
    assert blocks(kv_cache_dtype="int8") >= bf16 * 32 / 18 - 1
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp4' is not supported.*int8"):
        blocks(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="bfloat16 needs bfloat16 compute"):
        EngineArgs(model=model, dtype="float32", kv_cache_dtype="bfloat16",
                   kv_cache_memory_bytes=64 << 20).create_engine_config()
    with pytest.raises(ValueError, match="--calculate-kv-scales is for an fp8 KV cache"):
        blocks(kv_cache_dtype="int8", calculate_kv_scales=True)
    assert set(FORMATS) | {"auto", "bfloat16", "fp8"} == set(KV_CACHE_DTYPES)


def fake_quant_attention(fmt: str):
    """transformers' SDPA attention on keys and values quantized and dequantized as the
    cache stores them (float32 rows [batch, kv_heads, len, dim]: a row is one token's KV
    head, as in the cache)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        rows = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # [tokens, heads, dim]
        quant = make_quant(fmt, 1, rows.shape[0], rows.shape[1], 1.0, 1.0)
        cache = torch.zeros(1, rows.shape[0], *rows.shape[1:], dtype=FORMATS[fmt])
        quant.store(cache, 0, rows, torch.arange(rows.shape[0]))
        back = quant.gather(cache, 0, torch.zeros(1, 1, dtype=torch.long), torch.float32)[0]
        return back.view(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, roundtrip(key), roundtrip(value), *args,
                                      **kwargs)
    return attention


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_matches_transformers_on_the_same_rows(tiny_model, fmt):
    """In float32, generation on a quantized cache gives transformers' greedy tokens when
    transformers attends over the same quantized rows: prompts in chunks of 32 tokens (the
    later chunks read the cache), a prefix-cache hit, decode on the kernels; every block
    comes back. The plain torch paths (--enforce-eager) give them too."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from cpullm import LLM, SamplingParams

    model = str(tiny_model("llama"))
    AttentionInterface.register(f"kv_{fmt}", fake_quant_attention(fmt))
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                     attn_implementation=f"kv_{fmt}")
    long = list(range(5, 5 + 90))
    # the second call's prompt extends the first's: its first 64 tokens are a prefix hit
    calls = [[long, [11, 12, 13]], [long + [7, 8, 9]]]
    want = hf_greedy(reference, [p for prompts in calls for p in prompts], 12)
    # (the quantized rows change these tokens: a cache kept unquantized would not pass)
    assert want != hf_greedy(model, [p for prompts in calls for p in prompts], 12)
    for eager in (False, True):
        llm = LLM(model=model, dtype="float32", max_model_len=256, block_size=32,
                  kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=32,
                  kv_cache_dtype=fmt, enforce_eager=eager)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        got = [o.outputs[0].token_ids for prompts in calls for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert got == want, eager
        assert_pool_free(llm)
        assert llm.llm_engine.scheduler.kv_cache_manager.num_hits > 0
