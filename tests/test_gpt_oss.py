"""gpt-oss beyond the golden tests (which run it as every architecture): its prompt
logprobs against transformers, and a checkpoint whose experts are MXFP4, as OpenAI ships
them, against transformers on the same weights dequantized (float32), and kept quantized
(bfloat16) against the same weights dense."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_greedy_follows,
    assert_kept_experts_grouped,
    hf_greedy,
    kernels_or_skip,
    quantized_kernels,
)
from safetensors.torch import load_file, save_file

from cpullm import LLM, SamplingParams
from cpullm.model_executor.layers.ops import ISA_LEVELS
from cpullm.model_executor.layers.quantization.mxfp4 import Mxfp4Scheme

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., k] -> (blocks [..., k/32, 16] uint8, scales [..., k/32] uint8, the values they
    hold [..., k]): a power of two per 32 values, each value the nearest e2m1 multiple."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - FP4).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    values = (FP4[codes] * torch.exp2(exponent)[..., None]).reshape(w.shape)
    return blocks, (exponent + 127).to(torch.uint8), values


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, groups, _ = blocks.shape
    unpacked = Mxfp4Scheme().unpack({"weight_blocks": blocks, "weight_scales": scales}, rows,
                                    groups * 32)
    return unpacked.dequantize()


def test_mxfp4_as_8bit_groups():
    """The blocks kept exactly as 8-bit groups: q = 128 + 2 e2m1, s = 2^(e - 128)."""
    blocks = torch.tensor([[[0x21, 0xF7] + [0] * 14]], dtype=torch.uint8)  # low nibble first
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** 1
    values = dequantize_mxfp4(blocks, scales)
    assert values.shape == (1, 32)
    assert values[0, :4].tolist() == [1.0, 2.0, 12.0, -12.0]
    w = torch.randn(3, 64) * torch.tensor([1e-30, 1.0, 1e30])[:, None]  # far exponents too
    b, s, expected = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b, s), expected)
    assert ((expected - w).abs().amax(1) < w.abs().amax(1) / 4).all()
    with pytest.raises(ValueError, match="do not fit"):
        Mxfp4Scheme().unpack({"weight_blocks": b, "weight_scales": s}, 3, 32)


def mxfp4_checkpoint(tmp_path, tiny_model) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The tiny model's experts stored as MXFP4 blocks and scales (with ``quant_method:
    mxfp4``), and a reference folder holding their values as float32 weights: (reference,
    packed, the reference's tensors)."""
    source = tiny_model("gpt_oss")
    reference, packed = tmp_path / "reference", tmp_path / "mxfp4"
    shutil.copytree(source, reference)
    shutil.copytree(source, packed)
    (weights_file,) = sorted(reference.glob("*.safetensors"))
    tensors = load_file(weights_file)
    quantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj",
                                                  "experts.down_proj"))]:
        # stored [experts, in, out]; MXFP4 blocks run along the input, [experts, out, in]
        blocks, scales, values = quantize_mxfp4(tensors[name].transpose(1, 2))
        tensors[name] = values.transpose(1, 2).contiguous()
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    assert len(quantized) == 8  # two layers, two projections, blocks and scales
    save_file(tensors, weights_file, metadata={"format": "pt"})
    packed_tensors = {n: t for n, t in tensors.items()
                      if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**packed_tensors, **quantized}, packed / weights_file.name,
              metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    return reference, packed, tensors


PROMPTS = [torch.randint(100, 2000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (9, 40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)


def test_mxfp4_checkpoint_equals_transformers_on_its_values(tmp_path, tiny_model):
    """In float32 (no quantized kernels) the experts are dequantized at load, exactly: the
    greedy tokens equal transformers' on the folder of their values."""
    reference, packed, tensors = mxfp4_checkpoint(tmp_path, tiny_model)
    expected = hf_greedy(reference, PROMPTS, 16)
    llm = LLM(str(packed), dtype="float32", block_size=32)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    # the memory estimate (KV cache sizing) counts the experts as loaded (the float32
    # folder's values), not as packed
    assert llm.llm_engine.config.model.weight_bytes == 4 * sum(
        t.numel() for t in tensors.values())


def test_mxfp4_experts_kept_quantized_in_bfloat16(tmp_path, tiny_model):
    """In bfloat16 with the quantized kernels the experts stay quantized (8-bit groups of
    32, read by the int8 kernels), follow the float32 run of the same weights, and the
    memory estimate counts them as kept."""
    from cpullm.model_executor.layers.quantization.kept import QuantizedWeight

    ops, _ = quantized_kernels()
    kernels_or_skip(QuantizedWeight.kernels_run(ops, torch.bfloat16), set(ISA_LEVELS[0].needs),
                    "the quantized kernels")
    reference, packed, _ = mxfp4_checkpoint(tmp_path, tiny_model)
    exact = LLM(str(reference), dtype="float32", block_size=32).generate(
        PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(packed), dtype="bfloat16", block_size=32)
    model = llm.llm_engine.model_runner.model
    weights = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert len(weights) == 2 * 8 * 2  # layers, experts, projections (gate-up one weight)
    assert all(w.origin == "MXFP4" and w.fmt.bits == 8 and w.fmt.block == 32
               for w in weights)
    down = model.model.layers[0].mlp.experts[0].down_proj
    assert "cpullm int8 dot products" in down.method.describe(down)
    assert_kept_experts_grouped(model.model.layers[0].mlp, model.config.hidden_size)
    kept = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_follows([o.outputs[0] for o in exact], [o.outputs[0] for o in kept])
    held = sum(t.numel() * t.element_size() for w in weights
               for t in (w.data, w.scales, w.mins) if t is not None)
    # the estimate: the files, and the MXFP4 tensors once more (8-bit codes, 2-byte scales)
    from cpullm.model_executor.loader.safetensors_loader import mxfp4_bytes

    files = [str(f) for f in packed.glob("*.safetensors")]
    packed_bytes = mxfp4_bytes(files)
    assert llm.llm_engine.config.model.weight_bytes == \
        sum(f.stat().st_size for f in packed.glob("*.safetensors")) + packed_bytes
    assert abs(held - 2 * packed_bytes) <= 0.15 * 2 * packed_bytes, (held, packed_bytes)


def test_bfloat16_kernels_apply_the_sinks(tiny_model):
    """In bfloat16 the compiled paths (the prompt softmax kernel, the decode kernel) apply
    the sinks as the eager torch paths do: close prompt logprobs, and the same greedy
    continuation."""
    model_dir = str(tiny_model("gpt_oss"))
    prompt = torch.randint(100, 2000, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def logprobs(llm):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return torch.tensor([entry[prompt[i + 1]].logprob
                             for i, entry in enumerate(out.prompt_logprobs[1:])])

    compiled = LLM(model_dir, dtype="bfloat16", block_size=32)
    assert compiled.llm_engine.model_runner.model.model.layers[0].self_attn.attn.ops is not None
    eager = LLM(model_dir, dtype="bfloat16", block_size=32, enforce_eager=True)
    fp32 = LLM(model_dir, dtype="float32", block_size=32, enforce_eager=True)
    fast, slow, exact = logprobs(compiled), logprobs(eager), logprobs(fp32)
    assert (fast - slow).abs().max() < 0.15
    assert (fast - exact).abs().mean() < 0.1 and (fast - exact).abs().max() < 0.5
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = compiled.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    b = eager.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
