"""SamplingParams: how one request picks its tokens, checked when it is built."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass

from cpullm.structured_output import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# top log-probabilities a request may ask for, unless --max-logprobs says otherwise (vLLM's)
DEFAULT_MAX_LOGPROBS = 20
MAX_N = 128  # samples per request (OpenAI's limit): each is a sequence of its own
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries what is new since the last one (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (offline generate)


@dataclass
class SamplingParams:
    """Sampling parameters with vLLM's names and defaults.

    Invalid values raise ``ValueError`` naming the field; the server turns that into a 400.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # the tokens held to a JSON schema, regex, choice or grammar (cpullm/structured_output.py)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}.")

        check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n",
              f"must be an integer in [1, {MAX_N}]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than zero")
        check(self.temperature >= 0.0, "temperature", "must be non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              "must be -1 (disable), 0 (disable) or at least 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or (isinstance(self.seed, int)
                                    and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
              "seed", "must be an integer in [-2^63, 2^64 - 1]")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                          and self.max_tokens >= 1),
              "max_tokens", "must be at least 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
              "must be greater than or equal to 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be less than or equal to max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # (the upper bound is the engine's --max-logprobs: Frontend.check_params)
            check(value is None or (isinstance(value, int) and value >= 0), name,
                  "must be a non-negative integer")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a list of non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be a list of non-negative token ids")
        if self.logit_bias:
            check(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias",
                  "values must be in [-100, 100]")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
