"""EngineCore: the scheduler and the executor (the model runner), one step at a time.

This is the part of the engine that runs the model, and the only part that runs in the
engine-core process (cpullm/engine/core_proc.py). It knows sequences, not user requests:
a request with n samples arrives as n EngineCoreRequests, and each step hands back, per
sequence that moved, an EngineCoreOutput with its new token ids, whether a token stop
(eos, a stop token id, the length limit) finished it, and the raw logprob rows. Text,
stop strings and RequestOutputs are the front end's (cpullm/engine/output_processor.py).
Plain values only, so that both travel between processes as they are.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from cpullm.config import EngineConfig
from cpullm.engine.request import Request, RequestStatus
from cpullm.engine.sched_output import LogprobsLists, SchedulerOutput
from cpullm.engine.scheduler import Scheduler
from cpullm.executor import Executor, create_executor
from cpullm.logger import init_logger
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.platform.memory import read_bandwidth
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams
from cpullm.spec_decode.draft import DraftProposer
from cpullm.spec_decode.policy import probe_step
from cpullm.utils import cdiv
from cpullm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

# a buffer far larger than the caches, read to time the KV reads of speculation's rows
_BANDWIDTH_PROBE_BYTES = 256 << 20


def _rows_ms(seconds: dict[int, float]) -> str:
    return ", ".join(f"{rows} rows {t * 1e3:.1f} ms" for rows, t in seconds.items())


@dataclass(slots=True)
class EngineCoreRequest:
    """One sequence to generate: sent once, when the request arrives."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    arrival_time: float  # time.monotonic() when the front end received it
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did for one sequence."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos or a stop token id) or "length"
    stop_reason: int | None = None  # the stop token id that ended it
    logprobs: LogprobsLists | None = None  # one row per new token
    # Rows for prompt positions from prompt_logprobs_start on, computed this step.
    prompt_logprobs: LogprobsLists | None = None
    prompt_logprobs_start: int = 0
    num_cached_tokens: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    error: str | None = None  # the sequence failed (finish_reason "error"): why
    pooled: torch.Tensor | None = None  # a pooling request's output (float32), at its end


