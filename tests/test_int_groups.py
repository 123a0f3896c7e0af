"""AWQ, GPTQ and compressed-tensors checkpoints kept quantized.

Checkpoints are made here: AWQ and GPTQ packed from the formats' published layouts
(round-to-nearest quantization of a tiny random Llama), compressed-tensors by the
compressed-tensors library itself. Every kernel is checked against a float reference on
the dequantized weights for groups of 32, 64 and 128, per channel, symmetric and not, with
act order; each format end to end: in float32 (dequantized once at load) the greedy tokens
equal transformers' on the dequantized weights; in bfloat16 (kept quantized) they follow
them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    GREEDY_PROMPTS,
    amx_or_skip,
    assert_greedy_follows,
    greedy_outputs,
    hf_greedy,
    quantized_kernel_runs,
    quantized_kernels,
)
from safetensors.torch import save_file

from cpullm.model_executor.layers.activation import SiluAndMul
from cpullm.model_executor.layers.quantization.awq import ORDER
from cpullm.model_executor.layers.quantization.fp8 import Float8Groups, Float8Weight
from cpullm.model_executor.layers.quantization.gguf_blocks import pack, unpack
from cpullm.model_executor.layers.quantization.int_groups import IntGroups
from cpullm.model_executor.layers.quantization.kept import (
    AmxInt8Weight,
    KeptLinearMethod,
    QuantizedWeight,
    Shard,
    TiledWeight,
)

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


def rtn(w: torch.Tensor, bits: int, group: int, symmetric: bool
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of w [n, k] in groups of ``group`` columns: q [n, k],
    float16 scales and integer zero points [n, k / group]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scales = (g.abs().amax(-1) / (top / 2)).clamp(min=1e-6).half()
        zeros = torch.full(scales.shape, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / top).clamp(min=1e-6).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, top).to(torch.int32)
    q = torch.round(g / scales.float()[..., None]) + zeros[..., None]
    return q.clamp(0, top).to(torch.int32).reshape(n, k), scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
               ) -> torch.Tensor:
    n, k = q.shape
    w = (q.reshape(n, k // group, group) - zeros[..., None]).float() * scales.float()[..., None]
    return w.reshape(n, k)


def random_groups(n: int, k: int, bits: int, group: int, symmetric: bool,
                  act_order: bool = False, seed: int = 0) -> IntGroups:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    perm = torch.randperm(k, generator=gen) if act_order else None
    q, scales, zeros = rtn(w if perm is None else w[:, perm], bits, group, symmetric)
    groups = IntGroups(q, scales, None if symmetric else zeros, bits, group, perm)
    return groups


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip_large_blocks(bits, block):
    rng = np.random.default_rng(1)
    for blocks in (1, 2, 3, 5, 16, 18):
        u = rng.integers(0, 1 << bits, size=(3, blocks * block), dtype=np.uint8)
        assert np.array_equal(unpack(pack(u, bits, block), bits, block, blocks * block), u)


CASES = [  # bits, group (k: per channel), symmetric, act order
    (4, 32, False, False), (4, 64, True, False), (4, 128, False, False),
    (4, 128, True, True), (4, "k", False, False), (8, 128, True, False),
    (8, "k", True, False), (8, 32, False, True), (4, 256, False, False)]


@pytest.mark.parametrize("rows", [1, 5, 17, 600])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernels_match_dequantized_reference(case, rows):
    """Every kernel this machine runs, forced, against x @ W.T in float32 on the exactly
    dequantized weights. k = 640: five blocks of 128 (a short last group)."""
    bits, group, symmetric, act_order = case
    n, k = 96, 640 if group != 256 else 768
    groups = random_groups(n, k, bits, k if group == "k" else group, symmetric, act_order)
    weight = groups.to_weight("test", "test")
    assert weight is not None
    assert weight.fmt.block == (128 if group in ("k", 256) else group)
    assert (weight.fmt.zero is not None) == symmetric
    reference = groups.dequantize()
    kept = Shard(n, weight, groups.perm)
    # the kept weight, restored to the checkpoint's column order, is the same weight (its
    # mins are float16 products: within float16 rounding)
    rounding = float(groups.scales.float().max()) * ((1 << bits) - 1) * 2 ** -11
    assert torch.allclose(KeptLinearMethod.dense_weight(kept, torch.float32), reference,
                          rtol=0, atol=rounding)
    ops, _ = quantized_kernels()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(n).bfloat16()
    expected = x.float() @ reference.T + bias.float()
    inputs = x if groups.perm is None else x.index_select(1, groups.perm)
    tiled = TiledWeight.of(weight) if weight.k % 32 == 0 else None
    for table, kernel in [(ops, "torch"), *quantized_kernel_runs()]:
        if kernel != "torch" and tiled is None:
            continue
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        (weight if kernel == "torch" else tiled).matmul_into(out, inputs, bias, table,
                                                             kernel=kernel)
        error = (out.float() - expected).norm() / expected.norm()
        assert error < (0.012 if kernel == "tiled_int8" else 0.004), (kernel, table.isa, error)


def test_awq_word_layout():
    """AWQ's published order: the eight columns 0..7 of a row, valued 0..7, make the word
    0x75316420 (nibble j holds column ORDER[j])."""
    from cpullm.model_executor.layers.quantization.awq import unpack_awq

    values = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    word = _pack_awq(values)
    assert int(word[0, 0]) & 0xFFFFFFFF == 0x75316420
    assert torch.equal(unpack_awq(word), values.to(torch.uint8))


# ----- checkpoints, packed from the formats' layouts -----

def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 a checkpoint stores."""
    return ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def _pack_along(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """32 / bits values to a word along ``dim``, value j at bits j * bits."""
    per = 32 // bits
    v = values.to(torch.int64) & ((1 << bits) - 1)
    if dim == 0:
        v = v.reshape(-1, per, v.shape[1]).transpose(1, 2)  # [words, cols, per]
    else:
        v = v.reshape(v.shape[0], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return _to_int32((v << shifts).sum(-1))


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values -> [rows, cols / 8] words in AWQ's order."""
    rows, cols = values.shape
    ordered = values.reshape(rows, cols // 8, 8)[:, :, list(ORDER)].reshape(rows, cols)
    return _pack_along(ordered, 4, dim=1)


def pack_gptq(q, scales, zeros, bits, g_idx, v2):
    return {"qweight": _pack_along(q.T, bits, dim=0),
            "qzeros": _pack_along(zeros.T - (0 if v2 else 1), bits, dim=1),
            "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}


def pack_awq(q, scales, zeros, bits, g_idx, v2):
    return {"qweight": _pack_awq(q.T), "qzeros": _pack_awq(zeros.T),
            "scales": scales.T.contiguous()}


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate_up_proj")


def _tiny_llama(tokenizer_dir: Path, config_class: str = "LlamaConfig",
                **extra: object) -> torch.nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_class)(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=len(tokenizer),
        max_position_embeddings=512, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def write_checkpoint(root: Path, tokenizer_dir: Path, method: str, bits: int, group: int,
                     symmetric: bool, act_order: bool, v2: bool = False,
                     not_converted: tuple[str, ...] = (),
                     model: torch.nn.Module | None = None,
                     dynamic: dict[str, dict] | None = None,
                     lm_head: bool = False) -> tuple[Path, Path]:
    """An AWQ or GPTQ folder of a tiny random Llama (or ``model``), and a float32 folder of
    the same model with the dequantized weights (the reference). ``dynamic``: GPTQModel's
    per-module overrides, applied as it applies them (the first pattern that matches a
    module's name; "-:" leaves it in floats). ``lm_head``: GPTQ's LM head quantized too."""
    from transformers import AutoTokenizer

    model = model or _tiny_llama(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    quantized, reference = root / "quantized", root / "reference"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(1)
    base_bits, base_group = bits, group
    for name in list(state):
        module = name.removesuffix(".weight")
        linear = module.endswith(LINEARS) or (lm_head and module == "lm_head")
        if not name.endswith(".weight") or not linear or module.endswith(not_converted):
            tensors[name] = state[name]
            continue
        override = next(((p, o) for p, o in (dynamic or {}).items()
                         if re.match(p.removeprefix("-:").removeprefix("+:"), module)), None)
        if override is not None and override[0].startswith("-:"):
            tensors[name] = state[name]
            continue
        fields = {} if override is None else override[1]
        bits, group = fields.get("bits", base_bits), fields.get("group_size", base_group)
        w = state[name]
        n, k = w.shape
        size = k if group == -1 else group
        perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        q_sorted, scales, zeros = rtn(w[:, perm], bits, size, symmetric)
        q = torch.empty_like(q_sorted)
        q[:, perm] = q_sorted  # back in the checkpoint's column order
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // size  # column perm[j] is in group j / size
        state[name] = torch.empty_like(w)
        state[name][:, perm] = dequantize(q_sorted, scales, zeros, size)
        packer = pack_gptq if method == "gptq" else pack_awq
        for suffix, tensor in packer(q, scales, zeros, bits, g_idx, v2).items():
            tensors[f"{module}.{suffix}"] = tensor
    model.load_state_dict(state)
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    model.config.save_pretrained(quantized)
    tokenizer.save_pretrained(quantized)
    if method == "gptq":
        qconfig = {"quant_method": "gptq", "bits": base_bits, "group_size": base_group,
                   "desc_act": act_order, "sym": symmetric,
                   "checkpoint_format": "gptq_v2" if v2 else "gptq", "dynamic": dynamic,
                   "lm_head": lm_head}
    else:
        qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                   "version": "gemm", "modules_to_not_convert": list(not_converted) or None}
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = qconfig
    (quantized / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(quantized / "model.safetensors"))
    return quantized, reference


def _check_end_to_end(quantized: Path, expected: list[list[int]], origin: str,
                      kept_as: type[QuantizedWeight] = QuantizedWeight) -> None:
    """float32: exactly the reference's tokens; bfloat16, kept quantized (as ``kept_as``)
    where the kernels run: every linear layer's weights quantized (but those the checkpoint
    keeps in floats), the greedy tokens following float32's (at the first difference, each
    side's token in the other's top 5), and the weights' memory within 15% of the
    checkpoint's."""
    from cpullm.model_executor.layers.linear import LinearBase

    model, exact = greedy_outputs(str(quantized), "float32")
    assert [o.token_ids for o in exact] == expected
    assert all(s.quantized is None for m in model.modules() if isinstance(m, LinearBase)
               for s in m.segments)
    ops, _ = quantized_kernels()
    if not kept_as.kernels_run(ops, torch.bfloat16):
        return  # bfloat16 runs dequantized too on this CPU
    model, kept = greedy_outputs(str(quantized), "bfloat16")
    weights = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    # where the CPU has AMX, the blocks are laid out again in 16-row tiles after loading
    assert weights and all(w.origin == origin for w in weights)
    assert all(type(w) is kept_as or type(w) is TiledWeight and kept_as is QuantizedWeight
               for w in weights)
    assert not any(type(w) is QuantizedWeight and TiledWeight.runs(w, ops) for w in weights)
    assert_greedy_follows(exact, kept)
    from safetensors import safe_open

    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(name).numel() * f.get_tensor(name).element_size()
                     for name in f.keys()  # noqa: SIM118 - safe_open is not a dict
                     if name.rsplit(".", 1)[0].endswith(LINEARS)
                     or (name.startswith("lm_head.") and name != "lm_head.weight"))
    dense = sum(s.gemm.panels.numel() * 2 for m in model.modules() if isinstance(m, LinearBase)
                for s in m.segments if s.gemm is not None)
    held = sum(t.numel() * t.element_size() for w in weights
               for t in (w.data, w.scales, w.mins) if t is not None)
    assert held + dense <= 1.15 * stored, (held, dense, stored)


GPTQ_CASES = [  # bits, group, symmetric, act order, gptq_v2
    (4, 128, True, False, False), (4, 64, False, True, False), (8, 128, False, False, True),
    (4, -1, True, False, True)]


@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gptq_checkpoint_matches_transformers(case, tmp_path, tokenizer_dir):
    bits, group, symmetric, act_order, v2 = case
    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, "gptq", bits, group,
                                            symmetric, act_order, v2)
    _check_end_to_end(quantized, hf_greedy(reference, GREEDY_PROMPTS, 16), "GPTQ")


def test_gptq_dynamic_overrides_match_transformers(tmp_path, tokenizer_dir):
    """GPTQModel's ``dynamic``: v_proj in 8 bits with groups of 64, layer 0's down_proj left
    in floats, the rest 4-bit groups of 128; each layer's bits and group size are read from
    its tensors."""
    dynamic = {r"+:.*\.self_attn\.v_proj": {"bits": 8, "group_size": 64},
               r"-:model\.layers\.0\.mlp\.down_proj": {}}
    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, "gptq", 4, 128, False,
                                            False, dynamic=dynamic)
    _check_end_to_end(quantized, hf_greedy(reference, GREEDY_PROMPTS, 16), "GPTQ")
    from cpullm.model_executor.layers.linear import LinearBase

    model, _ = greedy_outputs(str(quantized), "bfloat16", max_tokens=1)
    ops, kernels = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return
    layers = model.model.layers
    qkv = layers[1].self_attn.qkv_proj.segments
    assert [s.quantized.fmt.bits for s in qkv] == [4, 8]  # q and k; v
    assert qkv[1].quantized.fmt.block == 64
    down = layers[0].mlp.down_proj
    assert isinstance(down, LinearBase) and down.segments[0].quantized is None
    assert layers[1].mlp.down_proj.segments[0].quantized.fmt.bits == 4


def test_gptq_quantized_lm_head_matches_transformers(tmp_path, tokenizer_dir):
    """GPTQ's ``lm_head: true``: the LM head's qweight, qzeros and scales load into the
    head, kept quantized where the kernels run."""
    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, "gptq", 4, 128, True,
                                            False, lm_head=True)
    _check_end_to_end(quantized, hf_greedy(reference, GREEDY_PROMPTS, 16), "GPTQ")
    ops, _ = quantized_kernels()
    model, _ = greedy_outputs(str(quantized), "bfloat16", max_tokens=1)
    head = model.lm_head
    assert (head.quantized is not None) == QuantizedWeight.kernels_run(ops, torch.bfloat16)
    assert not hasattr(head, "qweight")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_glm_checkpoint_matches_transformers(method, tmp_path, tokenizer_dir):
    """GLM's interleaved partial rotary on a quantized checkpoint, whose q and k rows are
    packed (not reordered at load): q and k are reordered as they run. The fused gate-up
    is quantized whole."""
    model = _tiny_llama(tokenizer_dir, "GlmConfig", partial_rotary_factor=0.5,
                        attention_bias=True)
    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, method, 4, 128,
                                            method == "gptq", False, model=model)
    _check_end_to_end(quantized, hf_greedy(reference, GREEDY_PROMPTS, 16), method.upper())


