"""Tensor parallelism: ranks in worker processes give the greedy float32 tokens of one rank
(transformers' tokens), for every architecture, quantized layers included."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ARCHITECTURES, assert_greedy_follows, hf_greedy, quantized_kernels
from test_gguf_quant import mixed_gguf  # noqa: F401, F811 - the fixture

from cpullm import LLM, SamplingParams
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core per rank")

NUM_NEW_TOKENS = 16
PROMPT_LENS = [5, 17, 40, 71]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def make_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(100, vocab_size, (n,), generator=generator).tolist()
            for n in PROMPT_LENS]


def generate(model: str, prompts: list[list[int]], params: SamplingParams = GREEDY,
             **kwargs) -> list:
    llm = LLM(model, dtype=kwargs.pop("dtype", "float32"), block_size=32, **kwargs)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tensor_parallel_matches_transformers(arch, tiny_model):
    model = tiny_model(arch)
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(model).vocab_size)
    got = generate(str(model), prompts, tensor_parallel_size=2)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("variant", [dict(max_num_batched_tokens=7),
                                     dict(kv_cache_memory_bytes=8 * 32 * 256, max_model_len=256)],
                         ids=["chunked-prefill-7", "preemption"])
def test_tensor_parallel_with_chunks_and_preemption(variant, tiny_model):
    model = tiny_model("llama")
    prompts = make_prompts(49152)
    got = generate(str(model), prompts, tensor_parallel_size=2, **variant)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


def test_fewer_kv_heads_than_ranks(tiny_model, monkeypatch):
    """Four ranks, two KV heads: each KV head is held by two ranks, one query head each."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # four ranks on two cores
    model = tiny_model("qwen2")
    prompts = make_prompts(49152)[:2]
    got = generate(str(model), prompts, tensor_parallel_size=4)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, NUM_NEW_TOKENS)


def test_gptq_layers_split_over_ranks(tmp_path, tokenizer_dir):
    """A GPTQ checkpoint's integer groups split by rows (q/k/v, gate/up) and by whole groups
    of columns (o, down): in float32, dequantized, exactly the reference's tokens; in
    bfloat16, kept quantized, following one rank's tokens."""
    from test_int_groups import PROMPTS, write_checkpoint

    quantized, reference = write_checkpoint(tmp_path, tokenizer_dir, "gptq", 4, 64, False,
                                            False)
    expected = hf_greedy(reference, PROMPTS, NUM_NEW_TOKENS)
    got = generate(str(quantized), PROMPTS, tensor_parallel_size=2, max_model_len=256)
    assert [o.token_ids for o in got] == expected
    ops, _ = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    one = generate(str(quantized), PROMPTS, params, dtype="bfloat16", max_model_len=256)
    two = generate(str(quantized), PROMPTS, params, dtype="bfloat16", max_model_len=256,
                   tensor_parallel_size=2)
    assert_greedy_follows(one, two)


def test_heads_that_do_not_split_are_refused():
    """The default model has 9 attention heads: not for 2 ranks."""
    with pytest.raises(ValueError, match="9 attention heads do not split over 2 ranks"):
        LLM(None, tensor_parallel_size=2)


def test_gguf_blocks_split_over_ranks(mixed_gguf):  # noqa: F811
    """A file mixing K-quant and legacy blocks: rows split for q/k/v and gate/up, whole
    blocks of columns (256 weights for Q6_K) for o and down, the Q8_0 embedding table by
    vocabulary rows: float32 (dequantized) exactly one rank's tokens, bfloat16 (kept
    quantized) following them."""
    prompts = [[1, 2, 3, 4, 5], [100, 2000, 30000, 7]]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    kwargs = dict(max_model_len=256, kv_cache_memory_bytes=1 << 24)
    one = generate(str(mixed_gguf), prompts, params, **kwargs)
    two = generate(str(mixed_gguf), prompts, params, tensor_parallel_size=2, **kwargs)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    ops, _ = quantized_kernels()
    if not QuantizedWeight.kernels_run(ops, torch.bfloat16):
        return
    one = generate(str(mixed_gguf), prompts, params, dtype="bfloat16", **kwargs)
    two = generate(str(mixed_gguf), prompts, params, dtype="bfloat16", tensor_parallel_size=2,
                   **kwargs)
    assert_greedy_follows(one, two)
