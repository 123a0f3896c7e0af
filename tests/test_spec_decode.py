"""Speculative decoding: n-gram proposals, their verification, and the engine around them."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import textwrap

import openai
import pytest
import torch
from conftest import assert_pool_free
from server_utils import RemoteServer

from cpullm import LLM, SamplingParams
from cpullm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from cpullm.engine.request import Request, RequestStatus
from cpullm.engine.scheduler import Scheduler
from cpullm.spec_decode.ngram import propose_ngram
from cpullm.spec_decode.policy import SpeculationPolicy
from cpullm.structured_output import StructuredOutputsParams
from cpullm.worker.sampler import Sampler, SamplingBatch
from cpullm.worker.step_sampler import accepted

# (adaptive off: every step proposes, whatever the machine's step times)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5, "adaptive": False}


def test_ngram_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2]
    assert propose_ngram(tokens, 2, 3, 3) == [3, 9, 9]  # [1, 2] last seen at 4..5
    assert propose_ngram([1, 2, 3, 4, 5, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [4, 5]  # [1, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 1, 2], 2, 2, 10) == [3, 4, 1, 2]  # to the end
    assert propose_ngram([5, 6, 7, 8], 1, 3, 4) == []  # nothing recurs
    assert propose_ngram([7, 1, 7], 2, 3, 4) == []  # below prompt_lookup_min
    assert propose_ngram([1, 2, 1, 2], 2, 2, 0) == []


def test_speculative_config_reads_vllm_keys_and_refuses_by_name():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse(None) is None
    for bad, words in [
            ({"method": "ngram"}, "num_speculative_tokens is required"),
            ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
            ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
              "prompt_lookup_max": 2}, "prompt_lookup_min"),
            ({"method": "ngram", "num_speculative_tokens": "2"}, "must be an integer"),
            ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown keys"),
            ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
             "disable_by_batch_size"),
            ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}, "true or false"),
            ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "only there"),
            ({"method": "eagle3", "model": "x"}, "not supported yet"),
            ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of"),
            ("{not json", "not JSON")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def _scheduler(num_blocks: int = 16, budget: int = 64, **spec) -> Scheduler:
    speculative = SpeculativeConfig.parse({**NGRAM, **spec})
    return Scheduler(SchedulerConfig(8, budget, 1024, speculative=speculative),
                     CacheConfig(block_size=32, num_blocks=num_blocks,
                                 enable_prefix_caching=False))


def _decoding(scheduler: Scheduler, prompt: list[int], max_tokens: int = 100,
              stop: list[int] | None = None) -> Request:
    """A request whose prompt is computed and that sampled its first token, 9."""
    request = Request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                  stop_token_ids=stop or []), {0}, 1024)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert not output.scheduled[0].spec_token_ids  # a prompt chunk proposes nothing
    scheduler.update_from_output(output, {"r": [9]})
    return request


def test_scheduler_budgets_proposals_and_keeps_the_accepted():
    scheduler = _scheduler()
    request = _decoding(scheduler, [8, 9, 1, 2, 3, 4, 5, 8])  # then 9: [8, 9] recurs
    output = scheduler.schedule()
    item = output.scheduled[0]
    assert item.spec_token_ids == [1, 2, 3, 4] and item.num_tokens == 5 and item.sample
    assert output.num_scheduled_tokens == 5
    assert len(request.block_table) == 1  # positions 8..12 fit the first block
    # the rows sampled 1, 2, then 7 where 3 was proposed: two accepted, then the 7
    updated = scheduler.update_from_output(output, {"r": [1, 2, 7]})
    assert updated == [(request, [1, 2, 7])]
    assert request.output_token_ids == [9, 1, 2, 7]
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.accepted_per_position == [1, 1, 0, 0]


def test_proposals_stop_at_max_tokens_and_a_stop_cuts_the_accepted():
    scheduler = _scheduler()
    request = _decoding(scheduler, [3, 9, 1, 2, 3, 4, 5, 6, 3], max_tokens=3)
    output = scheduler.schedule()  # [3, 9] recurs: 1, 2, 3 proposed, but 3 tokens in all
    assert output.scheduled[0].spec_token_ids == [1]
    scheduler.update_from_output(output, {"r": [1, 2]})
    assert request.output_token_ids == [9, 1, 2]
    assert request.status == RequestStatus.FINISHED_LENGTH

    scheduler = _scheduler()
    request = _decoding(scheduler, [3, 9, 1, 2, 3, 4, 5, 6, 3], stop=[2])
    output = scheduler.schedule()
    assert output.scheduled[0].spec_token_ids == [1, 2, 3, 4]
    # all four accepted and one more, but the stop token 2 ends the request there
    assert scheduler.update_from_output(output, {"r": [1, 2, 3, 4, 5]}) == \
        [(request, [1, 2])]
    assert request.output_token_ids == [9, 1, 2] and request.stop_reason == 2
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_proposals_wait_for_room_and_stop_above_the_batch_size():
    scheduler = _scheduler(budget=3)  # a token and two proposals
    _decoding(scheduler, [3, 9, 1, 2, 3, 4, 3])
    assert scheduler.schedule().scheduled[0].spec_token_ids == [1, 2]

    scheduler = _scheduler(disable_by_batch_size=2)
    for i in range(2):
        scheduler.add_request(Request(f"r{i}", [3, 9, 1, 2, 3, 4, 3, 9],
                                      SamplingParams(max_tokens=10), {0}, 1024))
    output = scheduler.schedule()
    scheduler.update_from_output(output, {item.request_id: [1] for item in output.scheduled})
    assert all(not item.spec_token_ids for item in scheduler.schedule().scheduled)


def _policy(seconds, k: int = 4, **spec) -> SpeculationPolicy:
    policy = SpeculationPolicy(SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": k,
                                                        **spec}))
    policy.measure(lambda rows: seconds(rows), max_rows=32)
    return policy


def test_policy_proposes_where_extra_rows_are_cheap():
    """Rows nearly free up to 8 (bound by reading the weights), then in proportion: one
    stream gets every proposal, two get fewer, and from 8 streams on none pay."""
    policy = _policy(lambda rows: max(1.0, rows / 8) + (rows == 2))  # (2 rows: a slow run)
    assert sorted(policy.step_seconds) == [1, 2, 4, 8, 16, 32]
    assert policy.step_seconds[2] == 1.0  # no slower than 4 rows
    assert policy.step_time(64) == pytest.approx(8.0)  # past the measured: linear
    assert policy.num_proposals(1) == 4
    assert 0 < policy.num_proposals(3) < 4
    assert policy.num_proposals(8) == 0 and policy.num_proposals(100) == 0
    assert policy.num_proposals(0) == 0
    # each row also reads its request's KV: over 1,000 tokens of context at a millisecond a
    # token, a row's reads take as long as the step itself, and one stream gets none
    policy.kv_seconds_per_token = 1e-3
    assert policy.num_proposals(1, context_tokens=10) == 4
    assert policy.num_proposals(1, context_tokens=1000) == 0
    # unmeasured (a pipeline): every step, as vLLM; disable_by_batch_size still holds
    unmeasured = SpeculationPolicy(SpeculativeConfig.parse(
        {**NGRAM, "disable_by_batch_size": 4}))
    assert unmeasured.num_proposals(3) == 4 and unmeasured.num_proposals(4) == 0


def test_policy_follows_the_acceptance_and_probes_when_off():
    policy = _policy(lambda rows: 1.0 + 0.1 * rows)  # 5 rows: 1.36x one row's time
    # at the first guess of half accepted, 2 proposals gain the most: 1.75 tokens a step
    # for 1.18x the time
    assert policy.acceptance == 0.5 and policy.num_proposals(1) == 2
    for _ in range(40):
        policy.record(4, 0)  # every first proposal rejected
    assert policy.acceptance < 0.05
    picks = [policy.num_proposals(1) for _ in range(32)]
    assert picks.count(0) == 30 and picks.count(4) == 2  # a probe every 16 steps
    for _ in range(40):
        policy.record(4, 4)
    assert policy.acceptance > 0.9 and policy.num_proposals(1) == 4


def test_rejection_sampling_keeps_the_target_distribution():
    """Rows that sample after a proposed token keep the target's distribution: the first
    new token is distributed as the first row's target, and after an accepted proposal the
    next as the second row's (50,000 draws, total variation under 2%)."""
    torch.manual_seed(0)
    vocab, trials = 6, 50_000
    target = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.15, 0.05],
                           [0.3, 0.05, 0.2, 0.1, 0.05, 0.3]])
    proposed = [3]  # rows: after the context, after the proposal (the bonus token's)
    logits = target.log().repeat(trials, 1)  # [trials * 2, vocab]: 2 rows a trial
    params = SamplingParams(temperature=1.0)
    batch = SamplingBatch(params=[params] * (2 * trials),
                          prompt_token_ids=[[1]] * (2 * trials),
                          output_token_ids=[[]] * (2 * trials),
                          generators=[None] * (2 * trials))
    tokens, _ = Sampler(vocab, {vocab + 1})(logits, batch)
    news = [accepted(proposed, tokens[2 * t:2 * t + 2]) for t in range(trials)]
    first = torch.bincount(torch.tensor([n[0] for n in news]), minlength=vocab) / trials
    assert (first - target[0]).abs().sum() / 2 < 0.02
    seconds = torch.tensor([n[1] for n in news if len(n) > 1])
    assert len(seconds) > 0.2 * trials  # the proposal 3 is accepted a quarter of the time
    second = torch.bincount(seconds, minlength=vocab) / len(seconds)
    assert (second - target[1]).abs().sum() / 2 < 0.02
    assert max(len(n) for n in news) == 2


