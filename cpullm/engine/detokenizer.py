"""Incremental detokenization with stop strings.

Text grows one token at a time through tokenizers' ``DecodeStream``, which holds back
bytes until they form whole UTF-8 characters. The stream is primed with the end of the
prompt so that the first output token is decoded in context (a leading space stays a
space). Stop strings are searched in the text that could contain one, including a match
that starts in earlier text and ends in the newest piece.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from cpullm.sampling_params import SamplingParams

_PRIMING_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        if prompt_token_ids:
            self._stream.step(self._tokenizer, prompt_token_ids[-_PRIMING_TOKENS:])
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        # Characters kept back from streaming while they may still become a stop string.
        self.holdback = 0 if self.include_stop else max(params.max_stop_str_len - 1, 0)
        self.output_text = ""
        self._num_sent = 0  # characters of output_text already handed out as deltas

    def update(self, new_token_ids: list[int], skip_last: bool) -> str | None:
        """Add tokens to the text; ``skip_last`` leaves out a stop token (eos or a stop id)
        as vLLM does. Returns the stop string found, if any, with the text cut there."""
        ids = new_token_ids[:-1] if skip_last and not self.include_stop else new_token_ids
        old_len = len(self.output_text)
        for token_id in ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self.output_text += piece
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[:index + (len(stop) if self.include_stop else 0)]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not handed out yet, keeping back a possible stop string's prefix."""
        end = len(self.output_text) if finished else max(
            self._num_sent, len(self.output_text) - self.holdback)
        text = self.output_text[self._num_sent:end]
        self._num_sent = end
        return text
