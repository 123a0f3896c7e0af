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
    sampled = {item.request_id: 7 for item in output.scheduled if item.sample}
    scheduler.update_from_output(output, sampled)
    return {item.request_id: len(item.token_ids) for item in output.scheduled}


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