@pytest.mark.parametrize("group", [32, 128])
def test_awq_checkpoint_matches_transformers(group, tmp_path, tokenizer_dir):
    """With group 32 the down projections stay in floats (modules_to_not_convert)."""
    not_converted = ("mlp.down_proj",) if group == 32 else ()
    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, "awq", 4, group, False,
                                            False, not_converted=not_converted)
    _check_end_to_end(quantized, hf_greedy(reference, GREEDY_PROMPTS, 16), "AWQ")
    if not_converted:
        from cpullm.model_executor.layers.linear import LinearBase

        model, _ = greedy_outputs(str(quantized), "float32", max_tokens=1)
        down = model.model.layers[0].mlp.down_proj
        assert isinstance(down, LinearBase) and down.segments[0].quantized is None


# ----- compressed-tensors, made by its own library -----

CT_SCHEMES = {  # name -> (format, weights, input activations)
    "w4a16-group": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True,
                                           strategy="group", group_size=64), None),
    "w4a16-asym-channel": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False,
                                                  strategy="channel"), None),
    "w8a16-group": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True,
                                           strategy="group", group_size=128), None),
    "w8a8-int8": ("int-quantized", dict(num_bits=8, type="int", symmetric=True,
                                        strategy="channel"),
                  dict(num_bits=8, type="int", symmetric=True, strategy="token",
                       dynamic=True)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                            strategy="channel"), None),
}


