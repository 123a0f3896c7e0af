"""Greedy float32 tokens equal Hugging Face transformers' generate, token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, assert_pool_free, hf_greedy

from cpullm import LLM, SamplingParams

NUM_NEW_TOKENS = 32
PROMPT_LENS = [5, 17, 40, 71, 130]


def make_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(100, vocab_size, (n,), generator=generator).tolist()
            for n in PROMPT_LENS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

# name -> LLM keyword arguments; block size 32 so that prompts span several blocks
VARIANTS = {
    "default": dict(),
    "chunked-prefill-7": dict(max_num_batched_tokens=7),
    "preemption": dict(kv_cache_memory_bytes=8 * 32 * 512, max_model_len=256),
    "no-prefix-cache": dict(enable_prefix_caching=False),
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def golden(request, tiny_model):
    model_dir = tiny_model(request.param)
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(model_dir).vocab_size)
    return model_dir, prompts, hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)


# every architecture on the default settings in the fast tier, the other settings (covered
# there by the scheduler's and the KV cache's own tests) in the full suite
@pytest.mark.parametrize("variant", ["default", *(pytest.param(name, marks=pytest.mark.slow)
                                                  for name in VARIANTS if name != "default")])
def test_greedy_matches_transformers(golden, variant):
    model_dir, prompts, expected = golden
    llm = LLM(str(model_dir), dtype="float32", block_size=32, **VARIANTS[variant])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} (len {PROMPT_LENS[i]}) differs from transformers"
    if variant == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_free(llm)


def test_batch_equals_singles(tiny_model):
    llm = LLM(str(tiny_model("llama")), dtype="float32", block_size=32)
    prompts = make_prompts(llm.llm_engine.config.model.vocab_size)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == singles
    assert_pool_free(llm)


def test_prefix_cache_hits_give_same_tokens(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), dtype="float32", block_size=32)
    prefix = make_prompts(llm.llm_engine.config.model.vocab_size)[-1]  # 130 tokens
    prompts = [prefix + [500 + i] * (i + 1) for i in range(3)]
    first = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 128 for o in rest)
    uncached = LLM(str(tiny_model("qwen3")), dtype="float32", block_size=32,
                   enable_prefix_caching=False)
    expected = uncached.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == [
        o.outputs[0].token_ids for o in expected]
    assert len(set(map(tuple, (o.outputs[0].token_ids for o in expected)))) > 1
    assert_pool_free(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "glm4", "gemma2", "gemma3",
                                  "gpt_oss"])
def test_kernels_equal_enforce_eager(tiny_model, arch):
    model_dir = str(tiny_model(arch))
    prompts = make_prompts(2048)
    compiled = LLM(model_dir, dtype="float32", block_size=32)
    eager = LLM(model_dir, dtype="float32", block_size=32, enforce_eager=True)
    assert compiled.llm_engine.model_runner.model.model.layers[0].self_attn.attn.ops is not None
    assert eager.llm_engine.model_runner.model.model.layers[0].self_attn.attn.ops is None
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, GREEDY, use_tqdm=False)]
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected


def test_bfloat16_close_to_eager_and_float32(tiny_model):
    """bfloat16 (compiled kernels, prepacked GEMMs) against bfloat16 eager torch ops: close
    logprobs; against float32: the same favourite token at almost every position."""
    model_dir = str(tiny_model("llama"))
    prompts = make_prompts(2048)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)

    def favourites(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [min(entry.items(), key=lambda kv: kv[1].rank)
                for o in outputs for entry in o.prompt_logprobs[1:]]

    bf16 = LLM(model_dir, dtype="bfloat16", block_size=32)
    assert bf16.llm_engine.model_runner.model.model.layers[0].mlp.gate_up_proj.gemm is not None
    fast = favourites(bf16)
    eager = favourites(LLM(model_dir, dtype="bfloat16", block_size=32, enforce_eager=True))
    fp32 = favourites(LLM(model_dir, dtype="float32", block_size=32))
    same_as_eager = [(a, b) for a, b in zip(fast, eager, strict=True) if a[0] == b[0]]
    assert len(same_as_eager) / len(fast) > 0.95
    assert max(abs(a[1].logprob - b[1].logprob) for a, b in same_as_eager) < 0.3
    assert sum(a[0] == b[0] for a, b in zip(fast, fp32, strict=True)) / len(fast) > 0.9


def test_unsupported_architecture_is_named(tmp_path, tokenizer_dir):
    import shutil

    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path), dtype="float32", block_size=32, max_model_len=64)


@pytest.mark.parametrize("arch", ["granite", "gemma2", "gemma3", "phi3", "qwen3_moe",
                                  "qwen2_moe", "gpt_oss"])
def test_prompt_logprobs_match_transformers(tiny_model, arch):
    """What greedy tokens may not show: Granite's logits scaling, the Gemmas' soft-caps and the
    windows of their sliding layers and Phi-3's (the prompt is longer than both), the MoE
    routing weights and the shared expert's gate, gpt-oss's sinks, biases and clipping."""
    from transformers import AutoModelForCausalLM

    model_dir = str(tiny_model(arch))
    prompt = make_prompts(2048)[3]  # 71 tokens
    llm = LLM(model_dir, dtype="float32", block_size=32)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        token = prompt[i + 1]
        assert abs(entry[token].logprob - float(logits[i, token])) < 1e-3, i


def test_longrope_tables_hold_the_short_then_the_long_factors(tiny_model):
    """As transformers' rotary embedding computes them: the short factors for the positions
    of a sequence within original_max_position_embeddings (256), the long factors for every
    position of a longer one (at table index 256 + position)."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from cpullm.model_executor.layers.rotary import RotaryEmbedding

    config = AutoConfig.from_pretrained(tiny_model("phi3"))
    head_dim = config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding(config, head_dim, 1024)
    assert ours.rotary_dim == head_dim // 2 and ours.cos.shape[0] == 256 + 1024
    theirs = Phi3RotaryEmbedding(config)
    for position in (0, 100, 255):  # a short sequence
        cos, sin = theirs(torch.zeros(1), torch.tensor([[position]]))
        assert torch.allclose(ours.cos[position], cos[0, 0], atol=1e-6), position
        assert torch.allclose(ours.sin[position], sin[0, 0], atol=1e-6), position
    for position in (0, 100, 255, 256, 300, 1023):  # a long one: its last position is 1023
        cos, sin = theirs(torch.zeros(1), torch.tensor([[position, 1023]]))
        assert torch.allclose(ours.cos[256 + position], cos[0, 0], atol=1e-6), position
        assert torch.allclose(ours.sin[256 + position], sin[0, 0], atol=1e-6), position
    assert not torch.allclose(ours.cos[100], ours.cos[256 + 100], atol=1e-3)


def test_longrope_sequences_that_outgrow_the_pretraining_length(tiny_model):
    """Greedy tokens equal transformers' for a prompt past original_max_position_embeddings
    (long factors from the start), one that outgrows it while decoding (recomputed on the
    long factors, as transformers recomputes it) and a short one, in one batch."""
    model_dir = str(tiny_model("phi3"))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 2000, (n,), generator=generator).tolist()
               for n in (300, 248, 40)]
    expected = hf_greedy(model_dir, prompts, 16)
    llm = LLM(model_dir, dtype="float32", block_size=32, max_num_batched_tokens=128)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                               ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert_pool_free(llm)
