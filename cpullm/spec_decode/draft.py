"""Draft-model proposals: a smaller model of the same vocabulary continues each decoding
request greedily for k tokens, which the target then verifies in one step.

The draft runs in the engine core's process on a model runner of its own, with its own KV
cache (as many tokens as the target's) and block bookkeeping. It keeps, per request, the
tokens whose KV its cache holds: the request's tokens as of its last proposal and the
proposals it fed back (all but the last). At the next proposal the KV stays valid up to the
first fed proposal the target did not accept, so the draft computes only the tokens after
that: the accepted ones' KV is already there.

The runner holds no state of a request between draft steps: each step sends the request's
tokens whole (as a new request whose prompt they are, the KV before ``num_computed_tokens``
reused), so the proposals it fed and the target rejected never linger in it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cpullm.config import EngineConfig
from cpullm.engine.kv_cache_manager import KVCacheManager
from cpullm.engine.request import Request
from cpullm.engine.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from cpullm.sampling_params import SamplingParams
from cpullm.spec_decode.policy import probe_step

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _DraftState:
    blocks: Request  # the request's blocks in the draft's cache (KVCacheManager's view)
    tokens: list[int] = field(default_factory=list)  # KV of tokens[:computed] is cached
    num_real: int = 0  # of tokens, the request's own (the rest: proposals fed back)


class DraftProposer:
    """Proposes with a draft model (config.SpeculativeConfig ``draft_model``)."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        from cpullm.worker.model_runner import ModelRunner  # (the engine's import order)

        self.config = config
        self.runner = ModelRunner(config, eos_token_ids)
        groups = config.cache.groups
        self.kv_cache_manager = KVCacheManager(config.cache.num_blocks,
                                               config.cache.block_size, False,
                                               groups.windows if groups else (0,))
        self._states: dict[str, _DraftState] = {}
        self._held: set[str] = set()  # requests the runner holds from the last draft step

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, list[int]]:
        live: list[tuple[Request, _DraftState, int]] = []
        for request, most in requests:
            state = self._states.get(request.request_id)
            if state is None:
                state = self._states[request.request_id] = _DraftState(Request(
                    request.request_id, [], _GREEDY, set(), request.max_model_len))
            state.blocks.num_computed_tokens = _still_valid(state, request.all_token_ids)
            state.tokens = list(request.all_token_ids)
            state.num_real = len(state.tokens)
            live.append((request, state, most))
        proposals: dict[str, list[int]] = {}
        for step in range(max(most for _, _, most in live)):
            live = [(r, s, most) for r, s, most in live if most > step and self._room(s)]
            if not live:
                break
            sampled = self._step([s for _, s, _ in live])
            for request, state, _ in live:
                token = sampled.get(request.request_id)
                if token is None:  # (its sampling failed: no more proposals)
                    state.tokens.append(-1)  # never a token: the KV check stops there
                    live = [(r, s, m if r is not request else 0) for r, s, m in live]
                    continue
                state.tokens.append(token)
                state.blocks.num_computed_tokens = len(state.tokens) - 1
                proposals.setdefault(request.request_id, []).append(token)
        return proposals

    def _room(self, state: _DraftState) -> bool:
        """KV slots for the state's tokens not in the draft's cache yet (False: none free;
        the request gets no more proposals this step)."""
        blocks = state.blocks
        return self.kv_cache_manager.allocate_slots(
            blocks, len(state.tokens) - blocks.num_computed_tokens)

    def _step(self, states: list[_DraftState]) -> dict[str, int]:
        """One forward of the draft over each state's uncached tokens; its greedy next
        token for each."""
        ids = [s.blocks.request_id for s in states]
        step = SchedulerOutput(
            scheduled=[ScheduledRequest(s.blocks.request_id, s.blocks.num_computed_tokens,
                                        len(s.tokens) - s.blocks.num_computed_tokens, [], 0,
                                        [list(t) for t in s.blocks.block_tables], sample=True)
                       for s in states],
            num_scheduled_tokens=sum(len(s.tokens) - s.blocks.num_computed_tokens
                                     for s in states),
            new_requests=[NewRequestData(s.blocks.request_id, list(s.tokens), _GREEDY)
                          for s in states],
            finished_request_ids=self._held)
        self._held = set(ids)
        output = self.runner.execute(step)
        return {request_id: tokens[0] for request_id, tokens in
                output.sampled_token_ids.items()}

    def drop(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.kv_cache_manager.free(state.blocks)

    def time_step(self, rows: int) -> float:
        """Seconds of one draft step of ``rows`` decoding requests (policy.probe_step)."""
        step, cleanup = probe_step(rows, len(self.kv_cache_manager.windows))
        start = time.perf_counter()
        self.runner.execute(step)
        elapsed = time.perf_counter() - start
        self.runner.execute(cleanup)
        return elapsed


def _still_valid(state: _DraftState, tokens: list[int]) -> int:
    """How many of ``tokens`` the draft's cache holds the KV of: its cached tokens up to
    the first proposal fed back that the target did not accept."""
    valid = min(state.blocks.num_computed_tokens, state.num_real)
    while valid < state.blocks.num_computed_tokens and valid < len(tokens) \
            and state.tokens[valid] == tokens[valid]:
        valid += 1
    return valid