def write_compressed_tensors(root: Path, tokenizer_dir: Path, name: str) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoTokenizer

    fmt, weights, activations = CT_SCHEMES[name]
    model = _tiny_llama(tokenizer_dir)
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**weights),
        input_activations=None if activations is None else QuantizationArgs(**activations))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        n, k = w.shape
        args = module.quantization_scheme.weights
        size = args.group_size if args.strategy == "group" else k
        g = w.reshape(n, k // size, size)
        scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    path = root / name
    model.save_pretrained(path)
    compressor.update_config(str(path))
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_checkpoint_matches_transformers(name, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    path = write_compressed_tensors(tmp_path, tokenizer_dir, name)
    # transformers, with compressed-tensors dequantizing the folder's weights
    reference = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False))
    kept_as = QuantizedWeight
    if name.startswith("fp8"):
        kept_as = Float8Weight
    elif name.startswith("w8a8") and _amx_int8_runs():
        kept_as = AmxInt8Weight  # per-channel INT8 laid out for AMX-INT8 where it runs
    _check_end_to_end(path, hf_greedy(reference, GREEDY_PROMPTS, 16), "compressed-tensors", kept_as)


def _amx_int8_runs() -> bool:
    ops, _ = quantized_kernels()
    return ops is not None and ops.quant_gemm_int8_amx is not None


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 17, 33, 600])
@pytest.mark.parametrize("n, k", [(96, 640), (80, 576), (48, 2048)])
def test_amx_int8_kernel_matches_per_token_reference(n, k, rows):
    """Per-channel INT8 of a W8A8 checkpoint, laid out as AMX-INT8 tiles: the same weight,
    and the kernel's output (VNNI up to 8 rows, tiles above; 16-row tails of W, K of 9 and
    10 steps, two blocks of tokens at K = 2048) equals x quantized per token times W,
    computed exactly, to the output's bfloat16 rounding."""
    amx_or_skip(_amx_int8_runs(), "amx_int8", "the AMX-INT8 kernel")
    ops, _ = quantized_kernels()
    groups = random_groups(n, k, 8, k, True)
    groups.per_token = True
    weight = groups.to_weight("int8 channel", "test")
    assert weight is not None and weight.row_scales is not None
    tiles = weight.for_kernels(ops)
    assert isinstance(tiles, AmxInt8Weight) and tiles.n == n
    assert torch.equal(tiles.dequantize(torch.float32), weight.dequantize(torch.float32))
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen)).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    d = x.float().abs().amax(1) / 127
    q = torch.round(x.float() * (1 / d)[:, None])
    u = groups.q.double() - 128
    expected = (q.double() @ u.T) * (d.double()[:, None] * tiles.row_scales.double()[None])
    for b in (bias, None):
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        tiles.matmul_into(out, x, b, ops)
        want = expected + (0 if b is None else b.double())
        assert torch.allclose(out.double(), want, rtol=2 ** -8,
                              atol=1e-6 * float(want.abs().max()))
        if n % 32 == 0:  # as a gate-up weight: silu(gate) * up stored by the kernel
            assert tiles.fuses_silu_mul(tiles.kernel_for(rows, ops, x.dtype), ops)
            fused = torch.empty(rows, n // 2, dtype=torch.bfloat16)
            tiles.matmul_into(fused, x, b, ops, silu_mul=True)
            assert torch.equal(fused, SiluAndMul(ops)(out))


def _with_quantization_config(folder: Path, qconfig: dict) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {r".*v_proj": {"bits": 2}}},
     "GPTQ with 2-bit weights (dynamic override"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
     "format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 2, "type": "int", "strategy": "group"}}}},
     "weights of g"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ({"quant_method": "bitsandbytes"}, "format 'bitsandbytes' is not supported"),
])
def test_unsupported_schemes_are_refused_by_name(qconfig, message, tiny_model, tmp_path):
    import shutil

    from cpullm import LLM

    folder = Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LLM(model=str(_with_quantization_config(folder, qconfig)))


