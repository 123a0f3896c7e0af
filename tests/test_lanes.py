"""Compute lanes (cpullm/executor/uniproc.py): a rank's CPUs split in two, a step in flight
on each with its share of the requests. Forced here from one request per lane on: the
greedy float32 tokens are transformers', sampling is reproducible, and a request aborted
while its lane's step is out keeps its KV blocks until the step returns."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from conftest import hf_greedy
from test_parallel import GREEDY, NUM_NEW_TOKENS, make_prompts, step_to_the_end

from cpullm import LLM, SamplingParams
from cpullm.executor import uniproc
from cpullm.model_executor.layers.ops import load_ops

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU per lane")


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two lanes, in use from two unfinished requests on."""
    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "2")
    monkeypatch.setattr(uniproc, "LANE_MIN_REQUESTS", 1)


def lane_llm(model: object, **kwargs: object) -> LLM:
    llm = LLM(str(model), dtype="float32", block_size=32, **kwargs)
    assert len(llm.llm_engine.core.executor.lane_steps) == 2
    return llm


def test_lanes_match_transformers(lanes, tiny_model):
    """Chunked prompts too: each lane's steps take their own requests' chunks."""
    model = tiny_model("llama")
    prompts = make_prompts(49152)
    llm = lane_llm(model, max_num_batched_tokens=20)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == hf_greedy(model, prompts, NUM_NEW_TOKENS)
        executor = llm.llm_engine.core.executor
        assert min(executor.lane_steps) > 0, executor.lane_steps
        cpus = llm.llm_engine.config.parallel.binding.rank_cpus[0]
        # each lane's thread is the first of its pool, on the first CPU of its half
        pinned = [lane.submit(os.sched_getaffinity, 0).result() for lane in executor._lanes]
        assert pinned == [{cpus[0]}, {cpus[len(cpus) // 2]}]
        pool = llm.llm_engine.scheduler.kv_cache_manager.pool
        assert pool.num_free == pool.num_blocks
    finally:
        llm.llm_engine.shutdown()


def test_lanes_sample_reproducibly(lanes, tiny_model):
    """Unseeded requests draw from their lane's generator, seeded by the engine's seed: two
    engines with one seed give the same samples, whatever the lanes' timing."""
    model = tiny_model("llama")
    prompts = make_prompts(49152) * 2
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = lane_llm(model, seed=7)
        try:
            runs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)])
            assert min(llm.llm_engine.core.executor.lane_steps) > 0
        finally:
            llm.llm_engine.shutdown()
    assert runs[0] == runs[1]
    assert len({tuple(tokens) for tokens in runs[0]}) > 1  # sampled, not one greedy answer


def test_abort_while_in_flight_on_a_lane(lanes, tiny_model):
    """A request aborted while its lane's step is out keeps its blocks (the step still
    writes them) until the step returns; then they are freed and the others finish."""
    from cpullm.engine.llm_engine import LLMEngine
    from cpullm.engine_args import EngineArgs

    model = tiny_model("llama")
    prompts = make_prompts(49152)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model), dtype="float32", block_size=32, max_num_batched_tokens=25))
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        core = engine.core
        engine.step()  # a step submitted on each lane, the first collected
        assert len(core._in_flight) == 1
        scheduler = core.scheduler
        victim = sorted(scheduler.in_flight)[0]
        kv = scheduler.kv_cache_manager
        free_before = kv.num_free_blocks
        assert free_before < kv.pool.num_blocks
        engine.abort_request(victim)
        assert victim in scheduler._free_on_return and kv.num_free_blocks == free_before
        finished = step_to_the_end(engine)
        assert kv.num_free_blocks == kv.pool.num_blocks and not scheduler._free_on_return
        expected = hf_greedy(model, prompts, NUM_NEW_TOKENS)
        assert set(finished) == {str(i) for i in range(len(prompts))} - {victim}
        for request_id, tokens in finished.items():
            assert tokens == expected[int(request_id)]
    finally:
        engine.release_threads()  # this thread stepped the engine: its CPUs back
        engine.shutdown()


def test_lane_cpus(monkeypatch):
    config = SimpleNamespace(model=SimpleNamespace(enforce_eager=True))
    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "2")
    assert uniproc.lane_cpus(config, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]
    assert uniproc.lane_cpus(config, [3]) == []  # one CPU: no lanes
    assert uniproc.lane_cpus(config, None) == []  # unbound
    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "8")
    assert uniproc.lane_cpus(config, [0, 1, 2]) == [[0], [1], [2]]  # at most one per CPU
    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "1")
    assert uniproc.lane_cpus(config, [0, 1, 2, 3]) == []
    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "0")
    with pytest.raises(ValueError, match="CPULLM_COMPUTE_LANES"):
        uniproc.lane_cpus(config, [0, 1])
    monkeypatch.delenv("CPULLM_COMPUTE_LANES")
    assert uniproc.lane_cpus(config, [0, 1]) == []  # eager: no compiled kernels, no lanes
    config.model.enforce_eager = False
    ops = load_ops()
    if ops is not None and not ops.amx:  # on by default: two lanes, few CPUs
        assert uniproc.lane_cpus(config, [0, 1]) == [[0], [1]]
    assert uniproc.lane_cpus(config, list(range(uniproc.AUTO_LANES_MAX_CPUS + 1))) == []


def test_few_requests_run_one_step_on_all_cpus(monkeypatch, tiny_model):
    """Below LANE_MIN_REQUESTS per lane, steps run one at a time on the engine's thread."""
    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "2")
    llm = lane_llm(tiny_model("llama"))
    try:
        llm.generate(make_prompts(49152), GREEDY, use_tqdm=False)
        assert llm.llm_engine.core.executor.lane_steps == [0, 0]
    finally:
        llm.llm_engine.shutdown()
