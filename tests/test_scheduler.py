"""Scheduler policy without a model: budgets, chunked prefill, preemption."""

from __future__ import annotations

from cpullm.config import CacheConfig, SchedulerConfig
from cpullm.engine.request import Request, RequestStatus
from cpullm.engine.scheduler import Scheduler
from cpullm.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, max_tokens=64, max_seqs=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, max_tokens, 1024),
                     CacheConfig(block_size=32, num_blocks=num_blocks,
                                 enable_prefix_caching=False))


def add(scheduler: Scheduler, request_id: str, num_tokens: int, max_tokens: int = 100) -> Request:
    request = Request(request_id, list(range(1, num_tokens + 1)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), {0}, 1024)
    scheduler.add_request(request)
    return request


def run_step(scheduler: Scheduler) -> dict[str, int]:
    output = scheduler.schedule()
    sampled = {item.request_id: [7] for item in output.scheduled if item.sample}
    scheduler.update_from_output(output, sampled)
    return {item.request_id: item.num_tokens for item in output.scheduled}


def test_chunked_prefill_and_mixed_steps():
    scheduler = make_scheduler(max_tokens=64)
    a = add(scheduler, "a", 100)
    assert run_step(scheduler) == {"a": 64}  # first chunk
    b = add(scheduler, "b", 10)
    assert run_step(scheduler) == {"a": 36, "b": 10}  # rest of a, all of b
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    assert run_step(scheduler) == {"a": 1, "b": 1}  # both decoding


def test_sequence_budget():
    scheduler = make_scheduler(max_seqs=2)
    for i in range(3):
        add(scheduler, str(i), 4)
    assert set(run_step(scheduler)) == {"0", "1"}
    assert len(scheduler.waiting) == 1


def test_preempts_newest_and_recomputes():
    scheduler = make_scheduler(num_blocks=3, max_tokens=256)
    old = add(scheduler, "old", 60)  # 2 blocks
    new = add(scheduler, "new", 20)  # 1 block
    run_step(scheduler)
    assert old.status == new.status == RequestStatus.RUNNING
    # old grows past 64 tokens and needs a third block: new is preempted.
    for _ in range(5):
        run_step(scheduler)
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1 and new.block_table == []
    assert scheduler.waiting[0] is new


def test_finish_and_abort_free_blocks():
    scheduler = make_scheduler()
    a = add(scheduler, "a", 10, max_tokens=2)
    b = add(scheduler, "b", 10)
    run_step(scheduler)
    run_step(scheduler)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.block_table == []
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.num_free_blocks == 16
    assert scheduler.schedule().finished_request_ids == {"a", "b"}
    assert not scheduler.has_unfinished_requests()


def test_runner_state_follows_the_scheduler():
    """The runner holds what the steps sent (each prompt once, then the tokens sampled and
    the blocks changed): through chunked prefill, prefix hits, sliding groups that drop
    blocks, preemptions, aborts and two steps in flight, its view of every scheduled
    request equals the scheduler's, and it drops each request once no step holds it."""
    import random

    from cpullm.config import KVCacheGroups
    from cpullm.worker.request_state import RequestStates

    rng = random.Random(3)
    groups = KVCacheGroups.plan([0, 40, 0, 40])  # a full group and a sliding one
    scheduler = Scheduler(SchedulerConfig(6, 96, 1024),
                          CacheConfig(block_size=32, num_blocks=24, groups=groups))
    states = RequestStates()
    shared = [rng.randrange(1, 500) for _ in range(70)]  # a prefix for the cache to find
    in_flight, added, rewrites = [], 0, 0
    for _ in range(2000):
        if added < 40 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + \
                [rng.randrange(1, 500) for _ in range(rng.randrange(1, 120))]
            scheduler.add_request(Request(str(added), prompt, SamplingParams(
                max_tokens=rng.randrange(1, 60), ignore_eos=True), {0}, 1024))
            added += 1
        if scheduler.requests and rng.random() < 0.05:
            scheduler.finish_requests([rng.choice(list(scheduler.requests))],
                                      RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule(max_seqs=3)
        for item in states.update(output):
            request = scheduler.requests[item.request_id]
            start = request.num_computed_tokens
            assert item.num_computed_tokens == start
            assert item.token_ids == request.all_token_ids[start:start + item.num_tokens]
            assert item.block_tables == request.block_tables
            assert item.output_token_ids == request.output_token_ids
            assert item.prompt_token_ids == request.prompt_token_ids
        null = scheduler.kv_cache_manager.null_block
        rewrites += sum(null in ids for item in output.scheduled for ids in item.new_block_ids)
        in_flight.append(output)
        held = {item.request_id for o in in_flight for item in o.scheduled}
        assert set(states._states) <= set(scheduler.requests) | held
        if len(in_flight) == 2 or not output.scheduled:
            done = in_flight.pop(0)
            scheduler.update_from_output(
                done, {item.request_id: [rng.randrange(1, 500)] for item in done.scheduled
                       if item.sample})
        if added == 40 and not scheduler.has_unfinished_requests() and not in_flight:
            break
    assert added == 40 and not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.num_hits > 0
    assert rewrites > 0  # steps that resent a sliding table's entries it dropped
    states.update(scheduler.schedule())
    assert len(states) == 0


def test_step_message_does_not_grow_with_the_context():
    """A decode step sends each request's new token and new blocks, not its history."""
    import pickle

    sizes = []
    for length in (10, 900):
        scheduler = make_scheduler(num_blocks=64)
        add(scheduler, "a", length)
        while scheduler.requests["a"].num_computed_tokens < length:
            run_step(scheduler)
        run_step(scheduler)  # a decode step past the prompt, from the first block's middle
        output = scheduler.schedule()
        assert [item.num_tokens for item in output.scheduled] == [1]
        sizes.append(len(pickle.dumps(output)))
    assert sizes[1] <= sizes[0] + 8, sizes
