"""What the engine hands back: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class Logprob:
    """Log probability of one token, its rank among all tokens (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are ``n`` of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request, as vLLM's ``RequestOutput``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PoolingOutput:
    """A pooling request's output: the pooled tensor (float32)."""

    data: Any  # torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request, as vLLM's ``PoolingRequestOutput``."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class _TypedPoolingRequestOutput:
    """A pooling request's output as the task reads it (vLLM's shapes)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    output_class: ClassVar[type] = EmbeddingOutput

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> Any:
        return cls(output.request_id, cls.output_class(output.outputs.data.tolist()),
                   output.prompt_token_ids, output.finished)


@dataclass
class EmbeddingRequestOutput(_TypedPoolingRequestOutput):
    """``LLM.embed``'s output: ``outputs.embedding``."""

    outputs: EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_TypedPoolingRequestOutput):
    """``LLM.classify``'s output: ``outputs.probs``."""

    outputs: ClassificationOutput
    output_class: ClassVar[type] = ClassificationOutput


@dataclass
class ScoringRequestOutput(_TypedPoolingRequestOutput):
    """``LLM.score``'s output: ``outputs.score``."""

    outputs: ScoringOutput