def _draft(model, num_tokens: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": num_tokens,
            "adaptive": False}


def test_draft_model_greedy_identity(tiny_model, tmp_path_factory, tokenizer_dir):
    """A tiny target with itself as the draft (every proposal accepted) and with another
    random model of the same vocabulary (most rejected): the same greedy tokens as without
    speculation, in float32, with chunked prefill and prompts of mixed lengths."""
    from conftest import make_tiny_model

    target = tiny_model("llama")
    other = make_tiny_model(tmp_path_factory.mktemp("draft"), tokenizer_dir, "llama", seed=7)
    generator = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (n,), generator=generator)
                .tolist()} for n in (5, 40, 90)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = dict(dtype="float32", block_size=32, max_model_len=256, max_num_batched_tokens=48)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(target), **engine).generate(prompts, greedy, use_tqdm=False)]
    for draft, accepted_all in ((target, True), (other, False)):
        llm = LLM(str(target), **engine, speculative_config=_draft(draft))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == expected, draft
        stats = llm.llm_engine.scheduler.spec_stats
        assert stats.num_drafts > 0
        if accepted_all:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens
        assert_pool_free(llm)
        drafter = llm.llm_engine.scheduler.proposer
        assert drafter.kv_cache_manager.num_free_blocks == drafter.config.cache.num_blocks