def test_quantization_flag_must_match_the_checkpoint(tiny_model):
    from cpullm import LLM

    with pytest.raises(ValueError, match="does not match the checkpoint, which is dense"):
        LLM(model=str(tiny_model("llama")), quantization="awq")
    with pytest.raises(ValueError, match="'int3' is not supported"):
        LLM(model=str(tiny_model("llama")), quantization="int3")


# ----- FP8 -----

def test_fp8_block_scales_dequantize_per_block():
    """quant_method fp8 with weight_block_size [128, 128]: one weight_scale_inv per block,
    the last blocks partial."""
    from cpullm.model_executor.layers.quantization.compressed_tensors import (
        CompressedTensorsScheme,
        FP8Config,
    )

    gen = torch.Generator().manual_seed(0)
    n, k = 200, 300  # blocks of 128: 2 x 3, the last ones short
    weight = (torch.randn(n, k, generator=gen) * 2).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=gen) + 0.5
    scheme = FP8Config({"quant_method": "fp8", "weight_block_size": [128, 128]}).scheme
    tensors = {"weight": weight, "weight_scale_inv": scale_inv}
    assert scheme.is_quantized(tensors)
    rows, cols = torch.arange(n) // 128, torch.arange(k) // 128
    expected = weight.float() * scale_inv[rows][:, cols]
    assert torch.equal(scheme.unpack(tensors, n, k).dequantize(), expected)
    found = CompressedTensorsScheme().unpack(tensors, n, k)  # 128 x 128 found
    assert torch.equal(found.dequantize(), expected)
    # split for tensor parallelism: rows anywhere, columns on the blocks
    assert torch.equal(found.narrow(0, 72, 100).dequantize(), expected[72:172])
    assert torch.equal(found.narrow(1, 128, 172).dequantize(), expected[:, 128:])
    with pytest.raises(ValueError, match="do not fall on the FP8 blocks"):
        found.narrow(1, 64, 128)
    with pytest.raises(ValueError, match="need the block size"):
        CompressedTensorsScheme().unpack({**tensors, "weight_scale_inv": torch.ones(3, 7)},
                                         n, k)


