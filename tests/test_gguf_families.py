"""GGUF files written as llama.cpp writes them: Llama 3 (q and k rows interleaved per head,
its rope scaling a rope_freqs tensor), Qwen3-MoE and
Qwen2-MoE (each projection's experts one 3-D tensor, here Q8_0; the router as
ffn_gate_inp; Qwen2-MoE's shared expert and its vector gate) and Gemma 3 (norms before and
after each block, stored as 1 + w; the rope base and scaling of its global layers in the
metadata, the rest as llama.cpp fixes it). cpullm's greedy float32 tokens equal
transformers' on the same weights (the folder the file was made from, its experts
replaced by the values the blocks hold)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import TINY, assert_kept_experts_grouped, hf_greedy, kernels_or_skip
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from cpullm import LLM, SamplingParams
from cpullm.transformers_utils import resolve_model

CONFIGS = {
    # Llama 3's rope scaling, which llama.cpp's converter stores as a rope_freqs tensor (a
    # divisor per frequency; scaled here below 64 positions, within the longer prompt)
    "llama": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    # experts of a width other than the config class's default (768): the file must say it
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48)),
    # six layers: five sliding (window 24, shorter than the longer prompt), one global with
    # linear rope scaling; the query scale of the head size, as llama.cpp takes it
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=24,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=1000000.0)})),
}
DENSE_MLP_NAMES = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", **DENSE_MLP_NAMES}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _metadata(writer: GGUFWriter, arch: str, config) -> None:
    """The default model's tokenizer and chat template, and this model's sizes."""
    reader = GGUFReader(resolve_model(None).gguf_path)
    sizes = {"embedding_length": config.hidden_size,
             "feed_forward_length": config.intermediate_size,
             "attention.head_count": config.num_attention_heads,
             "attention.head_count_kv": config.num_key_value_heads,
             "attention.key_length": getattr(config, "head_dim", None)
             or config.hidden_size // config.num_attention_heads,
             "block_count": config.num_hidden_layers, "context_length": 1024,
             "rope.freq_base": float((config.rope_parameters.get("full_attention")
                                      or config.rope_parameters)["rope_theta"]),
             "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps)}
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "llama.")) or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[1] if field.types[0] == GGUFValueType.ARRAY
                             else None)
    for key, value in sizes.items():
        kind = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
        writer.add_key_value(f"{arch}.{key}", value, kind)
    if arch == "llama":
        return
    if arch == "gemma3":
        writer.add_key_value("gemma3.attention.sliding_window", config.sliding_window,
                             GGUFValueType.UINT32)
        writer.add_key_value("gemma3.rope.scaling.type", "linear", GGUFValueType.STRING)
        writer.add_key_value("gemma3.rope.scaling.factor", 4.0, GGUFValueType.FLOAT32)
        return
    writer.add_key_value(f"{arch}.expert_count", config.num_experts, GGUFValueType.UINT32)
    writer.add_key_value(f"{arch}.expert_used_count", config.num_experts_per_tok,
                         GGUFValueType.UINT32)
    writer.add_key_value(f"{arch}.expert_feed_forward_length", config.moe_intermediate_size,
                         GGUFValueType.UINT32)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_key_value(f"{arch}.expert_shared_feed_forward_length",
                             config.shared_expert_intermediate_size, GGUFValueType.UINT32)


def _rope_freqs(config) -> np.ndarray:
    """Llama 3's rope scaling as llama.cpp's converter writes it: per frequency, 1 where
    the wavelength is short, the factor where it is long, a blend between."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    return np.where(wavelen < old / high, 1.0, np.where(
        wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth))).astype(np.float32)


