"""OutputProcessor: the front end's half of a request, around the engine core's sequences.

A user request with n samples goes to the core as n sequences (``add_request`` returns
their EngineCoreRequests); the core's per-step EngineCoreOutputs come back into
``process``, which detokenizes the new tokens, looks for stop strings, turns logprob rows
into Logprob entries and builds the RequestOutputs. A sequence that a stop string ends is
returned for the core to finish. The same code runs whether the core is in this process
(LLMEngine, the server's engine thread) or in its own (the server's engine-core process).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cpullm.engine.core import EngineCoreOutput, EngineCoreRequest
from cpullm.engine.detokenizer import IncrementalDetokenizer
from cpullm.engine.sched_output import LogprobsLists
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
)
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Sample:
    """Front-end state of one of a request's n samples (one engine-core sequence)."""

    sequence_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    final_sent: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class ProcessedStep:
    """What the front end made of one step."""

    outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    to_finish: list[str] = field(default_factory=list)  # sequences for the core to end
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> its error


@dataclass
class _RequestState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    prompt_logprobs: PromptLogprobs | None
    arrival_time: float
    num_cached_tokens: int = 0
    scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[_RequestState, _Sample]] = {}
        # pooling requests: id -> (prompt, token ids); one sequence each, no text
        self.pooling: dict[str, tuple[str | None, list[int]]] = {}

    def add_request(self, request_id: str, prompt: str | None, token_ids: list[int],
                    params: SamplingParams | PoolingParams, cache_salt: str | None = None,
                    lora: LoRARequest | None = None, images: list[ImageInput] | None = None
                    ) -> list[EngineCoreRequest]:
        """Track a request; returns the sequences the core is to run for it (with the
        LoRA adapter ``lora``)."""
        if request_id in self.requests or request_id in self.pooling:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.monotonic()
        if isinstance(params, PoolingParams):
            if lora is not None or images:
                raise ValueError("a pooling request takes no LoRA adapter and no images")
            self.pooling[request_id] = (prompt, token_ids)
            return [EngineCoreRequest(request_id, token_ids, params, arrival, cache_salt)]
        state = _RequestState(request_id, prompt, token_ids, params, [],
                              [None] if params.prompt_logprobs is not None else None, arrival)
        sequences = []
        for index in range(params.n):
            child_params = params if params.n == 1 else params.clone()
            if index > 0:
                child_params.prompt_logprobs = None  # computed once, by the first sample
            if params.seed is not None:
                child_params.seed = params.seed + index
            sequence_id = request_id if params.n == 1 else f"{index}_{request_id}"
            sample = _Sample(sequence_id, index,
                             IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                             [] if params.logprobs is not None else None,
                             0.0 if params.logprobs is not None else None)
            state.samples.append(sample)
            self._sample_of[sequence_id] = (state, sample)
            sequences.append(EngineCoreRequest(sequence_id, token_ids, child_params, arrival,
                                               cache_salt, lora, images or []))
        self.requests[request_id] = state
        return sequences

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences, for the core to finish."""
        if self.pooling.pop(request_id, None) is not None:
            return [request_id]
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = [s.sequence_id for s in state.samples]
        for sequence_id in ids:
            del self._sample_of[sequence_id]
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pooling)

    def request_of(self, sequence_id: str) -> str | None:
        """The request a sequence belongs to, while it is tracked."""
        if sequence_id in self.pooling:
            return sequence_id
        found = self._sample_of.get(sequence_id)
        return None if found is None else found[0].request_id

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedStep:
        """One step's sequence outputs -> the RequestOutputs to hand out, the sequences the
        core is to finish (ended by stop strings, or of failed requests), and the requests
        that failed. An exception while processing one request (its detokenizer, its
        logprobs) fails that request alone."""
        step = ProcessedStep()
        progressed: dict[str, _RequestState] = {}
        for output in outputs:
            if output.request_id in self.pooling:
                self._pooled(output, step)
                continue
            found = self._sample_of.get(output.request_id)
            if found is None:
                continue  # aborted, failed, or ended by a stop string a step ago
            state, sample = found
            try:
                if self._apply(state, sample, output, step.to_finish):
                    progressed[state.request_id] = state
            except Exception as e:  # noqa: BLE001 - the request fails, the step goes on
                self._fail(state, e, step)
                progressed.pop(state.request_id, None)
        for state in progressed.values():
            try:
                request_output = self._make_output(state)
            except Exception as e:  # noqa: BLE001
                self._fail(state, e, step)
                continue
            if request_output is not None:
                step.outputs.append(request_output)
            if state.finished:
                self.abort_request(state.request_id)  # done: forget it
        return step

    def _pooled(self, output: EngineCoreOutput, step: ProcessedStep) -> None:
        """A pooling request's one output: its pooled tensor, or its error."""
        prompt, token_ids = self.pooling.pop(output.request_id)
        if output.error is not None or output.pooled is None:
            step.failed[output.request_id] = RuntimeError(output.error or "no pooled output")
            return
        step.outputs.append(PoolingRequestOutput(output.request_id, PoolingOutput(output.pooled),
                                                 token_ids, True, prompt))

    def _fail(self, state: _RequestState, error: Exception, step: ProcessedStep) -> None:
        step.failed[state.request_id] = error
        step.to_finish.extend(self.abort_request(state.request_id))

    def _apply(self, state: _RequestState, sample: _Sample, output: EngineCoreOutput,
               to_finish: list[str]) -> bool:
        """One sequence's output into its sample; True if the sample got new tokens."""
        if output.error is not None:  # the engine core failed this sequence alone
            raise RuntimeError(output.error)
        if output.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, output.prompt_logprobs_start,
                                      output.prompt_logprobs)
        if not output.new_token_ids or sample.finish_reason is not None:
            return False
        if output.logprobs is not None:
            self._add_logprobs(sample, output.logprobs)
        sample.token_ids.extend(output.new_token_ids)
        stopped_by_token = output.finish_reason == "stop"
        stop_str = sample.detokenizer.update(output.new_token_ids, skip_last=stopped_by_token)
        if output.finish_reason is not None:
            sample.finish_reason = output.finish_reason
            sample.stop_reason = output.stop_reason
        elif stop_str is not None:
            sample.finish_reason = "stop"
            sample.stop_reason = stop_str
            to_finish.append(sample.sequence_id)
        if sample.index == 0:
            state.num_cached_tokens = output.num_cached_tokens
            state.scheduled_time = output.scheduled_time
        sample.first_token_time = output.first_token_time
        sample.last_token_time = output.last_token_time
        return True

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        entry = {ids[0]: Logprob(lps[0], rank, self._decode_token(ids[0]))}
        for top_rank, (token_id, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            entry.setdefault(token_id, Logprob(lp, top_rank, self._decode_token(token_id)))
        return entry

    def _add_logprobs(self, sample: _Sample, rows: LogprobsLists) -> None:
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        for ids, lps, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
            sample.logprobs.append(self._logprob_dict(ids, lps, rank))
            sample.cumulative_logprob += lps[0]

    def _add_prompt_logprobs(self, state: _RequestState, first: int,
                             rows: LogprobsLists) -> None:
        """Rows for prompt positions ``first``, ``first`` + 1, ... (predicting the next)."""
        if state.prompt_logprobs is None:
            return
        for offset, (ids, lps, rank) in enumerate(zip(rows.token_ids, rows.logprobs, rows.ranks,
                                                      strict=True)):
            if first + offset + 1 < len(state.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            state.prompt_logprobs.append(self._logprob_dict(ids, lps, rank))

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for sample in state.samples:
            start = sample.num_sent_tokens if delta else 0
            if delta and start == len(sample.token_ids) and (
                    sample.finish_reason is None or sample.final_sent):
                continue  # nothing new for this sample
            text = sample.detokenizer.delta(sample.finish_reason is not None) if delta \
                else sample.detokenizer.output_text
            sample.num_sent_tokens = len(sample.token_ids)
            sample.final_sent = sample.finish_reason is not None
            logprobs = sample.logprobs[start:] if sample.logprobs is not None else None
            completions.append(CompletionOutput(
                index=sample.index, text=text, token_ids=sample.token_ids[start:],
                cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        metrics = {"arrival_time": state.arrival_time}
        first = state.samples[0]
        if state.scheduled_time is not None:
            metrics["scheduled_time"] = state.scheduled_time
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        last = [s.last_token_time for s in state.samples if s.last_token_time is not None]
        if last:
            metrics["last_token_time"] = max(last)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, prompt_logprobs=state.prompt_logprobs,
            outputs=completions, finished=finished, num_cached_tokens=state.num_cached_tokens,
            metrics=metrics)
