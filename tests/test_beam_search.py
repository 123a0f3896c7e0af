"""Beam search: token-exact against transformers' generate(num_beams=...) in float32, with
an end-of-sequence token the beams meet; its prefix blocks shared through the cache; and
use_beam_search through /v1/completions."""

from __future__ import annotations

import httpx
import pytest
import torch

from cpullm.beam_search import BeamSearch, BeamSearchParams

MAX_TOKENS = 10
PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 7], list(range(40, 110))]


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """The tiny llama with, as its end-of-sequence token, the one greedy decoding writes
    third after the first prompt: beams meet it, and finish on it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=3, eos_token_id=None)
    model.config.eos_token_id = int(greedy[0, -1])
    model.generation_config.eos_token_id = model.config.eos_token_id
    path = tmp_path_factory.mktemp("beam-eos")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def llm(eos_model):
    from cpullm import LLM

    return LLM(model=str(eos_model[0]), dtype="float32", max_model_len=256, block_size=32,
               kv_cache_memory_bytes=1 << 24)


def hf_beams(model, prompt, width, length_penalty, eos_ids):
    ids = torch.tensor([prompt])
    pad = next(t for t in range(model.config.vocab_size) if t not in eos_ids)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         num_beams=width, num_return_sequences=width,
                         max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                         early_stopping=False, eos_token_id=sorted(eos_ids), pad_token_id=pad)
    return [row[len(prompt):].tolist() for row in out], pad


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (2, 1.0), (4, 1.0), (4, 2.0)])
def test_beams_equal_transformers(llm, eos_model, width, length_penalty):
    from conftest import assert_pool_free

    eos_ids = llm.llm_engine.frontend.eos_token_ids
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS,
                                               length_penalty=length_penalty))
    finished_on_eos = 0
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected, pad = hf_beams(eos_model[1], prompt, width, length_penalty, eos_ids)
        assert len(result.sequences) == width
        for beam, row in zip(result.sequences, expected, strict=True):
            generated = beam.tokens[len(prompt):]
            assert beam.tokens[:len(prompt)] == prompt
            # (transformers pads a sequence that ended early: with pad or an EOS id)
            assert row[:len(generated)] == generated
            assert set(row[len(generated):]) <= {pad, *eos_ids}
            assert beam.cum_logprob == pytest.approx(
                sum(lp.logprob for entry in beam.logprobs for lp in entry.values()))
            finished_on_eos += beam.finish_reason == "stop"
            assert (beam.finish_reason == "stop") == (generated[-1] in eos_ids)
        scores = [beam.score for beam in result.sequences]
        assert scores == sorted(scores, reverse=True)
    # the end-of-sequence path was taken (a length penalty of 2 favours the long beams)
    assert finished_on_eos or length_penalty > 1
    assert_pool_free(llm)


def test_beams_share_their_prefix_blocks(llm):
    manager = llm.llm_engine.scheduler.kv_cache_manager
    before = manager.num_hits
    llm.beam_search([{"prompt_token_ids": PROMPTS[2]}],
                    BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True))
    # each step after the first finds at least the prompt's two full blocks, per beam
    assert manager.num_hits - before >= 3 * 4 * 64


def test_bad_beam_parameters_are_refused(llm):
    with pytest.raises(ValueError, match="beam_width: must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="--max-logprobs"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="maximum model length"):
        llm.beam_search([[1] * 250], BeamSearchParams(beam_width=2, max_tokens=10))


def test_the_search_stops_once_no_beam_can_win():
    """Both finished places filled by beams no running one can beat: done before
    max_tokens."""
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=50), {0})
    search.advance([{0: -0.1, 5: -3.0, 6: -4.0, 7: -5.0}])  # EOS first: finished
    assert not search.done and len(search.finished) == 1
    search.advance([{0: -0.2, 8: -4.0, 9: -5.0, 10: -6.0},
                    {0: -0.3, 11: -4.0, 12: -6.0, 13: -7.0}])
    assert search.done and search.generated == 2
    assert [b.tokens for b in search.finished] == [[1, 0], [1, 5, 0]]


def test_use_beam_search_in_completions(eos_model, llm):
    from server_utils import RemoteServer

    expected = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}],
                               BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))[0]
    server = RemoteServer([str(eos_model[0]), "--dtype", "float32", "--max-model-len", "256",
                           "--block-size", "32"])
    try:
        url = f"{server.url}/v1/completions"
        body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "use_beam_search": True,
                "n": 3}
        answer = httpx.post(url, json=body, timeout=60).json()
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == [b.text for b in expected.sequences]
        assert [c["finish_reason"] for c in choices] == \
            [b.finish_reason for b in expected.sequences]
        assert answer["usage"]["completion_tokens"] == sum(
            len(b.tokens) - len(PROMPTS[1]) for b in expected.sequences)
        streamed = httpx.post(url, json={**body, "stream": True}, timeout=60).text
        assert streamed.count('"text"') == 3 and streamed.endswith("data: [DONE]\n\n")
        bad = httpx.post(url, json={**body, "n": 11}, timeout=60)
        assert bad.status_code == 400 and "--max-logprobs" in bad.json()["error"]["message"]
        bad = httpx.post(url, json={**body, "temperature": 0.5, "best_of": 2}, timeout=60)
        assert bad.status_code == 400
        metrics = server.metrics()
        assert metrics["cpullm:api_requests_total"] == 4
        assert metrics["cpullm:beam_search_requests_total"] == 2
        server.wait_idle()
    finally:
        server.stop()
