"""Sampling features through the real engine on a tiny random model."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_pool_free

from cpullm import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("llama")), dtype="float32", block_size=32)


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone = tokens(llm.generate(PROMPTS[0], params, use_tqdm=False))
    assert tokens(llm.generate(PROMPTS[0], params, use_tqdm=False)) == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = [params, unseeded, unseeded]
    batched = tokens(llm.generate(PROMPTS, batch, use_tqdm=False)[:1])
    assert tokens(llm.generate(PROMPTS, batch, use_tqdm=False)[:1]) == batched
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20,
                                ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[0], other_seed, use_tqdm=False)) != alone
    assert_pool_free(llm)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("top_p,others_top_p", [(0.9, 1.0), (1.0, 0.8)])
def test_seeded_row_does_not_depend_on_the_batch(compiled, top_p, others_top_p):
    """Given the same logits, a seeded row draws the same tokens alone and next to rows
    with other parameters (which may take the other sampling path). Through the whole
    engine this holds only as far as the model's logits do not depend on the batch: float
    GEMMs of different row counts may round differently."""
    from cpullm.model_executor.layers.ops import load_ops
    from cpullm.worker.sampler import Sampler, SamplingBatch

    vocab = 1000
    sampler = Sampler(vocab, set(), load_ops() if compiled else None)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 2
    seeded = SamplingParams(temperature=0.9, top_p=top_p, seed=42)
    other = SamplingParams(temperature=1.0, top_p=others_top_p, top_k=50)

    def draws(rows: int) -> list[int]:
        generator = torch.Generator().manual_seed(42)
        params = [seeded] + [other] * (rows - 1)
        out = []
        for _ in range(20):
            batch = SamplingBatch(params, [[1]] * rows, [[]] * rows,
                                  [generator] + [None] * (rows - 1))
            out.append(sampler(logits[:rows], batch)[0][0])
        return out

    assert draws(1) == draws(3)
    assert len(set(draws(1))) > 1  # it does sample


def test_top_k_1_is_greedy(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, greedy, use_tqdm=False)) == tokens(
        llm.generate(PROMPTS, top1, use_tqdm=False))


def test_n_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert_pool_free(llm)


def test_max_tokens_and_length_finish(llm):
    (output,) = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5
    assert output.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = tokens(llm.generate(PROMPTS[2], greedy, use_tqdm=False))[0]
    stop_at = reference[3]
    first = reference.index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at])
    (output,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == reference[:first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    # min_tokens masks the stop token until enough tokens exist.
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                            min_tokens=first + 2)
    (output,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert stop_at not in output.outputs[0].token_ids[:first + 2]


def test_stop_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 12
    stop = text[5:9]  # spans token boundaries in general
    cut = text.index(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert completion.text == text[:cut + (len(stop) if include else 0)]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert_pool_free(llm)


def test_logprobs_match_model_distribution(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3  # the chosen token is also the top-1
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:], strict=False))
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs,
                                         strict=True)))
    prompt_lps = output.prompt_logprobs
    assert len(prompt_lps) == len(output.prompt_token_ids) and prompt_lps[0] is None
    for token, entry in zip(output.prompt_token_ids[1:], prompt_lps[1:], strict=True):
        assert token in entry and entry[token].logprob <= 0.0 and entry[token].rank >= 1


def test_logprobs_agree_with_transformers(llm, tiny_model):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (output,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    ids = torch.tensor([output.prompt_token_ids])
    logprobs = torch.log_softmax(model(ids).logits[0], dim=-1)
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        token = output.prompt_token_ids[position + 1]
        assert math.isclose(entry[token].logprob, logprobs[position, token].item(),
                            abs_tol=1e-4)


def test_penalties_change_output_and_stay_valid(llm):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tokens(llm.generate(PROMPTS[2], base, use_tqdm=False))[0]
    for kwargs in (dict(repetition_penalty=2.0), dict(frequency_penalty=2.0),
                   dict(presence_penalty=2.0)):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kwargs)
        penalized = tokens(llm.generate(PROMPTS[2], params, use_tqdm=False))[0]
        assert len(penalized) == 24
        # A strong penalty against repeats leaves fewer repeated tokens than none.
        assert len(set(penalized)) >= len(set(plain)), kwargs


def test_logit_bias_forces_token(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                            logit_bias={1234: 100.0})
    assert tokens(llm.generate(PROMPTS[0], params, use_tqdm=False))[0] == [1234] * 3


def test_bad_params_are_refused_before_the_engine_runs(llm, monkeypatch):
    """A token id outside the vocabulary in one request's logit_bias is refused when the
    requests are added, not raised from the sampler in the middle of a step."""
    runner = llm.llm_engine.model_runner
    steps = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda batch: steps.append(1) or execute(batch))
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=4, logit_bias={10**9: 5.0})
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, "):
        llm.generate(PROMPTS[:3], [ok, bad, ok], use_tqdm=False)
    assert steps == []  # refused before any step ran
    assert_pool_free(llm)  # and nothing is left queued
    outputs = llm.generate(PROMPTS[:3], [ok, ok, ok], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4, 4]


def test_token_id_prompts_and_bad_prompts(llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    from_text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0]
    from_ids = llm.generate([ids], greedy, use_tqdm=False)[0]
    assert from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids
    assert from_ids.prompt is None and from_text.prompt == PROMPTS[0]
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate([[5] * 2000], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy, use_tqdm=False)
    assert_pool_free(llm)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    engine.step()
    engine.step()
    assert engine.scheduler.kv_cache_manager.num_free_blocks < \
        engine.scheduler.kv_cache_manager.pool.num_blocks
    engine.abort_request(ids)
    assert_pool_free(llm)