def _interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows in llama.cpp's order: each head's rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.fixture(scope="module", params=list(CONFIGS))
def family_gguf(request, tmp_path_factory, tokenizer_dir) -> tuple[Path, Path]:
    """(the GGUF file, the folder with the weights it holds)."""
    arch = request.param
    cls, spec = CONFIGS[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, cls)(**{**TINY, "vocab_size": len(tokenizer), **spec})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms that are not all ones (Gemma's: not all zeros)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0 if arch == "gemma3" else 1.0, 0.1)
    folder = tmp_path_factory.mktemp(arch)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (weights_file,) = sorted(folder.glob("*.safetensors"))
    tensors = load_file(weights_file)

    path = folder.parent / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, arch, config)
    gemma = arch == "gemma3"

    def stored(name: str) -> np.ndarray:  # llama.cpp writes Gemma's norms as 1 + w
        array = tensors[name].numpy()
        return array + 1 if gemma and name.endswith("norm.weight") else array

    if arch == "llama":
        writer.add_tensor("rope_freqs.weight", _rope_freqs(config))
    writer.add_tensor("token_embd.weight", stored("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", stored("model.norm.weight"))
    if "lm_head.weight" in tensors:
        writer.add_tensor("output.weight", stored("lm_head.weight"))
    names = ({**LAYER_NAMES, **GEMMA_NAMES} if gemma else
             {**LAYER_NAMES, **DENSE_MLP_NAMES} if arch == "llama" else LAYER_NAMES)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf, gguf_name in names.items():
            for kind in ("weight", "bias"):
                if f"{prefix}{hf}.{kind}" in tensors:
                    array = stored(f"{prefix}{hf}.{kind}")
                    if hf == "mlp.shared_expert_gate":
                        array = array.reshape(-1)  # a vector in llama.cpp's files
                    if arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                        array = _interleaved(array, config.num_attention_heads
                                             if hf == "self_attn.q_proj"
                                             else config.num_key_value_heads)
                    writer.add_tensor(f"blk.{layer}.{gguf_name}.{kind}", array)
        if arch in ("gemma3", "llama"):
            continue
        for projection, gguf_name in (("gate_proj", "ffn_gate_exps"),
                                      ("up_proj", "ffn_up_exps"),
                                      ("down_proj", "ffn_down_exps")):
            experts = [f"{prefix}mlp.experts.{e}.{projection}.weight"
                       for e in range(config.num_experts)]
            stacked = np.stack([tensors[n].numpy() for n in experts])  # [experts, rows, k]
            blocks = quantize(stacked, GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", blocks,
                              raw_dtype=GGMLQuantizationType.Q8_0)
            held = dequantize(blocks, GGMLQuantizationType.Q8_0)
            for e, name in enumerate(experts):
                tensors[name] = torch.from_numpy(np.ascontiguousarray(held[e]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return path, folder


@pytest.mark.slow
def test_gguf_equals_transformers(family_gguf, tokenizer_dir):
    path, folder = family_gguf
    # (a Gemma file's tokenizer is a SentencePiece one; the test files carry SmolLM2's
    # BPE vocabulary, which the folder's tokenizer reads)
    llm = LLM(str(path), dtype="float32", block_size=32, max_model_len=256,
              tokenizer=str(tokenizer_dir) if "gemma" in path.name else None)
    config = llm.llm_engine.config.model.hf_config
    reference = json.loads((folder / "config.json").read_text())
    for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                "shared_expert_intermediate_size", "norm_topk_prob", "head_dim",
                "query_pre_attn_scalar", "sliding_window", "layer_types", "rope_parameters"):
        if key in reference and not (key == "rope_parameters" and "llama" in path.name):
            assert getattr(config, key) == reference[key], key
    if "llama" in path.name:  # its scaling as the file's factors, as llama.cpp reads it
        assert len(config.rope_freq_factors) == 8 and config.rope_freq_factors[-1] == 8.0
    prompts = [torch.randint(100, 2000, (n,), generator=torch.Generator().manual_seed(n))
               .tolist() for n in (7, 45)]
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                               ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(folder, prompts, 16)


@pytest.mark.parametrize("family_gguf", ["qwen3moe", "qwen2moe"], indirect=True)
def test_moe_gguf_keeps_its_expert_blocks(family_gguf):
    """In bfloat16 (where the quantized kernels run) each expert keeps its Q8_0 blocks."""
    from cpullm.model_executor.layers.quantization.kept import QuantizedWeight

    path, _ = family_gguf
    llm = LLM(str(path), dtype="bfloat16", block_size=32, max_model_len=256)
    model = llm.llm_engine.model_runner.model
    expert = model.model.layers[0].mlp.experts[3]
    kernels_or_skip(QuantizedWeight.kernels_run(expert.down_proj.ops, torch.bfloat16),
                    {"avx2"}, "the quantized kernels")
    assert all(s.quantized is not None for s in expert.down_proj.segments)
    assert_kept_experts_grouped(model.model.layers[0].mlp, model.config.hidden_size)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
