"""Incremental detokenization: multi-byte characters and stop strings across tokens."""

from __future__ import annotations

import pytest

from cpullm.engine.detokenizer import IncrementalDetokenizer
from cpullm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def feed(tokenizer, text: str, params: SamplingParams, prompt: str = "Say:"):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    ids = tokenizer.encode(text)
    deltas, stop = [], None
    for token in ids:
        stop = detok.update([token], skip_last=False)
        deltas.append(detok.delta(finished=stop is not None))
        if stop:
            break
    return detok, "".join(deltas), stop, ids


def test_multibyte_utf8_never_splits_a_character(tokenizer):
    text = "naïve café 北京欢迎你 🙂👍🏽 done"
    detok, streamed, _, ids = feed(tokenizer, text, SamplingParams())
    assert len(ids) > len(text.split())  # several characters span several tokens
    assert detok.output_text == text and streamed == text
    assert "\ufffd" not in streamed


def test_stop_string_spanning_tokens(tokenizer):
    text = "alpha beta gamma delta epsilon"
    params = SamplingParams(stop=["ma del"])
    detok, streamed, stop, _ = feed(tokenizer, text, params)
    assert stop == "ma del"
    assert detok.output_text == "alpha beta gam" and streamed == "alpha beta gam"
    params = SamplingParams(stop=["ma del"], include_stop_str_in_output=True)
    detok, _, _, _ = feed(tokenizer, text, params)
    assert detok.output_text == "alpha beta gamma del"


def test_streaming_holds_back_possible_stop_prefix(tokenizer):
    params = SamplingParams(stop=["STOP NOW"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    for token in tokenizer.encode("hello STOP"):
        detok.update([token], skip_last=False)
    # "STOP" may still become "STOP NOW": the last 7 characters are kept back.
    assert detok.delta(finished=False) == "hel"
    assert detok.delta(finished=True) == "lo STOP"
