"""N-gram lookup (prompt lookup decoding): guess that the text goes on as it went on after
the latest earlier occurrence of its last n tokens. Pays where the output copies its
input (rewriting, summarizing, code edits); proposes nothing where no n-gram recurs."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cpullm.config import SpeculativeConfig
from cpullm.engine.request import Request


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens
    of ``token_ids``, for the largest n in [min_n, max_n] that has one; [] for none."""
    if k < 1 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Candidates: every earlier position whose token equals the last one; an n-gram match
    # must end at one of them (and leave at least one token after it).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        if not len(found):
            continue
        if n > 1:
            # [candidates, n]: the n tokens ending at each candidate
            grams = sliding_window_view(tokens, n)[found - (n - 1)]
            found = found[(grams == tokens[-n:]).all(axis=1)]
            if not len(found):
                continue
        start = int(found[-1]) + 1
        return token_ids[start:start + k]
    return []


class NgramProposer:
    """Proposes by n-gram lookup in each request's own tokens (config.SpeculativeConfig's
    prompt_lookup_min and prompt_lookup_max)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, list[int]]:
        proposals = {}
        for request, most in requests:
            tokens = propose_ngram(request.all_token_ids, self.min_n, self.max_n, most)
            if tokens:
                proposals[request.request_id] = tokens
        return proposals

    def drop(self, request_id: str) -> None:
        """(n-gram lookup keeps nothing per request)"""