def _fp8_kernels(kept: Float8Weight) -> tuple[object, list[str]]:
    """The kernels that can run ``kept`` here (AMX tiles take K a multiple of 32)."""
    ops, _ = quantized_kernels()
    runs = Float8Weight.kernels_run(ops, torch.bfloat16)
    amx = runs and kept.amx_runs(ops)
    return ops, ["torch", *(["dot", "panels"] if runs else []), *(["amx"] if amx else [])]


def test_fp8_kernel_dequantizes_every_e4m3_value_exactly():
    """Every e4m3 byte (signs, subnormals, 448; not NaN) times a scale, through each kernel
    this machine runs: x = the identity gives W.T, which must equal float(b) * scale rounded
    to bfloat16 (the conversion is exact and rounds once)."""
    values = torch.arange(256, dtype=torch.int32)
    values[(values & 0x7F) == 0x7F] = 0  # NaN
    n, k = 64, 256
    data = torch.stack([values.roll(r) for r in range(n)]).to(torch.uint8)
    weight = data.view(torch.float8_e4m3fn)
    scales = torch.rand(n, 2, generator=torch.Generator().manual_seed(0)) * 4 + 2 ** -10
    groups = Float8Groups(weight, scales, 128)
    kept = groups.to_weight("fp8 e4m3 g128", "test")
    assert kept is not None
    expected = groups.dequantize().bfloat16()
    assert torch.equal(kept.dequantize(torch.bfloat16), expected)
    eye = torch.eye(k, dtype=torch.bfloat16)
    ops, kernels = _fp8_kernels(kept)
    for kernel in kernels:
        out = torch.empty(k, n, dtype=torch.bfloat16)
        kept.matmul_into(out, eye, None, ops, kernel=kernel)
        assert torch.equal(out.T, expected), kernel


