"""When speculation pays on a CPU, step by step.

Verifying k proposals makes a decode step of B requests one of B (k + 1) rows. Where the
step is bound by reading the weights (a few streams) the extra rows are nearly free; where
it is bound by arithmetic (many streams, few cores) they cost nearly in proportion, and
speculation loses. The policy weighs the two with figures of this machine and model: the
time of a decode step of r rows, measured at startup (``measure``), and the share of
proposed tokens the recent steps accepted. Each step it picks the number of proposals per
request k' <= k that maximizes

    expected tokens per request a step / step time relative to no proposals
    = (1 + a + a^2 + ... + a^k') / (t(B (k' + 1)) / t(B))

(a: the acceptance rate, each proposal kept only if the ones before it were; a step's time
also counts each row's read of its request's KV, from the KV bytes and a plain read's
bandwidth, since the probes' contexts are short), and proposes nothing where no k' beats 1.
While it proposes nothing for want of acceptance, one step in ``PROBE_EVERY`` proposes
anyway, so that the rate follows the workload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cpullm.config import SpeculativeConfig
from cpullm.engine.request import Request
from cpullm.engine.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from cpullm.sampling_params import SamplingParams

# decode rows whose step time is measured at startup; above the largest, time grows as
# between the last two (the arithmetic-bound regime, linear in the rows)
MEASURED_ROWS = (1, 2, 4, 8, 16, 32)
PROBE_EVERY = 16
# how much each verified proposal's outcome keeps of the earlier ones' weight
_DECAY = 0.97


def probe_step(rows: int, num_groups: int) -> tuple[SchedulerOutput, SchedulerOutput]:
    """A decode step of ``rows`` placeholder requests to time, each sampling greedily (row
    i at position i of the first KV block, which no request holds before the engine
    serves), and the step after it that drops them."""
    ids = [f"-probe-{i}" for i in range(rows)]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    step = SchedulerOutput(
        scheduled=[ScheduledRequest(request_id, i, 1, [], 0, [[0]] * num_groups, sample=True)
                   for i, request_id in enumerate(ids)],
        num_scheduled_tokens=rows,
        new_requests=[NewRequestData(request_id, [0] * (i + 1), greedy)
                      for i, request_id in enumerate(ids)])
    return step, SchedulerOutput([], 0, finished_request_ids=set(ids))


class Proposer(Protocol):
    """What proposes tokens for the decoding requests of a step."""

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Per request (with the most tokens it may get): its proposed tokens, if any."""

    def drop(self, request_id: str) -> None:
        """Forget a request that finished."""


class SpeculationPolicy:
    """The number of tokens to propose per decoding request in each step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.step_seconds: dict[int, float] = {}  # decode rows -> seconds a step (measured)
        self.draft_seconds: dict[int, float] = {}  # the same of the draft model's steps
        # seconds to read one token's K and V of every layer (0: not measured)
        self.kv_seconds_per_token = 0.0
        # accepted proposals and trials (each accepted one, and the first rejected one of a
        # request's step), decayed: their ratio estimates a, 0.5 before any is verified
        self._accepted, self._trials = 1.0, 2.0
        self._idle_steps = 0  # steps in a row that proposed nothing for want of acceptance

    def measure(self, time_step: Callable[[int], float], max_rows: int,
                time_draft_step: Callable[[int], float] | None = None,
                kv_seconds_per_token: float = 0.0) -> None:
        """Time decode steps of each of MEASURED_ROWS rows up to ``max_rows``:
        ``time_step(rows)`` runs one and returns its seconds (the least of three runs after
        a warm-up one is kept); ``time_draft_step`` the same of a draft model's. A step of
        fewer rows is taken to be no slower than one of more (a slow run is noise)."""
        self.kv_seconds_per_token = kv_seconds_per_token
        for times, run in ((self.step_seconds, time_step), (self.draft_seconds,
                                                             time_draft_step)):
            if run is None:
                continue
            for rows in MEASURED_ROWS:
                if rows > max_rows:
                    break
                run(rows)
                times[rows] = min(run(rows) for _ in range(3))
            fastest = float("inf")
            for rows in sorted(times, reverse=True):
                fastest = times[rows] = min(times[rows], fastest)

    def step_time(self, rows: int) -> float:
        """Seconds of a decode step of ``rows`` rows, from the measured ones."""
        return _interpolate(self.step_seconds, rows)

    def num_proposals(self, num_decoding: int, context_tokens: int = 0) -> int:
        """How many tokens to propose per request in a step of ``num_decoding`` decoding
        requests whose contexts hold ``context_tokens`` tokens in all (0: none)."""
        config = self.config
        if num_decoding == 0 or (config.disable_by_batch_size is not None
                                 and num_decoding >= config.disable_by_batch_size):
            return 0
        k = config.num_speculative_tokens
        if len(self.step_seconds) < 2:  # not measured: always, as vLLM
            return k
        base = self._cost(num_decoding, context_tokens, 0)
        best, best_gain = 0, 1.0
        expected, term = 1.0, 1.0
        for proposals in range(1, k + 1):
            term *= self.acceptance
            expected += term
            gain = expected * base / self._cost(num_decoding, context_tokens, proposals)
            if gain > best_gain:
                best, best_gain = proposals, gain
        if best == 0 and k + 1 > self._cost(num_decoding, context_tokens, k) / base:
            # (it would pay were every proposal accepted) only for want of acceptance:
            # now and then propose anyway, to measure it
            self._idle_steps += 1
            if self._idle_steps % PROBE_EVERY == 0:
                return k
        else:
            self._idle_steps = 0
        return best

    def _cost(self, num_decoding: int, context_tokens: int, proposals: int) -> float:
        """Seconds of a step with ``proposals`` tokens per decoding request: its rows, each
        row's read of its request's KV, and the draft's steps that proposed them."""
        rows = proposals + 1
        cost = self.step_time(num_decoding * rows) \
            + rows * context_tokens * self.kv_seconds_per_token
        if proposals and self.draft_seconds:
            cost += proposals * _interpolate(self.draft_seconds, num_decoding)
        return cost

    @property
    def acceptance(self) -> float:
        """The chance that a proposal is accepted where the ones before it were."""
        return self._accepted / self._trials

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """A verifying step's outcome for one request."""
        if num_proposed:
            trials = num_accepted + (num_accepted < num_proposed)
            decay = _DECAY ** trials
            self._accepted = self._accepted * decay + num_accepted
            self._trials = self._trials * decay + trials


def _interpolate(seconds: dict[int, float], rows: int) -> float:
    """Seconds of a step of ``rows`` rows from the measured ``seconds`` by rows: linear
    between two, past the largest on the slope of the last two."""
    known = sorted(seconds)
    below = max((r for r in known if r <= rows), default=known[0])
    above = min((r for r in known if r >= rows), default=None)
    if above is None:
        above, below = known[-1], known[-2] if len(known) > 1 else known[-1]
    if above == below:
        return seconds[above] * (rows / above if rows > above else 1.0)
    slope = (seconds[above] - seconds[below]) / (above - below)
    return seconds[below] + slope * (rows - below)
