"""LLMEngine: requests in, RequestOutputs out, one step at a time."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from cpullm.config import EngineConfig
from cpullm.engine.detokenizer import IncrementalDetokenizer
from cpullm.engine.request import Request, RequestStatus
from cpullm.engine.sched_output import LogprobsLists
from cpullm.engine.scheduler import Scheduler
from cpullm.engine_args import EngineArgs
from cpullm.logger import init_logger
from cpullm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from cpullm.sampling_params import RequestOutputKind, SamplingParams
from cpullm.transformers_utils import load_tokenizer
from cpullm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

Prompt = str | list[int] | dict[str, Any]


@dataclass
class _Sample:
    """Engine-side state of one of a request's n samples (one scheduler Request)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    final_sent: bool = False


@dataclass
class _RequestState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    prompt_logprobs: PromptLogprobs | None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    """The engine loop: ``add_request``, then ``step()`` until no request is left.

    Each step: 1. the scheduler picks requests and token counts, 2. the model runner runs
    one forward pass and samples, 3. the scheduler advances requests and applies token
    stops, 4. new tokens are detokenized, stop strings checked, outputs built.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model
        self.tokenizer = load_tokenizer(model_config.source, model_config.tokenizer,
                                        model_config.hf_config)
        if model_config.chat_template:
            self.tokenizer.chat_template = model_config.chat_template
        self.eos_token_ids = self._eos_token_ids()
        torch.manual_seed(model_config.seed)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.model_runner = ModelRunner(config, self.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[_RequestState, _Sample]] = {}
        self._ids = itertools.count()
        self.last_step_num_tokens = 0  # prompt and output tokens computed by the last step

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for value in (getattr(self.config.model.hf_config, "eos_token_id", None),
                      self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(value)
        return ids

    # ---- requests in -------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt is text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, prompt
        raise ValueError("prompt: expected a string or a list of token ids, "
                         f"got {type(prompt).__name__}")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            chat_template: str | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            **template_kwargs: Any) -> str:
        if not messages:
            raise ValueError("messages: at least one message is required")
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("chat_template: the model has no chat template; pass one")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **template_kwargs)

    def add_request(self, request_id: str | None, prompt: Prompt,
                    params: SamplingParams) -> str:
        """Queue a request; returns its id. Bad prompts raise ValueError."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._check_prompt(token_ids)
        state = _RequestState(request_id, text, token_ids, params, [],
                              [None] if params.prompt_logprobs is not None else None)
        for index in range(params.n):
            child_params = params if params.n == 1 else params.clone()
            if index > 0:
                child_params.prompt_logprobs = None  # computed once, by the first sample
            if params.seed is not None:
                child_params.seed = params.seed + index
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = Request(child_id, token_ids, child_params, self.eos_token_ids,
                              self.config.model.max_model_len)
            sample = _Sample(request, index, IncrementalDetokenizer(self.tokenizer, token_ids,
                                                                    child_params),
                             [] if params.logprobs is not None else None,
                             0.0 if params.logprobs is not None else None)
            state.samples.append(sample)
            self._sample_of[child_id] = (state, sample)
            self.scheduler.add_request(request)
        self.requests[request_id] = state
        return request_id

    def _check_prompt(self, token_ids: list[int]) -> None:
        max_len = self.config.model.max_model_len
        if not token_ids:
            raise ValueError("prompt: the prompt is empty")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt: the prompt has {len(token_ids)} tokens, but the maximum "
                             f"model length is {max_len} (and at least one token must be "
                             "generated)")
        vocab = self.config.model.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            ids = [s.request.request_id for s in state.samples]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for child_id in ids:
                del self._sample_of[child_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        # 1. Schedule.
        scheduler_output = self.scheduler.schedule()
        self.last_step_num_tokens = scheduler_output.num_scheduled_tokens
        # 2. One forward pass and sampling.
        runner_output = self.model_runner.execute(scheduler_output)
        # 3. Prompt logprobs belong to positions from num_computed_tokens, before the update.
        for request_id, rows in runner_output.prompt_logprobs.items():
            state, sample = self._sample_of[request_id]
            self._add_prompt_logprobs(state, sample.request, rows)
        # 4. Advance requests; token stops (eos, stop ids, length) end them here.
        updated = self.scheduler.update_from_output(scheduler_output,
                                                    runner_output.sampled_token_ids)
        # 5. Detokenize, stop strings, outputs.
        progressed: dict[str, _RequestState] = {}
        for request in updated:
            state, sample = self._sample_of[request.request_id]
            sample_rows = runner_output.logprobs.get(request.request_id)
            if sample_rows is not None:
                self._add_logprobs(sample, sample_rows)
            token = request.output_token_ids[-1]
            stopped_by_token = (request.status == RequestStatus.FINISHED_STOPPED)
            stop_str = sample.detokenizer.update([token], skip_last=stopped_by_token)
            if stop_str is not None and not request.status.finished:
                request.stop_reason = stop_str
                self.scheduler.finish_requests([request.request_id],
                                               RequestStatus.FINISHED_STOPPED)
            if request.status.finished:
                sample.finish_reason = request.status.finish_reason
            progressed[state.request_id] = state
        outputs = []
        for state in progressed.values():
            output = self._make_output(state)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self._drop(state)
        return outputs

    def _drop(self, state: _RequestState) -> None:
        del self.requests[state.request_id]
        for sample in state.samples:
            del self._sample_of[sample.request.request_id]

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        entry = {ids[0]: Logprob(lps[0], rank, self._decode_token(ids[0]))}
        for top_rank, (token_id, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            entry.setdefault(token_id, Logprob(lp, top_rank, self._decode_token(token_id)))
        return entry

    def _add_logprobs(self, sample: _Sample, rows: LogprobsLists) -> None:
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        entry = self._logprob_dict(rows.token_ids[0], rows.logprobs[0], rows.ranks[0])
        sample.logprobs.append(entry)
        sample.cumulative_logprob += rows.logprobs[0][0]

    def _add_prompt_logprobs(self, state: _RequestState, request: Request,
                             rows: LogprobsLists) -> None:
        assert state.prompt_logprobs is not None
        first = request.num_computed_tokens  # position of the first row
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
            request = sample.request
            start = sample.num_sent_tokens if delta else 0
            if delta and start == len(request.output_token_ids) and (
                    sample.finish_reason is None or sample.final_sent):
                continue  # nothing new for this sample
            text = sample.detokenizer.delta(sample.finish_reason is not None) if delta \
                else sample.detokenizer.output_text
            sample.num_sent_tokens = len(request.output_token_ids)
            sample.final_sent = sample.finish_reason is not None
            logprobs = sample.logprobs[start:] if sample.logprobs is not None else None
            completions.append(CompletionOutput(
                index=sample.index, text=text, token_ids=request.output_token_ids[start:],
                cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
                finish_reason=sample.finish_reason, stop_reason=request.stop_reason))
        first = state.samples[0].request
        state.num_cached_tokens = first.num_cached_tokens
        state.metrics = {"arrival_time": first.arrival_time}
        for name in ("scheduled_time", "first_token_time"):
            if getattr(first, name) is not None:
                state.metrics[name] = getattr(first, name)
        last = [s.request.last_token_time for s in state.samples
                if s.request.last_token_time is not None]
        if last:
            state.metrics["last_token_time"] = max(last)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, prompt_logprobs=state.prompt_logprobs,
            outputs=completions, finished=finished, num_cached_tokens=state.num_cached_tokens,
            metrics=dict(state.metrics))
