"""GGUF weights kept quantized: the block types taken apart exactly as gguf's dequantizer
reads them, every kernel against a float reference on the dequantized weights, and a model
file mixing Q4_K, Q6_K, Q5_0 and Q8_0 tensors end to end against transformers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    GREEDY_PROMPTS,
    assert_greedy_follows,
    avx2_kernels,
    greedy_outputs,
    kernels_or_skip,
    prebuilt_libraries,
    quantized_kernel_runs,
    quantized_kernels,
)
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from cpullm.model_executor.layers.ops import ISA_LEVELS
from cpullm.model_executor.layers.quantization.gguf import RawBlocks
from cpullm.model_executor.layers.quantization.gguf_blocks import (
    FORMATS,
    KEPT_TYPES,
    block_bytes,
    dequantize_split,
    pack,
    split_blocks,
    unpack,
)
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight, TiledWeight
from cpullm.platform.cpu import cpu_info
from cpullm.transformers_utils import resolve_model

LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# the float16 fields (d, dmin) of each K-quant super-block, by byte offset
_K_HALVES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype: T, rows: int, k: int, rng: np.random.Generator,
                  scale: float = 0.01) -> np.ndarray:
    """[rows, bytes] of ``qtype``: legacy types quantized by gguf from normal values,
    K-quants packed from the published layouts (random quants and sub-scales, float16
    super-scales of about ``scale``)."""
    if qtype in LEGACY:
        return quantize((rng.standard_normal((rows, k)) * scale * 10).astype(np.float32), qtype)
    per_block, nbytes = block_bytes(qtype)
    raw = rng.integers(0, 256, size=(rows * k // per_block, nbytes), dtype=np.uint8)
    for offset in _K_HALVES[qtype]:
        halves = (rng.standard_normal((raw.shape[0], 1)) * scale).astype(np.float16)
        raw[:, offset:offset + 2] = halves.view(np.uint8)
    return raw.reshape(rows, -1)


def width(qtype: T) -> int:
    """A row length with a short last group of blocks, where the type allows one."""
    return 864 if qtype in LEGACY else 768  # 27 blocks of 32; K-quants: whole super-blocks


@pytest.mark.parametrize("qtype", KEPT_TYPES, ids=lambda t: t.name)
def test_blocks_split_as_gguf_dequantizes(qtype):
    rng = np.random.default_rng(0)
    raw = random_blocks(qtype, 6, width(qtype), rng)
    split = split_blocks(qtype, raw, width(qtype))
    assert np.array_equal(dequantize_split(split), dequantize(raw, qtype))
    assert int(split.u.max()) < 1 << split.fmt.bits


# tests/kquants.py's quantizers (K-quant files for the fidelity floors) against gguf's
# dequantizer: relative error of normal weights near llama.cpp's for the type (its Q4_K
# ~0.07, Q5_K ~0.035, Q6_K ~0.018), a zero row kept zero.
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quantizer_round_trips_through_gguf(qtype):
    from kquants import quantize_k

    most = {T.Q4_K: 0.085, T.Q5_K: 0.042, T.Q6_K: 0.021}[qtype]

    values = (np.random.default_rng(2).standard_normal((8, 1536)) * 0.05).astype(np.float32)
    values[3] = 0
    values[5] += 0.2  # a row of one sign: its mins are zero
    back = dequantize(quantize_k(values, qtype), qtype).reshape(values.shape)
    assert np.linalg.norm(back - values) / np.linalg.norm(values) < most
    assert not back[3].any()
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(values[:, :576], qtype)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits, block):
    rng = np.random.default_rng(1)
    for blocks in (1, 2, 3, 7, 16, 18, 27, 48):  # every kind of last group
        u = rng.integers(0, 16 if bits == 4 else 256, size=(3, blocks * block), dtype=np.uint8)
        packed = pack(u, bits, block)
        assert packed.shape[1] <= blocks * block * bits // 8 + 32 * (bits == 4)
        assert np.array_equal(unpack(packed, bits, block, blocks * block), u)


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 600])
@pytest.mark.parametrize("qtype", KEPT_TYPES, ids=lambda t: t.name)
def test_kernels_match_dequantized_reference(qtype, rows):
    """Every kernel this machine can run, forced, against x @ W.T in float32 on the
    dequantized weights (x in bfloat16, as the kernels get it)."""
    ops, _ = quantized_kernels()
    rng = np.random.default_rng(2)
    n, k = 96, width(qtype)
    weight = RawBlocks(qtype, random_blocks(qtype, n, k, rng), (n, k)).to_weight()
    reference_w = torch.from_numpy(dequantize_split(split_blocks(
        qtype, random_blocks(qtype, n, k, np.random.default_rng(2)), k)))
    assert torch.equal(weight.dequantize(torch.float32), reference_w)
    tiled = TiledWeight.of(weight)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(n).bfloat16()
    expected = x.float() @ reference_w.T + bias.float()
    for table, kernel in [(ops, "torch"), *quantized_kernel_runs()]:
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        (weight if kernel == "torch" else tiled).matmul_into(out, x, bias, table, kernel=kernel)
        error = (out.float() - expected).norm() / expected.norm()
        # bf16 output rounding, and the int8 quantization of x for the dot products
        assert error < (0.01 if kernel == "tiled_int8" else 0.004), (kernel, table.isa, error)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_grouped_kernel_gives_each_weights_product(qtype):
    """The grouped kernel (a mixture's experts in one call: quant_gemm_tiled_grouped), in
    every build this machine runs: each run of rows, an empty one too, gets bit for bit what
    its own weight gives, and the same where x is a view of wider rows (a mixture's gathered
    tokens may be)."""
    rng = np.random.default_rng(6)
    n, k, offsets = 64, 576, [0, 3, 3, 12, 13, 14]
    weights = [TiledWeight.of(RawBlocks(qtype, random_blocks(qtype, n, k, rng), (n, k))
                              .to_weight()) for _ in range(len(offsets) - 1)]
    biases = [torch.randn(n).bfloat16() for _ in weights]
    x = torch.randn(offsets[-1], k).bfloat16()
    runs = [(table, kernel) for table, kernel in quantized_kernel_runs()
            if kernel == "tiled_int8"]
    kernels_or_skip(runs, {"avx2"}, "the int8 kernels")
    for table, kernel in runs:
        grouped = torch.empty(offsets[-1], n, dtype=torch.bfloat16)
        QuantizedWeight.matmul_grouped(grouped, x, weights, biases, offsets, table)
        for i, weight in enumerate(weights):
            rows = slice(offsets[i], offsets[i + 1])
            alone = torch.empty(offsets[i + 1] - offsets[i], n, dtype=torch.bfloat16)
            weight.matmul_into(alone, x[rows], biases[i], table, kernel=kernel)
            assert torch.equal(grouped[rows], alone), (table.isa, kernel, i)
        wide = torch.empty(offsets[-1], k + 32, dtype=torch.bfloat16)[:, :k]
        wide.copy_(x)
        from_wide = torch.empty(offsets[-1], n, dtype=torch.bfloat16)
        QuantizedWeight.matmul_grouped(from_wide, wide, weights, biases, offsets, table)
        assert torch.equal(from_wide, grouped), (table.isa, kernel)


def test_kernel_writes_into_a_column_slice():
    """A merged layer's segments write their columns of one output."""
    ops, kernels = quantized_kernels()
    kernels_or_skip(kernels, {"avx2"}, "the quantized kernels")
    rng = np.random.default_rng(4)
    weight = TiledWeight.of(RawBlocks(T.Q4_1, random_blocks(T.Q4_1, 64, 256, rng),
                                      (64, 256)).to_weight())
    x = torch.randn(3, 256).bfloat16()
    for kernel in kernels:
        full = torch.full((3, 100), 7.0, dtype=torch.bfloat16)
        weight.matmul_into(full[:, 20:84], x, None, ops, kernel=kernel)
        assert torch.equal(full[:, :20], torch.full((3, 20), 7.0, dtype=torch.bfloat16))
        assert torch.equal(full[:, 84:], torch.full((3, 16), 7.0, dtype=torch.bfloat16))
        alone = torch.empty(3, 64, dtype=torch.bfloat16)
        weight.matmul_into(alone, x, None, ops, kernel=kernel)
        assert torch.equal(full[:, 20:84], alone), kernel



@pytest.mark.parametrize("n", [96, 40])
@pytest.mark.parametrize("rows", [1, 2, 5, 17, 600])
@pytest.mark.parametrize("qtype", KEPT_TYPES, ids=lambda t: t.name)
def test_tiled_kernels_match_dequantized_reference(qtype, rows, n):
    """A weight laid out in 16-row tiles (n = 40: padded with zero rows to 64) dequantizes
    to what it was, whole and row by row, and each tile kernel this machine runs, forced,
    matches x @ W.T in float32 (the dequantizing torch path on any machine)."""
    ops, kernels = quantized_kernels()
    rng = np.random.default_rng(2)
    k = width(qtype)
    weight = RawBlocks(qtype, random_blocks(qtype, n, k, rng), (n, k)).to_weight()
    tiled = TiledWeight.of(weight)
    assert tiled.n == n and tiled.data.shape[0] * 16 == n + tiled.pad and tiled.pad < 32
    reference_w = weight.dequantize(torch.float32)
    assert torch.equal(tiled.dequantize(torch.float32), reference_w)
    ids = torch.tensor([[5, 17], [n - 1, 5]])
    assert torch.equal(tiled.dequantize(torch.float32, ids), reference_w[ids])
    assert torch.equal(tiled.dequantize(torch.float32, slice(30, 70)), reference_w[30:70])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(n).bfloat16()
    expected = x.float() @ reference_w.T + bias.float()
    for kernel in ["torch", *kernels]:
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        tiled.matmul_into(out, x, bias, ops, kernel=kernel)
        error = (out.float() - expected).norm() / expected.norm()
        assert error < (0.01 if kernel == "tiled_int8" else 0.004), (kernel, error)


@pytest.mark.parametrize("qtype", [t for t in KEPT_TYPES if t not in (T.Q2_K, T.Q3_K)],
                         ids=lambda t: t.name)
def test_tiles_keep_the_files_bytes(qtype):
    """In tiles a weight holds the file's bytes, but for the K-quants' 6-bit sub-scales and
    sub-mins, a byte each (Q2_K and Q3_K, not here, keep their 2 and 3 bits in 4); and the
    loader's estimate of the weights' memory counts the same."""
    n, k = 64, width(qtype)
    raw = random_blocks(qtype, n, k, np.random.default_rng(4))
    tiled = TiledWeight.of(RawBlocks(qtype, raw, (n, k)).to_weight())
    kept = sum(t.nbytes for t in (tiled.data, tiled.scales, tiled.mins) if t is not None)
    assert raw.nbytes <= kept <= raw.nbytes * 1.03
    assert kept == FORMATS[qtype].bytes_per_weight() * n * k


def int8_libraries() -> list[object]:
    """Every prebuilt library this CPU runs: each has its own build of the int8 dot
    products."""
    return prebuilt_libraries()


@pytest.mark.parametrize("rows", [1, 2, 5, 300])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_kernels_store_float32_logits(qtype, rows):
    """Into a float32 out (an LM head's logits) the int8 dot products of every library
    this CPU runs, on both layouts, quantize x in two levels: ~300x closer to x @ W.T than
    x's int8 blocks alone (measured 1.9e-5 against 5.4e-3, relative); the GEMMs on bf16
    panels store the very sums whose bfloat16 rounding they store otherwise."""
    ops, _ = quantized_kernels()
    _, tile_kernels = quantized_kernels()
    libraries = int8_libraries()
    kernels_or_skip(libraries, {"avx2"}, "the int8 dot products")
    n, k = 96, width(qtype)
    weight = RawBlocks(qtype, random_blocks(qtype, n, k, np.random.default_rng(2)),
                       (n, k)).to_weight()
    reference_w = weight.dequantize(torch.float32).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(n).bfloat16()
    expected = x.double() @ reference_w.T + bias.double()
    tiled = TiledWeight.of(weight)
    runs = [(tiled, table, "tiled_int8") for table in libraries]
    runs += [(tiled, ops, kernel) for kernel in tile_kernels if kernel != "tiled_int8"]
    for w, table, kernel in [*runs, (weight, ops, "torch")]:
        assert kernel in w.float32_kernels, kernel
        products = {}
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(rows, n, dtype=dtype)
            w.matmul_into(out, x, bias, table, kernel=kernel)
            products[dtype] = out
        logits = products[torch.float32].double()
        error = ((logits - expected).norm() / expected.norm()).item()
        if kernel in ("int8", "tiled_int8", "torch"):
            assert error < 1e-4, (table.isa, kernel, error)
        else:
            assert torch.equal(products[torch.float32].bfloat16(),
                               products[torch.bfloat16]), (table.isa, kernel)
    widened = weight.logits(x, ops)
    assert widened.dtype == torch.float32
    assert (widened - (x.float() @ reference_w.float().T)).norm() < 5e-3 * widened.norm()


@pytest.mark.parametrize("rows", [1, 21, 300])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_tiled_kernels_store_silu_mul_and_write_a_column_slice(qtype, rows):
    """On 16-row tiles, every kernel: silu(gate) * up stored with the product is bit for bit
    the product followed by the SiLU-mul kernel (wherever the library has that kernel; the
    others refuse to store it); the product lands in a column slice of a wider output."""
    from cpullm.model_executor.layers.activation import SiluAndMul

    ops, kernels = quantized_kernels()
    kernels_or_skip(kernels, {"avx2"}, "the kernels on 16-row tiles")
    n, k = 96, width(qtype)
    weight = TiledWeight.of(RawBlocks(qtype, random_blocks(
        qtype, n, k, np.random.default_rng(5)), (n, k)).to_weight())
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    for kernel in kernels:
        if not weight.fuses_silu_mul(kernel, ops):
            assert ops.silu_and_mul_bf16 is None, kernel
            with pytest.raises(RuntimeError, match="stores products"):
                weight.kernel(ops, kernel)(torch.empty(rows, n // 2, dtype=torch.bfloat16), x,
                                           weight.data, weight.scales, weight.mins,
                                           weight.fmt.bits, weight.fmt.block,
                                           weight.fmt.zero or 0, None, True)
        for bias in (torch.randn(n, generator=gen).bfloat16(), None):
            if not weight.fuses_silu_mul(kernel, ops):
                break
            product = torch.empty(rows, n, dtype=torch.bfloat16)
            weight.matmul_into(product, x, bias, ops, kernel=kernel)
            fused = torch.empty(rows, n // 2, dtype=torch.bfloat16)
            weight.matmul_into(fused, x, bias, ops, kernel=kernel, silu_mul=True)
            assert torch.equal(fused, SiluAndMul(ops)(product)), (kernel, bias is None)
        full = torch.full((rows, n + 36), 7.0, dtype=torch.bfloat16)
        weight.matmul_into(full[:, 20:20 + n], x, None, ops, kernel=kernel)
        alone = torch.empty(rows, n, dtype=torch.bfloat16)
        weight.matmul_into(alone, x, None, ops, kernel=kernel)
        assert torch.equal(full[:, 20:20 + n], alone), kernel
        assert bool((full[:, :20] == 7).all() and (full[:, 20 + n:] == 7).all()), kernel


@pytest.mark.parametrize("amx", [False, True])
def test_tiled_kernel_follows_the_cpu(amx, monkeypatch):
    """Which tile kernel runs how many rows: the int8 dot products for a few; above them
    AMX where the CPU has it, the bf16 GEMM on dequantized panels on Zen 5 (whose BF16 dot
    products outrun its VNNI ones), the int8 dot products for every number of rows on other
    CPUs (Zen 4)."""
    from cpullm.model_executor.layers.quantization import kept
    from cpullm.platform.cpu import CpuInfo

    ops, kernels = quantized_kernels()
    kernels_or_skip("tiled_int8" in kernels, {"avx512_vnni", "avx512_bf16"},
                    "the int8 kernels on 16-row tiles")
    weight = TiledWeight.of(RawBlocks(T.Q4_1, random_blocks(
        T.Q4_1, 32, 64, np.random.default_rng(1)), (32, 64)).to_weight())
    # the table of a CPU with AMX or without (an entry stands in: only the choice is asked)
    table = ops.without_amx()
    if amx:
        table = dataclasses.replace(table, quant_gemm_tiled_amx=table.quant_gemm_tiled_bf16)

    def kernels_on(family: int) -> list[str]:
        info = CpuInfo("AuthenticAMD", "AMD EPYC", frozenset(), family)
        monkeypatch.setattr(kept, "cpu_info", lambda: info)
        return [weight.kernel_for(rows, table, torch.bfloat16)
                for rows in (1, kept.AMX_PANELS_MIN_ROWS + 1, kept.VNNI_MAX_ROWS + 1, 4096)]

    if amx:
        expected = ["tiled_int8"] + ["tiled_amx"] * 3
        assert kernels_on(25) == kernels_on(26) == expected
    else:
        assert kernels_on(25) == ["tiled_int8"] * 4
        assert kernels_on(26) == ["tiled_int8"] * 2 + ["tiled_bf16"] * 2
    assert weight.kernel_for(1, ops, torch.float32) == "torch"


def test_cpu_family_is_read():
    from cpullm.platform.cpu import CpuInfo

    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel name\t: AMD EPYC\n" \
        "flags\t\t: avx512f avx512_bf16\n\nprocessor\t: 1\n"
    info = CpuInfo.parse(text)
    assert (info.vendor, info.family, info.bf16_dots_outrun_vnni) == ("AuthenticAMD", 26, True)
    assert CpuInfo.parse(text.replace(": 26", ": 25")).bf16_dots_outrun_vnni is False
    assert CpuInfo.parse("Features\t: asimd\nCPU implementer\t: 0x41\n").family == 0


# A tiny Llama whose tensors mix the types of a Q4_K_M file: q/k Q4_K and v Q6_K in one
# merged QKV layer, gate Q4_K and up Q8_0 in one gate-up layer, down Q6_K, o Q5_0, the tied
# embedding Q8_0, norms F32. (q and k are random, so llama.cpp's row order of them needs no
# care: both loaders put the stored rows back the same way.)
MIXED = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_0,
         "ffn_gate": T.Q4_K, "ffn_up": T.Q8_0, "ffn_down": T.Q6_K}
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def mixed_gguf(request, tmp_path_factory) -> Path:
    """The file, as a Llama and as a Qwen2 (whose q, k and v projections have biases, F32
    in GGUF files)."""
    arch = request.param
    reader = GGUFReader(resolve_model(None).gguf_path)
    path = tmp_path_factory.mktemp("mixed") / f"mixed-{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    sizes = {"embedding_length": HIDDEN, "feed_forward_length": INTERMEDIATE,
             "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
             "block_count": LAYERS, "rope.dimension_count": HIDDEN // HEADS,
             "context_length": 512}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        name = field.name
        if name.startswith("llama."):
            name = arch + name[len("llama"):]
        value = sizes.get(name.split(".", 1)[1] if name.startswith(arch + ".") else "",
                          field.contents())
        writer.add_key_value(name, value, field.types[0],
                             sub_type=field.types[1] if field.types[0] == GGUFValueType.ARRAY
                             else None)
    rng = np.random.default_rng(5)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim),
              "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
              "ffn_down": (HIDDEN, INTERMEDIATE)}

    def add_blocks(name: str, qtype: T, rows: int, k: int, scale: float) -> None:
        raw = random_blocks(qtype, rows, k, rng, scale)
        writer.add_tensor(name, raw, raw_dtype=qtype)

    add_blocks("token_embd.weight", T.Q8_0, vocab, HIDDEN, 0.01)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for layer in range(LAYERS):
        for part, qtype in MIXED.items():
            rows, k = shapes[part]
            # super-scales of ~3e-4: K-quant weights of ~0.05, like a trained layer's
            add_blocks(f"blk.{layer}.{part}.weight", qtype, rows, k,
                       0.01 if qtype in LEGACY else 3e-4)
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{layer}.{part}.bias",
                                  (0.1 * rng.standard_normal(rows)).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight",
                              (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_mixed_types_load_and_match_transformers(mixed_gguf):
    """In float32 (no quantized kernel: the blocks dequantized once at load) the file
    generates exactly what transformers generates from it. In bfloat16 it stays quantized,
    as two segments in QKV and in gate-up, and its greedy tokens follow float32's (at the
    first difference, each side's token in the other's top 5)."""
    from transformers import AutoModelForCausalLM

    from cpullm.model_executor.layers.linear import LinearBase

    prompts = GREEDY_PROMPTS
    model, exact = greedy_outputs(mixed_gguf, "float32")
    assert all(s.quantized is None for m in model.modules() if isinstance(m, LinearBase)
               for s in m.segments)
    reference = AutoModelForCausalLM.from_pretrained(
        str(mixed_gguf.parent), gguf_file=mixed_gguf.name, dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    for prompt, output in zip(prompts, exact, strict=True):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=16)
        assert output.token_ids == expected[0, len(prompt):].tolist()

    ops, kernels = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return  # bfloat16 runs dequantized too on this CPU
    model, quantized = greedy_outputs(mixed_gguf, "bfloat16")
    _assert_kept_mixed(model)
    assert_greedy_follows(exact, quantized)


def _assert_kept_mixed(model: torch.nn.Module) -> None:
    """Every linear layer of the mixed file kept in its types, two segments in QKV and in
    gate-up, the embedding table in Q8_0."""
    from cpullm.model_executor.layers.linear import LinearBase

    qkv = model.model.layers[0].self_attn.qkv_proj
    assert [s.quantized.qtype for s in qkv.segments] == ["Q4_K", "Q6_K"]
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert [s.quantized.qtype for s in gate_up.segments] == ["Q4_K", "Q8_0"]
    assert all(s.dense is None for m in model.modules() if isinstance(m, LinearBase)
               for s in m.segments)
    assert model.model.embed_tokens.quantized.qtype == "Q8_0"


@pytest.mark.slow
def test_mixed_types_on_the_avx2_kernels(mixed_gguf, monkeypatch):
    """With CPULLM_KERNEL_ISA=avx2 the AVX2 library runs (what a CPU with AVX2 and no
    AVX-512 gets): the file stays quantized on its int8 kernels, whose greedy tokens follow
    float32's."""
    from cpullm.model_executor.layers import ops as ops_py

    if avx2_kernels() is None:
        if ISA_LEVELS[0].needs <= cpu_info().flags:
            pytest.fail("this CPU runs the AVX2 library, but the install did not build it "
                        "from the sources as they are (make setup)")
        pytest.skip("the AVX2 library needs an x86 CPU with AVX2, FMA and F16C")
    _, exact = greedy_outputs(mixed_gguf, "float32")
    monkeypatch.setenv("CPULLM_KERNEL_ISA", "avx2")
    ops_py.load_ops.cache_clear()
    try:
        ops = ops_py.load_ops()
        assert ops is not None and ops.isa == "avx2" and ops.quant_gemm_tiled_bf16 is None
        model, quantized = greedy_outputs(mixed_gguf, "bfloat16")
    finally:
        monkeypatch.delenv("CPULLM_KERNEL_ISA")
        ops_py.load_ops.cache_clear()
    _assert_kept_mixed(model)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.ops.isa == "avx2"
    assert_greedy_follows(exact, quantized)


def test_unsupported_type_is_refused_by_name(tmp_path):
    from cpullm.model_executor.loader.gguf_loader import iterate_gguf

    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(str(path), "llama")
    per_block, nbytes = block_bytes(T.TQ2_0)
    raw = np.zeros((4, 256 // per_block * nbytes), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=T.TQ2_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has type TQ2_0"):
        list(iterate_gguf(str(path), num_heads=4, num_kv_heads=2))


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.F32, T.Q8_0])
def test_llama_q_rows_put_back_in_rotate_half_order(qtype, tmp_path):
    """llama.cpp stores a Llama q/k projection with the rotary halves interleaved per head;
    the loader reorders the rows back, for float tensors and for blocks alike."""
    from cpullm.model_executor.loader.gguf_loader import iterate_gguf

    heads, head_dim, hidden = 2, 8, 64
    rng = np.random.default_rng(6)
    values = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    def interleave(w: np.ndarray) -> np.ndarray:  # llama.cpp's order of the rows
        return w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)

    def rotate_half(w: np.ndarray) -> np.ndarray:  # back
        return w.reshape(heads, head_dim // 2, 2, hidden).swapaxes(1, 2).reshape(w.shape)

    stored = interleave(values)
    path = str(tmp_path / "q.gguf")
    writer = GGUFWriter(path, "llama")
    if qtype == T.F16:
        writer.add_tensor("blk.0.attn_q.weight", stored.astype(np.float16))
    elif qtype == T.F32:
        writer.add_tensor("blk.0.attn_q.weight", stored)
    else:
        writer.add_tensor("blk.0.attn_q.weight", quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (name, got), = iterate_gguf(path, num_heads=heads, num_kv_heads=heads)
    assert name == "model.layers.0.self_attn.q_proj.weight"
    if isinstance(got, RawBlocks):
        got = torch.from_numpy(dequantize_split(split_blocks(got.qtype, got.raw, hidden)))
    if qtype in (T.F16, T.F32):
        expected = values.astype(np.float16 if qtype == T.F16 else np.float32)
    else:
        expected = rotate_half(dequantize(quantize(stored, qtype), qtype))
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), expected.astype(np.float32))