@dataclass
class EngineStats:
    """Scheduler state read by /metrics, refreshed after every step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # speculative decoding (scheduler.SpecDecodeStats)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


class EngineCore:
    """``add_request`` sequences, ``step()`` while ``has_unfinished_requests()``."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        torch.manual_seed(config.model.seed)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.executor: Executor = create_executor(config, eos_token_ids)
        runner = getattr(self.executor, "model_runner", None)
        if isinstance(runner, ModelRunner):  # here, in this process: grammars compile aside
            self.scheduler.grammar_ready = runner.sampler.guided.ready
        self.lora = runner.lora if isinstance(runner, ModelRunner) else None
        if self.lora is not None:
            self.scheduler.max_loras = self.lora.config.max_loras
        draft = None
        if config.draft is not None:
            draft = self.scheduler.proposer = DraftProposer(config.draft, eos_token_ids)
        policy = self.scheduler.spec_policy
        if policy is not None and policy.config.adaptive \
                and config.parallel.pipeline_parallel_size == 1:
            start = time.perf_counter()
            self.executor.bind_threads()  # (the read below on the compute threads)
            policy.measure(self._time_decode_step, min(config.cache.block_size,
                                                       config.scheduler.max_num_batched_tokens),
                           draft.time_step if draft is not None else None,
                           config.model.kv_bytes_per_token(config.parallel)
                           / read_bandwidth(_BANDWIDTH_PROBE_BYTES))
            self.executor.release_calling_thread()
            if draft is not None:
                draft.runner.release_calling_thread()
            logger.info("Decode step times measured for speculation in %.1f s: %s%s",
                        time.perf_counter() - start, _rows_ms(policy.step_seconds),
                        f"; the draft's: {_rows_ms(policy.draft_seconds)}"
                        if policy.draft_seconds else "")
        # steps submitted and not collected (pipeline stages, compute lanes), oldest first
        self._in_flight: deque[SchedulerOutput] = deque()
        self.last_step_num_tokens = 0  # prompt and output tokens computed by the last step

    def add_request(self, request: EngineCoreRequest) -> None:
        lora_id, lora_key = 0, None
        if request.lora is not None:  # (ValueError: the request is refused)
            if self.lora is None:
                raise ValueError(f"LoRA adapter {request.lora.lora_name!r}: the engine runs "
                                 "without --enable-lora")
            lora_id, lora_key = request.lora.lora_int_id, self.lora.add(request.lora)
        sequence = Request(request.request_id, request.prompt_token_ids, request.params,
                           self.eos_token_ids, self.config.model.max_model_len,
                           request.cache_salt, lora_id, lora_key)
        sequence.images = request.images
        sequence.arrival_time = request.arrival_time
        self.scheduler.add_request(sequence)

    def finish_requests(self, request_ids: list[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End sequences the front end is done with (aborts, stop strings); their KV
        blocks are freed. Unknown or finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or steps in flight (whose requests may have been aborted)."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        scheduler = self.scheduler
        unfinished = len(scheduler.running) + len(scheduler.waiting)
        depth = self.executor.steps_in_flight(unfinished)
        if depth == 1 and not self._in_flight:
            # 1. Schedule. 2. One forward pass and sampling.
            scheduler_output = scheduler.schedule()
            runner_output = self.executor.execute_model(scheduler_output)
        else:
            # Pipeline parallelism, compute lanes: keep a step in flight per stage or lane
            # while there are requests no step in flight holds, each step with an even
            # share of the requests, then wait for the oldest.
            share = cdiv(unfinished, depth)
            while len(self._in_flight) < depth:
                scheduler_output = scheduler.schedule(max_seqs=share)
                if not scheduler_output.scheduled:
                    scheduler.finished_request_ids |= scheduler_output.finished_request_ids
                    break
                self.executor.submit(scheduler_output)
                self._in_flight.append(scheduler_output)
            if not self._in_flight:
                self.last_step_num_tokens = 0
                return []
            scheduler_output = self._in_flight.popleft()
            runner_output = self.executor.collect()
        self.last_step_num_tokens = scheduler_output.num_scheduled_tokens
        # 3. Prompt logprobs belong to positions from num_computed_tokens, before the update.
        outputs: dict[str, EngineCoreOutput] = {}
        for request_id, rows in runner_output.prompt_logprobs.items():
            if request_id not in scheduler.requests:
                continue  # aborted while its step was in flight
            start = scheduler.requests[request_id].num_computed_tokens
            outputs[request_id] = EngineCoreOutput(request_id, [], prompt_logprobs=rows,
                                                   prompt_logprobs_start=start)
        # 4. Advance requests; token stops (eos, stop ids, length) end them here.
        for request, new_token_ids in scheduler.update_from_output(
                scheduler_output, runner_output.sampled_token_ids, runner_output.failed,
                runner_output.pooled):
            output = outputs.get(request.request_id)
            if output is None:
                output = outputs[request.request_id] = EngineCoreOutput(request.request_id, [])
            if request.status == RequestStatus.FINISHED_ERROR:
                output.finish_reason = "error"
                output.error = runner_output.failed[request.request_id]
                continue
            if request.request_id in runner_output.pooled:
                output.pooled = runner_output.pooled[request.request_id]
                output.finish_reason = "stop"
                output.scheduled_time = request.scheduled_time
                continue
            output.new_token_ids.extend(new_token_ids)
            logprobs = runner_output.logprobs.get(request.request_id)
            if logprobs is not None and len(logprobs.ranks) > len(new_token_ids):  # cut at a stop
                logprobs = LogprobsLists(*(rows[:len(new_token_ids)] for rows in (
                    logprobs.token_ids, logprobs.logprobs, logprobs.ranks)))
            output.logprobs = logprobs
            if request.status.finished:
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason  # type: ignore[assignment]
            output.num_cached_tokens = request.num_cached_tokens
            output.scheduled_time = request.scheduled_time
            output.first_token_time = request.first_token_time
            output.last_token_time = request.last_token_time
        return list(outputs.values())

    def _time_decode_step(self, rows: int) -> float:
        """Seconds of one decode step of ``rows`` requests (policy.probe_step)."""
        groups = self.config.cache.groups
        step, cleanup = probe_step(rows, len(groups.windows) if groups else 1)
        start = time.perf_counter()
        self.executor.execute_model(step)
        elapsed = time.perf_counter() - start
        self.executor.execute_model(cleanup)
        return elapsed

    def check_health(self) -> None:
        """Raise if a rank of the executor is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        spec = scheduler.spec_stats
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.pool.num_blocks, num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.num_queries, prefix_cache_hits=kv.num_hits,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position))
