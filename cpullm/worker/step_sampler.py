"""Sampling a step's rows: one per sampling request, and with speculative decoding one
more per proposed token, each sampled as if the proposals before it were the request's
output; the proposals its rows confirm are kept (``accepted``). The sampler keeps what
sampling needs across steps: each seeded request's generator and each grammar's matcher.
"""

from __future__ import annotations

import numpy as np
import torch

from cpullm.engine.sched_output import LogprobsLists, ModelRunnerOutput
from cpullm.logger import init_logger
from cpullm.sampling_params import SamplingParams
from cpullm.structured_output import GuidedDecoding
from cpullm.worker.request_state import RequestState
from cpullm.worker.sampler import Sampler, SamplingBatch

logger = init_logger(__name__)


class StepSampler:
    """A model runner's sampling: ``sample`` a step's rows, ``drop`` a finished request."""

    def __init__(self, sampler: Sampler, guided: GuidedDecoding) -> None:
        self.sampler = sampler
        self.guided = guided
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own

    def drop(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.guided.drop(request_id)

    def sample(self, sampled: list[RequestState], logits: torch.Tensor,
               output: ModelRunnerOutput, generator: torch.Generator | None = None) -> None:
        """The new tokens (and logprobs) of every sampling request, in one batch of rows
        (``RequestState.num_rows`` each); if the batch raises, each request alone, so that
        one whose sampling raises fails by itself (``output.failed``) and the others get
        their tokens. A request with proposed tokens keeps those its samples confirm
        (``accepted``)."""
        guided_rows, allowed, failed = self.guided.masks(
            [r.request_id for r in sampled], [r.sampling_params for r in sampled],
            [r.output_token_ids for r in sampled])
        output.failed.update(failed)
        # the grammar's tokens by request (a guided request is never given proposals)
        masks = {sampled[row].request_id: allowed[n] for n, row in enumerate(guided_rows)}
        if failed:  # those rows are not sampled
            ends = np.cumsum([r.num_rows for r in sampled])
            index = [row for r, end in zip(sampled, ends, strict=True)
                     if r.request_id not in failed for row in range(end - r.num_rows, end)]
            sampled = [r for r in sampled if r.request_id not in failed]
            logits = logits[index]
            if not sampled:
                return
        try:
            results = [(sampled, self.sampler(logits, self._batch(sampled, masks, generator)))]
        except Exception:  # noqa: BLE001 - found out request by request below
            logger.exception("Sampling a batch of %d failed; sampling each request alone",
                             len(sampled))
            results = []
            start = 0
            for item in sampled:
                rows = logits[start:start + item.num_rows]
                start += item.num_rows
                try:
                    result = self.sampler(rows, self._batch([item], masks, generator))
                except Exception as e:  # noqa: BLE001 - this request fails, the rest go on
                    output.failed[item.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                    continue
                results.append(([item], result))
        for items, (tokens, logprobs) in results:
            row = 0
            for item in items:
                new = accepted(item.spec_token_ids, tokens[row:row + item.num_rows])
                if item.sampling_params.structured_outputs is not None:
                    error = self.guided.advance(item.request_id, new[0])
                    if error is not None:
                        output.failed[item.request_id] = error
                        row += item.num_rows
                        continue
                output.sampled_token_ids[item.request_id] = new
                if logprobs is not None and item.sampling_params.logprobs is not None:
                    k = item.sampling_params.logprobs + 1
                    kept = slice(row, row + len(new))
                    output.logprobs[item.request_id] = LogprobsLists(
                        [ids[:k] for ids in logprobs.token_ids[kept]],
                        [lps[:k] for lps in logprobs.logprobs[kept]], logprobs.ranks[kept])
                row += item.num_rows

    def _batch(self, items: list[RequestState], masks: dict[str, torch.Tensor],
               generator: torch.Generator | None) -> SamplingBatch:
        """The sampler's view of the items' rows: a request's row j follows its outputs and
        its first j proposed tokens; ``masks``: the guided requests' allowed tokens."""
        params: list[SamplingParams] = []
        prompts: list[list[int]] = []
        outputs: list[list[int]] = []
        generators: list[torch.Generator | None] = []
        guided_rows: list[int] = []
        for item in items:
            seed = item.sampling_params.seed
            if seed is not None and item.request_id not in self.generators:
                self.generators[item.request_id] = torch.Generator().manual_seed(seed)
            if item.request_id in masks:
                guided_rows.append(len(params))
            for j in range(item.num_rows):
                params.append(item.sampling_params)  # type: ignore[arg-type]
                prompts.append(item.prompt_token_ids)
                outputs.append(item.output_token_ids + item.spec_token_ids[:j] if j
                               else item.output_token_ids)
                generators.append(self.generators.get(item.request_id))
        allowed = torch.stack([masks[r.request_id] for r in items if r.request_id in masks]) \
            if guided_rows else None
        return SamplingBatch(params=params, prompt_token_ids=prompts, output_token_ids=outputs,
                             generators=generators,
                             generator=generator,
                             guided_rows=guided_rows, allowed=allowed)


def accepted(proposed: list[int], sampled: list[int]) -> list[int]:
    """The new tokens of a request whose rows sampled ``sampled`` after each of its
    ``proposed`` tokens' predecessors: the proposals up to the first one its row did not
    sample, then that row's token (all match: the last row's, one past the proposals).
    Rejection sampling for a proposal of one token per place: a row samples the proposed
    token with exactly the probability the target gives it, and when it samples another,
    that one is distributed as the target's residual, so the output keeps the target's
    distribution."""
    n = 0
    while n < len(proposed) and sampled[n] == proposed[n]:
        n += 1
    return sampled[:n + 1]
