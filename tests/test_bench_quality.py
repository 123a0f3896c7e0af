"""``cpullm bench quality``: its figures against the same figures computed by hand from
transformers' logits, on tiny random models whose vocabulary the top k covers (so the KL
divergence is the exact one)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cpullm.benchmarks.quality import Reference

CLI = [sys.executable, "-m", "cpullm.entrypoints.cli", "bench", "quality"]
ENGINE = ["--block-size", "32", "--max-model-len", "128"]
WORDS = ("the a of to and in is it that was for on are with as be at by this had not but "
         "from or have an they which one you were all we her she there would their will "
         "when who him been has more if no out so said what up its about than into them "
         "can only other new some could time these two may then do first any my now").split()
WINDOWS, WINDOW_LEN = 3, 40


def make_model(path: Path, seed: int) -> Path:
    """A tiny Llama with a word-level vocabulary of WORDS (and an unknown token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.1,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Two models of one vocabulary, and a text of their words."""
    root = tmp_path_factory.mktemp("quality")
    rng = random.Random(0)
    text = root / "text.txt"
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(WINDOWS * WINDOW_LEN + 50)))
    return make_model(root / "a", 0), make_model(root / "b", 1), text


def quality(args: list[str]) -> dict:
    result = subprocess.run(CLI + args + ENGINE + ["--json"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def by_hand(reference: Path, candidate: Path, token_ids: np.ndarray) -> dict[str, float]:
    """The figures from transformers' float32 logits over the whole vocabulary."""
    from transformers import AutoModelForCausalLM

    def logprobs(folder: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor(token_ids)).logits.double()
        # the distributions over positions score_from.. (given the tokens before each)
        return torch.log_softmax(logits, -1)[:, WINDOW_LEN // 2 - 1:-1]

    ref, cand = logprobs(reference), logprobs(candidate)
    targets = torch.tensor(token_ids[:, WINDOW_LEN // 2:])[..., None]
    kl = (ref.exp() * (ref - cand)).sum(-1)
    ppl_ref = ref.gather(-1, targets).mean().neg().exp().item()
    ppl = cand.gather(-1, targets).mean().neg().exp().item()
    return {"perplexity": ppl, "reference_perplexity": ppl_ref,
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "kl_p99": float(np.percentile(kl.numpy(), 99)),
            "top1_agreement": (ref.argmax(-1) == cand.argmax(-1)).double().mean().item()}


def test_float32_against_itself_and_its_saved_reference_is_exact(models, tmp_path):
    a, _, text = models
    saved = tmp_path / "a.npz"
    first = quality([str(a), "--dtype", "float32", "--text", str(text), "--windows",
                     str(WINDOWS), "--window-len", str(WINDOW_LEN),
                     "--save-reference", str(saved)])
    again = quality([str(a), "--dtype", "float32", "--reference", str(saved)])
    for figures in (first, again):
        assert figures["positions"] == WINDOWS * WINDOW_LEN // 2
        assert figures["kl_mean"] == figures["kl_max"] == 0.0
        assert figures["top1_agreement"] == 1.0
        assert figures["perplexity_drift"] == 0.0
        assert figures["top_k"] == len(WORDS) + 1  # the whole vocabulary
    assert again["perplexity"] == first["perplexity"]
    assert again["text_sha256"] == first["text_sha256"]


def test_figures_equal_those_computed_from_transformers_logits(models, tmp_path):
    a, b, text = models
    saved = tmp_path / "a.npz"
    quality([str(a), "--dtype", "float32", "--text", str(text), "--windows", str(WINDOWS),
             "--window-len", str(WINDOW_LEN), "--save-reference", str(saved)])
    token_ids = Reference.load(str(saved)).token_ids
    assert token_ids.shape == (WINDOWS, WINDOW_LEN)
    figures = quality([str(b), "--dtype", "float32", "--reference", str(saved)])
    expected = by_hand(a, b, token_ids)
    assert figures["kl_mean"] > 0.01 and figures["top1_agreement"] < 1.0  # models differ
    for name, value in expected.items():
        assert figures[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert figures["perplexity_drift"] == pytest.approx(
        expected["perplexity"] / expected["reference_perplexity"] - 1, rel=1e-3)


def test_bfloat16_is_measured_against_float32_by_default(models):
    a, _, text = models
    figures = quality([str(a), "--dtype", "bfloat16", "--text", str(text), "--windows", "2",
                       "--window-len", "32"])
    assert figures["reference"].endswith("in float32")
    assert figures["candidate"].endswith("in bfloat16")
    assert figures["positions"] == 2 * 16
    assert 0 < figures["kl_mean"] < 0.01
    assert figures["top1_agreement"] > 0.9


def test_a_quantized_kv_cache_is_measured_against_the_bfloat16_cache(models):
    """--reference bfloat16 runs the same flags in bfloat16 with the KV cache unquantized:
    an int8 cache read in one-token steps strays a little from it, never by nothing."""
    a, _, text = models
    figures = quality([str(a), "--dtype", "bfloat16", "--kv-cache-dtype", "int8",
                       "--reference", "bfloat16", "--max-num-batched-tokens", "1", "--text",
                       str(text), "--windows", "2", "--window-len", "32"])
    assert figures["reference"].endswith("in bfloat16")
    assert figures["candidate"].endswith("in bfloat16, KV cache int8")
    assert 0 < figures["kl_mean"] < 0.01
    assert figures["top1_agreement"] > 0.9


def test_a_reference_of_another_vocabulary_is_refused(models, tmp_path):
    a, _, text = models
    saved = tmp_path / "a.npz"
    quality([str(a), "--dtype", "float32", "--text", str(text), "--windows", "1",
             "--window-len", "16", "--save-reference", str(saved)])
    with np.load(saved) as data:
        fields = dict(data)
    fields["vocab_size"] = np.array(1000)
    np.savez(saved, **fields)
    result = subprocess.run(CLI + [str(a), "--reference", str(saved)] + ENGINE,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "vocabulary of 1000 tokens" in result.stderr
    not_a_reference = tmp_path / "x.npz"
    not_a_reference.write_bytes(b"not a file of numbers")
    result = subprocess.run(CLI + [str(a), "--reference", str(not_a_reference)] + ENGINE,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--reference: cannot read" in result.stderr


def requantize(source: str, path: Path, qtype_name: str) -> Path:
    """The GGUF file ``source`` with every matrix requantized to another type (gguf's own
    quantizers, or tests/kquants.py's for K-quants, from the weights dequantized); metadata
    and vectors as they are. K-quants take the matrices whose rows are whole super-blocks
    of 256 (the default model's down projections); as in llama.cpp's files, the others keep
    a legacy type: the one they have."""
    import gguf
    from gguf.quants import dequantize, quantize
    from kquants import QK_K, QUANTIZERS, quantize_k

    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # (written by the writer itself)
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # [rows, columns]
        if len(shape) < 2:
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        if qtype in QUANTIZERS and shape[1] % QK_K:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=tensor.data.shape,
                              raw_dtype=tensor.tensor_type)
            continue
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        blocks = quantize_k(values, qtype) if qtype in QUANTIZERS else quantize(values, qtype)
        writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The least top-1 agreement with the same file in float32 (the default text, 4 windows of
# 256 tokens, prompt steps) on any kernel path, and the most mean KL divergence: the lowest
# and highest of the paths an AMX Xeon runs (AMX, AVX-512 and AVX2 libraries; float32
# logits), with ~1.5 points of top-1 and ~40% of KL to spare. The K-quants are
# tests/kquants.py's, on the down projections (docs/quantization.md, "Fidelity").
# the types whose quality the AVX2 library is checked for too: one per kernel family
# (legacy 4-bit, K-quant, 8-bit); its kernels of the others are checked against the
# dequantized weights in test_gguf_quant
AVX2_CHECKED = ("Q4_0", "Q4_K", "Q8_0")
FLOORS = {"Q4_0": (0.945, 0.0035), "Q4_1": (0.965, 0.0031), "Q8_0": (0.955, 0.0032),
          "Q4_K": (0.95, 0.0032), "Q5_K": (0.95, 0.0033), "Q6_K": (0.96, 0.003)}


@pytest.mark.slow
@pytest.mark.parametrize("qtype", sorted(FLOORS))
def test_every_kernel_path_keeps_each_type_above_its_floor(qtype, tmp_path):
    import os

    from cpullm.model_executor.layers.kernel_build import ISA_LEVELS
    from cpullm.platform.cpu import cpu_info
    from cpullm.transformers_utils import resolve_model

    source = resolve_model(None).gguf_path
    model = source if qtype == "Q4_1" else str(requantize(source, tmp_path / f"{qtype}.gguf",
                                                           qtype))
    # every kernel library this CPU runs; without one (not x86), the torch path it falls to.
    # Where the default library runs the VNNI dot products at every number of rows (no AMX,
    # BF16 dot products no faster: QuantizedWeight.kernel_for), the AVX-512 one runs the
    # same kernels: the default and AVX2 then cover every path.
    levels = [level.name for level in ISA_LEVELS if level.needs <= cpu_info().flags] or [""]
    info = cpu_info()
    if len(levels) == 3 and "amx_bf16" not in info.flags and not info.bf16_dots_outrun_vnni:
        levels = [levels[0], levels[2]]
    if qtype not in AVX2_CHECKED and len(levels) > 1:  # the AVX2 library once per family
        levels = [level for level in levels if level != "avx2"]
    saved = tmp_path / "reference.npz"
    least_top1, most_kl = FLOORS[qtype]
    for level in reversed(levels):  # the default path first: it saves the reference
        args = ["--reference", str(saved)] if saved.exists() else \
            ["--windows", "4", "--window-len", "256", "--save-reference", str(saved)]
        result = subprocess.run(CLI + [model, "--max-model-len", "512", "--json", *args],
                                capture_output=True, text=True, timeout=600,
                                env={**os.environ, "CPULLM_KERNEL_ISA": level})
        assert result.returncode == 0, result.stderr[-3000:]
        figures = json.loads(result.stdout)
        print(qtype, level, figures["top1_agreement"], figures["kl_mean"])
        assert figures["top1_agreement"] >= least_top1, (level, figures)
        assert figures["kl_mean"] <= most_kl, (level, figures)
