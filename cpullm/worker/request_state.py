"""What a model runner holds of each request between steps: the prompt and parameters it
got once, the output tokens and block tables it was sent since, and the step's share
(engine/sched_output.py sends only the changes)."""

from __future__ import annotations

from typing import Any

from cpullm.engine.sched_output import SchedulerOutput
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams


class RequestState:
    """One request as the runner sees it; the fields after ``block_tables`` describe the
    step that schedules it now (a request is in one step at a time)."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "output_token_ids",
                 "block_tables", "num_computed_tokens", "num_tokens", "sample", "long_rope",
                 "spec_token_ids", "lora_id", "images")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | PoolingParams, lora_id: int = 0,
                 images: list[Any] | None = None) -> None:
        self.request_id = request_id
        self.lora_id = lora_id  # its LoRA adapter (0: the base model)
        self.images = images or []  # its prompt's (multimodal.ImageInput)
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.block_tables: list[list[int]] = []  # per KV cache group
        self.num_computed_tokens = 0  # position of the step's first token
        self.num_tokens = 0  # tokens the step computes
        self.sample = False  # the step reaches the last token, so it samples the next
        self.long_rope = False  # LongRoPE: the positions take the long factors
        self.spec_token_ids: list[int] = []  # proposed tokens, the step's last ones

    @property
    def num_rows(self) -> int:
        """The positions that sample this step: the last one, and before it one per
        proposed token (0: a prompt chunk that does not reach the end)."""
        return 1 + len(self.spec_token_ids) if self.sample else 0

    @property
    def token_ids(self) -> list[int]:
        """The tokens the step computes."""
        prompt, start, end = self.prompt_token_ids, self.num_computed_tokens, \
            self.num_computed_tokens + self.num_tokens - len(self.spec_token_ids)
        known = self._known_tokens(prompt, start, end)
        return known + self.spec_token_ids if self.spec_token_ids else known

    def _known_tokens(self, prompt: list[int], start: int, end: int) -> list[int]:
        if end <= len(prompt):
            return prompt[start:end]
        first = max(start - len(prompt), 0)
        outputs = self.output_token_ids[first:end - len(prompt)]
        return prompt[start:] + outputs if start < len(prompt) else outputs


class RequestStates:
    """The runner's requests by id, brought up to date by each step's SchedulerOutput."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> list[RequestState]:
        """Drop the finished requests, take in the new ones and apply the step's changes;
        returns the step's requests in the scheduler's order."""
        for request_id in scheduler_output.finished_request_ids:
            self._states.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self._states[new.request_id] = RequestState(new.request_id, new.prompt_token_ids,
                                                        new.sampling_params, new.lora_id,
                                                        new.images)
        items = []
        for step in scheduler_output.scheduled:
            state = self._states[step.request_id]
            state.output_token_ids.extend(step.new_token_ids)
            if not state.block_tables:
                state.block_tables = [[] for _ in step.new_block_ids]
            for table, new_ids in zip(state.block_tables, step.new_block_ids, strict=True):
                del table[step.block_start:]
                table.extend(new_ids)
            state.num_computed_tokens = step.num_computed_tokens
            state.num_tokens = step.num_tokens
            state.sample = step.sample
            state.long_rope = step.long_rope
            state.spec_token_ids = step.spec_token_ids
            items.append(state)
        return items

    def __len__(self) -> int:
        return len(self._states)

