"""Scheduler: which requests run this step, and how many tokens each.

Policy: there are no prefill or decode phases. Every step hands out a token budget so that
each request's num_computed_tokens catches up with its num_tokens: running requests first,
oldest first, then waiting requests in arrival order while the token, sequence and block
budgets last. A long prompt simply takes several steps (chunked prefill), and decodes and
prompt chunks share a step. When a running request cannot get a KV block, the newest
running request is preempted: its blocks are freed and it is recomputed later from its
prompt and output so far, which gives the same tokens as an uninterrupted run.

Under pipeline parallelism and with compute lanes several steps are in flight at once (one
per stage or lane): a request scheduled in one is not scheduled again, nor preempted, until
that step's output returns (``in_flight``), so the next steps take the other requests. A
request that ends while a step in flight holds it (an abort) keeps its KV blocks until
that step returns, since the step still writes them.

An encoder's inputs (``SchedulerConfig.whole_inputs``) are scheduled whole, as the token
budget allows, with no KV blocks, and end in the step that computes them.

With speculative decoding a decoding request also gets up to k proposed tokens (fewer, or
none, where the policy finds they do not pay: spec_decode/policy.py), budgeted and given
KV slots like a prompt chunk (only where blocks are free: a proposal never preempts
anyone); the step verifies them, and the request keeps the accepted ones and the token
after them. The rejected ones' KV slots are rewritten by the next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from cpullm.config import CacheConfig, SchedulerConfig
from cpullm.engine.kv_cache_manager import KVCacheManager
from cpullm.engine.request import Request, RequestStatus
from cpullm.engine.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams
from cpullm.spec_decode.ngram import NgramProposer
from cpullm.spec_decode.policy import Proposer, SpeculationPolicy


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        groups = cache_config.groups
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               groups.windows if groups else (0,))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_request_ids: set[str] = set()
        self.in_flight: set[str] = set()  # scheduled in a step whose output is not back yet
        self._free_on_return: dict[str, Request] = {}  # ended while in flight (an abort)
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        speculative = scheduler_config.speculative
        self.spec_policy = SpeculationPolicy(speculative) if speculative is not None else None
        # what proposes tokens: n-gram lookup here; a draft model's proposer is set by the
        # engine core, which runs it
        self.proposer: Proposer | None = NgramProposer(speculative) \
            if speculative is not None and speculative.method == "ngram" else None

    # Whether a waiting request's grammar is compiled (the model runner's
    # GuidedDecoding.ready, where it runs in this process); one that is not yet waits
    # while the requests behind it go ahead
    grammar_ready: Callable[[Any], bool] | None = None
    # --max-loras: the most LoRA adapters whose requests run at once
    max_loras = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """``max_seqs``: at most so many requests in this step (pipeline parallelism shares
        the requests out over the steps in flight)."""
        budget = self.config.max_num_batched_tokens
        max_seqs = max_seqs or self.config.max_num_seqs
        scheduled: list[tuple[Request, int, list[int]]] = []
        preempted = False
        proposals = self._proposals()  # request id -> tokens proposed after its next one

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < max_seqs:
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1
                continue
            if self._outgrows_rope(request):  # all of it again, on the long factors
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # (a proposal takes the budget's room only)
            proposed = proposals.get(request.request_id, [])[:budget - 1] if num_new == 1 else []
            if proposed and self.kv_cache_manager.allocate_slots(request, 1 + len(proposed)):
                scheduled.append((request, 1 + len(proposed), proposed))
                budget -= 1 + len(proposed)
                i += 1
                continue
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self._newest_idle(i)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, []))
                budget -= num_new
                i += 1

        # 2. Waiting requests in order, unless this step already had to preempt; those
        # whose grammar is still compiling are held back, in their places.
        held: list[Request] = []
        adapters = self._running_adapters()
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs and len(scheduled) < max_seqs):
            request = self.waiting[0]
            if self.grammar_ready is not None and request.status == RequestStatus.WAITING \
                    and not self.grammar_ready(request.sampling_params):
                held.append(self.waiting.popleft())
                continue
            if request.lora_id and request.lora_id not in adapters \
                    and len(adapters) >= self.max_loras:
                held.append(self.waiting.popleft())  # until an adapter's requests are done
                continue
            if self.config.whole_inputs:  # an encoder's input: whole, with no KV blocks
                num_cached, num_new = 0, request.num_tokens
                if num_new > budget:
                    break
            else:  # (a pooling request pools every token's state: it computes them all)
                self._outgrows_rope(request)
                cached = [] if isinstance(request.sampling_params, PoolingParams) \
                    else self.kv_cache_manager.find_cached_prefix(request)
                num_cached = len(cached[0]) * self.kv_cache_manager.block_size if cached else 0
                num_new = min(request.num_tokens - num_cached, budget)
                if not self.kv_cache_manager.allocate_slots(request, num_new, cached):
                    break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached  # the found prefix needs no compute
            if request.status == RequestStatus.WAITING:  # scheduled for the first time
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_id:
                adapters.add(request.lora_id)
            scheduled.append((request, num_new, []))
            budget -= num_new
        self.waiting.extendleft(reversed(held))

        new_requests = [NewRequestData(request.request_id, request.prompt_token_ids,
                                       request.sampling_params, request.lora_id,
                                       request.images)
                        for request, _, _ in scheduled if request.num_tokens_sent == 0]
        output = SchedulerOutput(
            scheduled=[self._describe(request, n, proposed)
                       for request, n, proposed in scheduled],
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            new_requests=new_requests, finished_request_ids=self.finished_request_ids)
        self.finished_request_ids = set()
        self.in_flight.update(request.request_id for request, _, _ in scheduled)
        return output

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests and of those ended while a step in
        flight still runs them: each holds one of the model's ``max_loras`` slots."""
        return {r.lora_id for r in (*self.running, *self._free_on_return.values())
                if r.lora_id}

    def _proposals(self) -> dict[str, list[int]]:
        """Tokens to verify after each decoding request's next one: as many as the policy
        picks for this many decoding requests, within each request's max_tokens; none for
        a request whose sampling follows a grammar."""
        if self.proposer is None:
            return {}
        assert self.spec_policy is not None
        decoding = [r for r in self.running if r.request_id not in self.in_flight
                    and r.num_tokens - r.num_computed_tokens == 1]
        k = self.spec_policy.num_proposals(len(decoding),
                                           sum(r.num_tokens for r in decoding))
        if not k:
            return {}
        wanted = []
        for request in decoding:
            params = request.sampling_params
            most = min(k, request.max_tokens - request.num_output_tokens - 1)
            if isinstance(params, SamplingParams) and params.structured_outputs is None \
                    and most > 0:
                wanted.append((request, most))
        return self.proposer.propose(wanted) if wanted else {}

    def _outgrows_rope(self, request: Request) -> bool:
        """Whether the request has just grown past LongRoPE's pretraining length, where its
        positions take the long factors (as in transformers, which then recomputes the
        sequence); it is marked so."""
        edge = self.config.longrope_edge
        if edge is None or request.long_rope or request.num_tokens <= edge:
            return False
        request.long_rope = True
        return True

    def _newest_idle(self, first: int) -> Request:
        """The newest running request from index ``first`` on that no step in flight
        holds (request ``first`` itself at the latest)."""
        return next(r for r in reversed(self.running[first:])
                    if r.request_id not in self.in_flight)

    @staticmethod
    def _describe(request: Request, num_new: int, proposed: list[int]) -> ScheduledRequest:
        """The step's share of the request, as a change to what the runner holds (its
        prompt is sent whole the first time, as NewRequestData); ``proposed``: the
        speculative tokens among the ``num_new``."""
        start = request.num_computed_tokens
        sent = request.num_tokens_sent or request.num_prompt_tokens
        request.num_tokens_sent = request.num_tokens
        first_block = request.num_blocks_sent
        request.num_blocks_sent = len(request.block_table)
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            num_tokens=num_new,
            new_token_ids=request.all_token_ids[sent:],
            block_start=first_block,
            new_block_ids=[table[first_block:] for table in request.block_tables],
            sample=start + num_new - len(proposed) == request.num_tokens,
            long_rope=request.long_rope,
            spec_token_ids=proposed)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0  # recomputed from the start when rescheduled
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]],
                           failed: dict[str, str] | None = None,
                           pooled: Collection[str] = ()) -> list[tuple[Request, list[int]]]:
        """Advance the scheduled requests after the step ran; returns the requests that
        got new tokens, with them (``sampled``: one, or with speculation the accepted
        proposals and the token after them, cut at a stop), were pooled (``pooled``:
        pooling requests whose whole input is computed, which end there) or failed
        (``failed``: their sampling raised). Requests that finished are freed."""
        updated = []
        for item in output.scheduled:
            self.in_flight.discard(item.request_id)
            ended = self._free_on_return.pop(item.request_id, None)
            if ended is not None:
                self.kv_cache_manager.free(ended)
                self.finished_request_ids.add(item.request_id)
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # finished (aborted) while its step was in flight
            if failed and item.request_id in failed:
                request.status = RequestStatus.FINISHED_ERROR
                self._finish(request)
                updated.append((request, []))
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens = before + item.num_tokens
            if item.request_id in pooled:
                request.status = RequestStatus.FINISHED_STOPPED
                self._finish(request)
                updated.append((request, []))
                continue
            token_ids = sampled.get(item.request_id)
            if token_ids is None:
                self.kv_cache_manager.cache_computed_blocks(request, before)
                continue
            if item.spec_token_ids:
                self.spec_stats.add(len(item.spec_token_ids), len(token_ids) - 1)
                assert self.spec_policy is not None
                self.spec_policy.record(len(item.spec_token_ids), len(token_ids) - 1)
            for n, token in enumerate(token_ids, start=1):
                request.append_output_token(token)
                if request.check_stop():
                    token_ids = token_ids[:n]
                    break
            # The newest token's KV is computed in its next step; past it (rejected
            # proposals) the cache holds stale entries that step overwrites.
            request.num_computed_tokens = request.num_tokens - 1
            self.kv_cache_manager.cache_computed_blocks(request, before)
            if request.status.finished:
                self._finish(request)
            updated.append((request, token_ids))
        return updated

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (stop strings, aborts)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)
            request.status = status
            self._finish(request)

    def _finish(self, request: Request) -> None:
        assert request.status.finished
        if self.proposer is not None:
            self.proposer.drop(request.request_id)
        if request in self.running:
            self.running.remove(request)
        if request.request_id in self.in_flight:  # (the runner drops it when that is back)
            self._free_on_return[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
            self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]


class SpecDecodeStats:
    """Running totals of speculative decoding, as vLLM's ``vllm:spec_decode_*`` metrics
    count them: steps that verified proposals, tokens proposed, tokens accepted, and
    accepted tokens by their place in the proposal."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position.extend([0] * grow)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
