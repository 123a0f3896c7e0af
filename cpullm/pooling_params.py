"""PoolingParams: what a pooling request (an embedding, a classification, a score) asks
of the model's pooled output, in vLLM's names."""

from __future__ import annotations

import copy
from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """``task``: "embed" (a vector per input), "classify" (class probabilities) or "score"
    (a cross-encoder's relevance of a pair). ``dimensions``: keep the first so many
    dimensions of an embedding (Matryoshka models), renormalized; ``normalize``: scale an
    embedding to unit length (None: as the model's pooler says); ``activation``: softmax
    (or a sigmoid for one label) on class and score logits (None: yes);
    ``truncate_prompt_tokens``: keep the last so many tokens of a longer input (-1: the
    model's maximum length) instead of refusing it."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task: expected one of {', '.join(POOLING_TASKS)}, got "
                             f"{self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int)
                or self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0):
            raise ValueError("truncate_prompt_tokens must be -1 (the model's maximum length) or "
                             f"a positive integer, got {self.truncate_prompt_tokens!r}")

    def clone(self) -> PoolingParams:
        return copy.copy(self)