def test_fp8_panel_layout():
    """The kernels' byte order: per 32 rows and pair of columns, rows 0..15 at the even
    bytes and rows 16..31 at the odd ones, each row's two weights side by side; it goes
    back to row-major exactly; weights it cannot take (rows not a multiple of 32, an odd
    number of columns) are left to be dequantized at load."""
    from cpullm.model_executor.layers.quantization.fp8 import from_panels, to_panels

    n, k = 64, 10
    data = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    panels = to_panels(data)
    assert panels.shape == (n, k) and torch.equal(from_panels(panels), data)
    flat = panels.view(n // 32, k // 2, 64)
    for p, kk, i in [(0, 0, 0), (0, 3, 5), (1, 4, 31), (1, 2, 18)]:
        # element i of the panel row [16 rows][2]: row i // 2, column 2 kk + i % 2
        assert flat[p, kk, 2 * i] == data[32 * p + i // 2, 2 * kk + i % 2]
        assert flat[p, kk, 2 * i + 1] == data[32 * p + 16 + i // 2, 2 * kk + i % 2]
    weight = data.view(torch.float8_e4m3fn)
    assert Float8Groups(weight[:48], torch.ones(48, 1), k).to_weight("x", "x") is None
    assert Float8Groups(weight[:, :9], torch.ones(n, 1), 9).to_weight("x", "x") is None


FP8_CASES = {  # name -> (n, k, scales of shape, block)
    "tensor": (96, 640, "tensor", None),
    "channel-tail": (64, 200, "channel", None),  # rows of 200: a short last 32 columns
    "block-partial": (160, 300, "block", (128, 128)),  # the last blocks partial
}


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 17, 600])
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_kernels_match_dequantized_reference(case, rows):
    """Each FP8 kernel this machine runs, forced, against x @ W.T in float32 on the
    dequantized weight, with a bias, into a column slice of a wider output."""
    n, k, kind, block = FP8_CASES[case]
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(n, k, generator=gen) * 3).to(torch.float8_e4m3fn)
    scale = {"tensor": torch.tensor(0.02), "channel": torch.rand(n, 1, generator=gen) * 0.05,
             "block": torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 0.05}[kind]
    groups = Float8Groups.of(weight, scale, block)
    kept = groups.to_weight(groups.qtype(), "test")
    assert kept is not None
    reference = groups.dequantize()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    expected = x.float() @ reference.T + bias.float()
    ops, kernels = _fp8_kernels(kept)
    for kernel in kernels:
        wide = torch.zeros(rows, n + 32, dtype=torch.bfloat16)
        kept.matmul_into(wide[:, 16:16 + n], x, bias, ops, kernel=kernel)
        error = (wide[:, 16:16 + n].float() - expected).norm() / expected.norm()
        assert error < 0.004, (kernel, error)
        assert not wide[:, :16].any() and not wide[:, 16 + n:].any()


