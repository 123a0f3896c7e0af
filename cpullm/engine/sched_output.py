"""The one contract between the scheduler and the model runner, imported by both sides:
a SchedulerOutput goes down (which requests run this step, which tokens each), a
ModelRunnerOutput comes back (the sampled token of each request that sampled, and its
logprobs; or, for a pooling model, each finished input's pooled output). Plain values
only, so the runner can move into another process behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step, as the model runner needs it."""

    request_id: str
    token_ids: list[int]  # the tokens to compute: all_token_ids[num_computed_tokens:][:n]
    num_computed_tokens: int  # position of token_ids[0]
    block_tables: list[list[int]]  # per KV cache group
    sample: bool  # this step reaches the request's last token, so it samples the next one
    sampling_params: SamplingParams | PoolingParams  # PoolingParams: a pooling request
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    long_rope: bool = False  # LongRoPE: this request's positions take the long factors


@dataclass(slots=True)
class SchedulerOutput:
    """The contract going down to the model runner."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests finished since the previous step: the runner drops their state (generators).
    finished_request_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class LogprobsLists:
    """Per row: token ids [chosen, top-1, ..., top-k], their logprobs, the chosen one's rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """The contract coming back: the new token of every request that sampled."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # request id -> one row for its new token
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # request id -> one row per prompt position computed this step (predicting the next)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # request id -> why its own sampling raised (that request fails, the others go on)
    failed: dict[str, str] = field(default_factory=dict)
    # pooling models: request id -> its pooled output (an embedding, class probabilities
    # or a score), float32, when the step computed its whole input
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
