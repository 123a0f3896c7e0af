from __future__ import annotations

import pytest

from cpullm import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1),
    ("logprobs", -1), ("prompt_logprobs", -2), ("logprobs", 2.5), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("stop", [""]),
    ("stop_token_ids", [-1]), ("logit_bias", {1: 200.0}),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_normalization():
    params = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert params.stop == ["###"] and params.top_k == 0 and params.greedy
    assert params.max_stop_str_len == 3


def test_logprobs_past_the_engines_max_logprobs_are_refused(tiny_model):
    from cpullm import LLM

    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    llm = LLM(str(tiny_model("llama")), dtype="float32", max_model_len=64,
              kv_cache_memory_bytes=1 << 24)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name}: must be at most 20"):
            llm.generate(prompt, SamplingParams(max_tokens=1, **{name: 21}), use_tqdm=False)
    llm.llm_engine.shutdown()
    llm = LLM(str(tiny_model("llama")), dtype="float32", max_model_len=64,
              kv_cache_memory_bytes=1 << 24, max_logprobs=-1)  # the whole vocabulary
    vocab = llm.llm_engine.config.model.vocab_size
    (output,) = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=vocab),
                             use_tqdm=False)
    assert output.prompt_logprobs[0] is None
    assert all(len(entry) == vocab for entry in output.prompt_logprobs[1:])
    with pytest.raises(ValueError, match=f"logprobs: must be at most {vocab}"):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=vocab + 1), use_tqdm=False)
