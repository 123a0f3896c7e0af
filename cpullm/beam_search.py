"""Beam search, as vLLM's ``LLM.beam_search`` and ``use_beam_search`` offer it, searched the
way transformers' ``generate(num_beams=...)`` searches (its default early stopping), so the
two give the same sequences on the same weights.

Each step scores every running beam as a one-token request of its whole sequence, asking
for the top log-probabilities of the next token: prefix caching shares the beams' full KV
blocks, so a step computes only each beam's tokens past its last full block. Of the
``(1 + EOS ids) * beam_width`` best continuations over all beams, those among the first
``beam_width`` that end (an EOS token, or ``max_tokens`` reached) join the finished
hypotheses, scored by their summed log-probability over ``generated ** length_penalty``;
the best ``beam_width`` that go on are the next beams. The search ends when the finished
hypotheses fill ``beam_width`` places and no running beam can beat the worst of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from cpullm.outputs import CompletionOutput, Logprob, RequestOutput
from cpullm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. ``temperature`` is accepted as vLLM's is: the beams
    are ranked by the model's own log-probabilities whatever it is."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width: must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be at least 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """A finished beam: its tokens (the prompt's first, as vLLM's), the log-probability of
    each generated token, their sum, and the generated text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    score: float = 0.0  # cum_logprob / generated ** length_penalty, what ranks the beams


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of a prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: ``requests`` gives the sequences to score next, ``advance`` takes
    their top log-probabilities."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: set[int]) -> None:
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        # enough candidates that beam_width of them go on even if each EOS id ends one
        self.candidates = max(2, 1 + len(eos_token_ids)) * params.beam_width
        self.running = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.generated = 0
        self.done = False

    def requests(self) -> list[list[int]]:
        return [beam.tokens for beam in self.running]

    def advance(self, tops: Sequence[dict[int, float]]) -> None:
        """``tops[i]``: the next token's most likely ids and log-probabilities after running
        beam ``i`` (at least ``self.candidates`` of them)."""
        width = self.params.beam_width
        ranked = sorted(((beam.cum_logprob + logprob, i, token, logprob)
                         for i, (beam, top) in enumerate(zip(self.running, tops, strict=True))
                         for token, logprob in top.items()),
                        key=lambda c: (-c[0], c[1], c[2]))[:self.candidates]
        self.generated += 1
        last = self.generated >= self.params.max_tokens
        running = []
        for rank, (total, i, token, logprob) in enumerate(ranked):
            ends = last or token in self.eos
            if (ends and rank >= width) or (not ends and len(running) == width):
                continue
            parent = self.running[i]
            beam = BeamSearchSequence(parent.tokens + [token],
                                      parent.logprobs + [{token: Logprob(logprob)}], total)
            if ends:
                beam.finish_reason = "stop" if token in self.eos else "length"
                beam.stop_reason = token if token in self.eos else None
                beam.score = total / self.generated ** self.params.length_penalty
                self.finished.append(beam)
            else:
                running.append(beam)
        self.finished = sorted(self.finished, key=lambda b: -b.score)[:width]
        self.running = running
        if not running:
            self.done = True
        elif len(self.finished) == width:
            # the best any running beam could score, were it to end now
            best = running[0].cum_logprob / self.generated ** self.params.length_penalty
            self.done = best <= self.finished[-1].score

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        for beam in self.finished:
            generated = beam.tokens[self.prompt_len:]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = decode(generated)
        return BeamSearchOutput(self.finished)


def step_params(search: BeamSearch) -> SamplingParams:
    """A step's request: one greedy token, with the top log-probabilities beam search
    ranks by."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=search.candidates,
                          ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def top_logprobs(output: RequestOutput, k: int) -> dict[int, float]:
    """The k most likely next tokens of a step's output (its logprobs hold the chosen
    token and the top k)."""
    entry = output.outputs[0].logprobs[0]  # type: ignore[index]
    return {token: lp.logprob for token, lp in entry.items()
            if lp.rank is not None and lp.rank <= k}


def run(searches: list[BeamSearch],
        score: Callable[[list[list[int]], SamplingParams], list[RequestOutput]]) -> None:
    """Step every search to its end; ``score`` runs a batch of one-token requests."""
    while active := [s for s in searches if not s.done]:
        batch = [tokens for search in active for tokens in search.requests()]
        outputs = iter(score(batch, step_params(active[0])))
        for search in active:
            search.advance([top_logprobs(next(outputs), search.candidates)
                            for _ in search.running])


async def run_async(search: BeamSearch,
                    score: Callable[[list[int], SamplingParams], Awaitable[RequestOutput]]
                    ) -> None:
    """``run`` for one search on the server, whose engine batches the beams' requests."""
    import asyncio

    params = step_params(search)
    while not search.done:
        outputs = await asyncio.gather(*(score(tokens, params) for tokens in search.requests()))
        search.advance([top_logprobs(output, search.candidates) for output in outputs])


def as_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      result: BeamSearchOutput) -> RequestOutput:
    """A search's sequences as one request's ``n`` completions."""
    outputs = [CompletionOutput(i, beam.text or "", beam.tokens[len(prompt_token_ids):],
                                beam.cum_logprob, None, beam.finish_reason, beam.stop_reason)
               for i, beam in enumerate(result.sequences)]
    return RequestOutput(request_id, prompt, prompt_token_ids, None, outputs, True)


def check_length(prompt_token_ids: list[int], params: BeamSearchParams,
                 max_model_len: int) -> None:
    """Refuse a prompt whose beams would outgrow the context."""
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise ValueError(f"prompt: the prompt has {len(prompt_token_ids)} tokens and "
                         f"max_tokens is {params.max_tokens}, more than the maximum model "
                         f"length, {max_model_len}")


def check_width(params: BeamSearchParams, max_logprobs: int, vocab_size: int,
                eos_token_ids: set[int]) -> None:
    """Refuse a width whose candidates the engine cannot report (--max-logprobs)."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    needed = max(2, 1 + len(eos_token_ids)) * params.beam_width
    if needed > limit:
        raise ValueError(f"beam_width: {params.beam_width} beams need the top {needed} "
                         f"log-probabilities of each step, more than the engine's "
                         f"--max-logprobs ({limit}); raise it or narrow the beam")