def write_fp8_checkpoint(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """A ``quant_method: fp8`` folder of a tiny random Llama, as DeepSeek's and Qwen's FP8
    checkpoints are (e4m3 weights, a ``weight_scale_inv`` per block of 128 x 128), and a
    float32 folder of the same model with the dequantized weights (the reference)."""
    from transformers import AutoTokenizer

    model = _tiny_llama(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    quantized, reference = root / "quantized", root / "reference"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in list(state.items()):
        if not (name.endswith(".weight") and name.removesuffix(".weight").endswith(LINEARS)):
            tensors[name] = w
            continue
        n, k = w.shape
        blocks = w.reshape(n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448  # [n / 128, k / 128]
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = (w / full).to(torch.float8_e4m3fn)
        state[name] = q.float() * full
        tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = q, scale
    model.load_state_dict(state)
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    model.config.save_pretrained(quantized)
    tokenizer.save_pretrained(quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(quantized / "model.safetensors"))
    return quantized, reference


def test_fp8_block_checkpoint_matches_transformers(tmp_path, tokenizer_dir):
    quantized, reference = write_fp8_checkpoint(tmp_path, tokenizer_dir)
    _check_end_to_end(quantized, hf_greedy(reference, GREEDY_PROMPTS, 16), "FP8", Float8Weight)


def test_fp8_moe_checkpoint_matches_transformers(tiny_model, tmp_path):
    """A Qwen3-MoE checkpoint in FP8 as Qwen ships them (every expert's projections e4m3
    with their own scale, the router in floats): float32 gives transformers' tokens on the
    dequantized weights; bfloat16 keeps every projection in FP8, the experts run one by
    one (quant_gemm_grouped takes integer blocks only)."""
    import shutil

    from safetensors.torch import load_file

    src = tiny_model("qwen3_moe")
    quantized = Path(shutil.copytree(src, tmp_path / "fp8"))
    reference = Path(shutil.copytree(src, tmp_path / "reference"))
    tensors, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        tensors[name] = dequantized[name] = w
        if name.endswith("_proj.weight"):
            scale = w.abs().amax() / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            tensors[name], dequantized[name] = q, q.float() * scale
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale.reshape(1)
    save_file(tensors, str(quantized / "model.safetensors"))
    save_file(dequantized, str(reference / "model.safetensors"))
    _with_quantization_config(quantized, {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic"})
    from transformers import AutoModelForCausalLM

    reference_model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    expected = hf_greedy(reference_model, GREEDY_PROMPTS, 16)
    model, exact = greedy_outputs(str(quantized), "float32")
    assert [o.token_ids for o in exact] == expected
    ops, _ = quantized_kernels()
    if not Float8Weight.kernels_run(ops, torch.bfloat16):
        return
    model, kept = greedy_outputs(str(quantized), "bfloat16")
    assert_greedy_follows(exact, kept)
    moe = model.model.layers[0].mlp
    assert moe.kept_grouped is None
    assert all(isinstance(e.gate_up_proj.segments[0].quantized, Float8Weight)
               for e in moe.experts)
