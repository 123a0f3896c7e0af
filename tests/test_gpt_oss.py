"""gpt-oss beyond the golden tests (which run it as every architecture): its prompt
logprobs against transformers, and a checkpoint whose experts are MXFP4, as OpenAI ships
them, against transformers on the same weights dequantized."""

from __future__ import annotations

import json
import shutil

import torch
from conftest import hf_greedy
from safetensors.torch import load_file, save_file

from cpullm import LLM, SamplingParams
from cpullm.model_executor.models.gpt_oss import dequantize_mxfp4

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


def test_dequantize_mxfp4():
    blocks = torch.tensor([[0x21, 0xF7] + [0] * 14], dtype=torch.uint8)  # low nibble first
    scales = torch.tensor([128], dtype=torch.uint8)  # 2 ** 1
    values = dequantize_mxfp4(blocks, scales)
    assert values.shape == (32,)
    assert values[:4].tolist() == [1.0, 2.0, 12.0, -12.0]
    w = torch.randn(3, 64)
    b, s, expected = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b, s), expected)
    assert (expected - w).abs().max() < w.abs().max() / 4


def test_mxfp4_checkpoint_equals_transformers_on_its_values(tmp_path, tiny_model):
    """The experts of the tiny model stored as MXFP4 blocks and scales (with
    ``quant_method: mxfp4``): cpullm dequantizes them at load and its greedy tokens equal
    transformers' on a folder holding those values in float32."""
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

    prompts = [torch.randint(100, 2000, (n,), generator=torch.Generator().manual_seed(n))
               .tolist() for n in (9, 40)]
    expected = hf_greedy(reference, prompts, 16)
    llm = LLM(str(packed), dtype="float32", block_size=32)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                               ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    # the memory estimate (KV cache sizing) counts the experts as loaded (the float32
    # folder's values), not as packed
    assert llm.llm_engine.config.model.weight_bytes() == 4 * sum(
        t.numel() for t in tensors.values())


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