def test_stop_strings_n_and_prefix_hits_with_a_draft(tiny_model):
    """With the target as its own draft (four tokens a step): a stop string inside a step's
    tokens cuts the text where it does without speculation; n = 2 greedy samples are
    both the answer; a second run of the prompt, from the prefix cache, is too."""
    target = str(tiny_model("llama"))
    engine = dict(dtype="float32", block_size=32, max_model_len=256)
    prompt = {"prompt_token_ids": list(range(200, 270))}
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, **engine)
    text = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopping = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected = plain.generate([prompt], stopping, use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop" and len(expected.text) < len(text)

    llm = LLM(target, **engine, speculative_config=_draft(target, 4))
    got = llm.generate([prompt], stopping, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (expected.text, "stop")
    two = SamplingParams(n=2, temperature=0.0, max_tokens=40, ignore_eos=True)
    for _ in range(2):  # the second time from the prefix cache
        outputs = llm.generate([prompt], two, use_tqdm=False)[0].outputs
        assert [o.text for o in outputs] == [text, text]
    assert llm.llm_engine.scheduler.kv_cache_manager.num_hits > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_free(llm)


def test_draft_model_of_another_vocabulary_is_refused(tiny_model, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model("llama"), draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 64
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="draft model's vocabulary .* is not the target's"):
        LLM(str(tiny_model("llama")), dtype="float32", speculative_config=_draft(draft))
    with pytest.raises(ValueError, match="model .* is required with method draft_model"):
        LLM(str(tiny_model("llama")), dtype="float32",
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def _code_prompts() -> list[str]:
    """Input-grounded prompts: rewriting code that is in the prompt."""
    return [f"Fix the bug in this Python code. Reply with the corrected code only.\n\n"
            f"```python\n{inspect.getsource(function)}```"
            for function in (textwrap.dedent, textwrap.indent, textwrap.shorten)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
# the default model in float32, and a budget of 64 tokens a step, so that proposals share
# steps with prompt chunks
ENGINE = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=4,
              kv_cache_memory_bytes=256 << 20, max_model_len=2048)


@pytest.fixture(scope="module")
def code_chats():
    """The code prompts as chats, and their greedy answers without speculation."""
    chats = [[{"role": "user", "content": p}] for p in _code_prompts()]
    return chats, LLM(**ENGINE).chat(chats, GREEDY, use_tqdm=False)


def _assert_same_answers(plain, fast) -> None:
    for a, b in zip(plain, fast, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for t in x)


@pytest.mark.slow
def test_greedy_output_is_the_same_with_ngram_speculation(code_chats):
    """The default model in float32, greedy: the same tokens (and logprobs) with and
    without n-gram speculation; some proposals accepted, some rejected."""
    chats, plain = code_chats
    llm = LLM(**ENGINE, speculative_config=NGRAM)
    _assert_same_answers(plain, llm.chat(chats, GREEDY, use_tqdm=False))
    stats = llm.llm_engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_pool_free(llm)


@pytest.mark.slow
def test_speculation_with_preemption_and_a_grammar(code_chats):
    """A pool of 20 blocks of 32 tokens for answers that need 32 forces preemptions while
    proposals are in flight; a request with a JSON schema in the same batch gets no
    proposals and valid JSON. The greedy answers stay the same."""
    chats, plain = code_chats
    llm = LLM(**{**ENGINE, "block_size": 32, "max_model_len": 640,
                 "kv_cache_memory_bytes": 20 * 32 * 46080},  # (46,080 bytes of KV a token)
              speculative_config=NGRAM)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    guided = SamplingParams(temperature=0.0, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outputs = llm.chat([*chats, [{"role": "user", "content": "Name a fruit, as JSON."}]],
                       [GREEDY] * len(chats) + [guided], use_tqdm=False)
    _assert_same_answers(plain, outputs[:-1])
    assert "name" in json.loads(outputs[-1].outputs[0].text)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_free(llm)


@pytest.mark.slow
def test_server_with_ngram_speculation(code_chats, tmp_path):
    """Through the server, streamed and not: the greedy answer of the offline engine without
    speculation; the spec-decode counters move, and `cpullm bench serve` reports them."""
    chats, plain = code_chats
    expected = plain[0].outputs[0].text
    server = RemoteServer(["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20),
                           "--max-model-len", "2048", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3, '
                           '"adaptive": false}'])
    try:
        assert "Speculative decoding: ngram, up to 3 tokens a step" in server.log()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        asked = dict(model=model, messages=chats[0], max_tokens=GREEDY.max_tokens,
                     temperature=0.0)
        whole = client.chat.completions.create(**asked)
        assert whole.choices[0].message.content == expected
        stream = client.chat.completions.create(**asked, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected
        metrics = server.metrics()
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        assert 0 < metrics["vllm:spec_decode_num_accepted_tokens_total"] \
            <= metrics["vllm:spec_decode_num_draft_tokens_total"]
        assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == \
            metrics["vllm:spec_decode_num_accepted_tokens_total"]

        data = tmp_path / "edits.json"
        data.write_text(json.dumps([{"conversations": [{"from": "human",
                                                        "value": _code_prompts()[0]},
                                                       {"from": "gpt", "value": "x"}]}]))
        bench = subprocess.run(
            [sys.executable, "-m", "cpullm.entrypoints.cli", "bench", "serve", "--base-url",
             server.url, "--dataset-name", "sharegpt", "--dataset-path", str(data),
             "--num-prompts", "1", "--sharegpt-output-len", "24", "--save-result",
             "--result-dir", str(tmp_path), "--result-filename", "serve.json"],
            capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-3000:]
        assert "Speculative Decoding" in bench.stdout
        result = json.loads((tmp_path / "serve.json").read_text())
        assert result["spec_decode_num_drafts"] > 0  # (the counters of this run only)
        assert 0 <= result["spec_decode_acceptance_rate"] <= 100
        assert len(result["spec_decode_per_position_acceptance_rate"]) == 3
    finally:
        server.stop()
