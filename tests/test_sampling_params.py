from __future__ import annotations

import pytest

from cpullm import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1),
    ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 100), ("presence_penalty", 3.0),
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
