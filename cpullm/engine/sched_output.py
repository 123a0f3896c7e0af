"""The one contract between the scheduler and the model runner, imported by both sides:
a SchedulerOutput goes down (which requests run this step, which tokens each), a
ModelRunnerOutput comes back (the sampled token of each request that sampled, and its
logprobs; or, for a pooling model, each finished input's pooled output). Plain values
only, so the runner can move into another process behind it.

A request's prompt and parameters go down once, in the first step that schedules it
(``NewRequestData``); every step after carries only what changed (``ScheduledRequest``:
the tokens sampled since, the blocks added), and the runner keeps the rest
(cpullm/worker/request_state.py), as vLLM v1's ``NewRequestData`` / ``CachedRequestData``
do. So a step's message grows with the number of requests, not with their lengths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen: sent with the first step that schedules it, and
    kept by the runner until the request is among a step's ``finished_request_ids``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | PoolingParams  # PoolingParams: a pooling request
    lora_id: int = 0  # its LoRA adapter (0: the base model)
    images: list[Any] = field(default_factory=list)  # its prompt's (multimodal.ImageInput)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step, as a change to what the runner already holds."""

    request_id: str
    num_computed_tokens: int  # position of the first token to compute
    num_tokens: int  # tokens to compute: positions num_computed_tokens and on
    new_token_ids: list[int]  # output tokens sampled since the request's previous step
    # The block tables (one per KV cache group) from entry ``block_start`` on; the runner's
    # entries before it stand.
    block_start: int
    new_block_ids: list[list[int]]
    sample: bool  # this step reaches the request's last token, so it samples the next one
    long_rope: bool = False  # LongRoPE: this request's positions take the long factors
    # speculative decoding: the proposed tokens, the last of the step's num_tokens (the
    # step samples after each, and keeps those the samples confirm)
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """The contract going down to the model runner."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests scheduled for the first time since the runner last had them.
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests finished since the previous step, that no step in flight holds: the runner
    # drops their state.
    finished_request_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class LogprobsLists:
    """Per row: token ids [chosen, top-1, ..., top-k], their logprobs, the chosen one's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """The contract coming back: the new tokens of every request that sampled."""

    # request id -> its new token; with speculation, the accepted proposals and the token
    # after them
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> one row per new token
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # request id -> one row per prompt position computed this step (predicting the next)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # request id -> why its own sampling raised (that request fails, the others go on)
    failed: dict[str, str] = field(default_factory=dict)
    # pooling models: request id -> its pooled output (an embedding, class probabilities
    # or a score), float32, when the step computed its whole input
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
