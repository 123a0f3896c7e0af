"""Request: the one object that travels through the engine."""

from __future__ import annotations

import enum
import time
from typing import Any

from cpullm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > RequestStatus.PREEMPTED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # its own processing in the step raised (the others went on)

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
                RequestStatus.FINISHED_ERROR: "error"}.get(self)


class Request:
    """Prompt and output token ids, KV progress and block tables of one sequence."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
                 "max_model_len", "arrival_time", "output_token_ids", "all_token_ids",
                 "num_computed_tokens", "block_tables", "block_hashes", "long_rope", "status",
                 "stop_reason", "num_cached_tokens", "scheduled_time", "first_token_time",
                 "last_token_time", "cache_salt", "num_tokens_sent", "num_blocks_sent",
                 "lora_id", "lora_key", "images")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: set[int],
                 max_model_len: int, cache_salt: str | None = None, lora_id: int = 0,
                 lora_key: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # Timestamps (time.monotonic) for the latency metrics: added, first scheduled, first
        # and latest output token.
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # KV of all_token_ids[:num_computed_tokens] is in the cache.
        self.num_computed_tokens = 0
        # Per KV cache group (config.KVCacheGroups): the request's blocks, position p in
        # block p // block_size of each.
        self.block_tables: list[list[int]] = []
        # What the model runner holds of the request (engine/sched_output.py): its tokens
        # up to num_tokens_sent (0: it has not seen the request), and of each block table
        # the entries before num_blocks_sent (the KV cache manager lowers it when it
        # rewrites one).
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0
        # LongRoPE: past the pretraining length the KV is (re)computed on the long factors
        self.long_rope = False
        # Chained digests of the full blocks of all_token_ids, for prefix caching; the first
        # is also of the salt, so that requests with different salts never share blocks.
        self.cache_salt = cache_salt
        # its LoRA adapter's id (0: the base model) and the digest of the adapter's files,
        # which its blocks' digests take as they take the salt
        self.lora_id = lora_id
        self.lora_key = lora_key
        # the prompt's images (multimodal.ImageInput): a block holding an image's tokens is
        # keyed by the image's hash too
        self.images: list[Any] = []
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache

    @property
    def block_table(self) -> list[int]:
        """The first group's blocks (every layer's, with one group)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the request's max_tokens, bounded by the context."""
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    def append_output_token(self, token_id: int) -> None:
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Finish on a stop token or on length; stop strings are the detokenizer's job."""
        params = self.sampling_params
        if self.num_output_tokens < params.min_tokens:
            return False
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
            return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
