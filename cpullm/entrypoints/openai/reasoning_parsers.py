"""Reasoning parsers: a model's thinking apart from its answer (``--reasoning-parser``, vLLM's
names), for ``reasoning_content`` in chat completions.

    deepseek_r1  <think> reasoning </think> answer; the template may open the <think>
                 itself, so text before a </think> is reasoning, and an answer without one
                 is all reasoning (still thinking when it stopped)
    qwen3        <think> reasoning </think> answer, when thinking is on; an answer that
                 does not open with <think> is all content (enable_thinking: false)

``split`` takes a finished answer; ``ReasoningStream`` the same answer in pieces as it is
streamed, holding back a piece that may be the start of a tag, so that the concatenated
deltas equal ``split`` of the whole.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    name: str
    # Without a </think>: is the answer reasoning (True) or content (False)? qwen3 decides
    # by whether it opens with <think>.
    reasoning_without_end: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished answer; None for an empty part."""
        end = text.find(END)
        if end >= 0:
            return _part(text[:end].replace(START, "", 1)), _part(text[end + len(END):])
        if self.opens_reasoning(text):
            return _part(text.replace(START, "", 1)), None
        return None, _part(text)

    def opens_reasoning(self, text: str) -> bool:
        return self.reasoning_without_end or text.lstrip().startswith(START)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    reasoning_without_end = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    reasoning_without_end = False


def _part(text: str) -> str | None:
    return text if text.strip() else None


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"reasoning parser {name!r} is not supported; supported: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


class ReasoningStream:
    """One streamed choice's deltas split into reasoning and content as they come."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0  # characters of the reasoning (and content) sent so far
        self.sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of the answer; ``final``:
        the answer is complete, send everything."""
        self.text += delta
        text = self.text
        if not final:
            text = hold_back(text)
            if not self._decided(text):
                return "", ""
        reasoning, content = self._parts(text, final)
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return out

    def _decided(self, text: str) -> bool:
        """Whether the text so far shows which part it is in (qwen3: whether it opens
        with <think>)."""
        if self.parser.reasoning_without_end or END in text:
            return True
        stripped = text.lstrip()
        return len(stripped) >= len(START) or not START.startswith(stripped)

    def _parts(self, text: str, final: bool) -> tuple[str, str]:
        end = text.find(END)
        if end >= 0:
            return text[:end].replace(START, "", 1), text[end + len(END):]
        if self.parser.opens_reasoning(text):
            return text.replace(START, "", 1), ""
        return "", text


def hold_back(text: str, tags: tuple[str, ...] = (END, START)) -> str:
    """``text`` without a tail that could be the start of one of ``tags`` still arriving."""
    held = max((length for tag in tags for length in range(1, min(len(tag) - 1, len(text)) + 1)
                if text.endswith(tag[:length])), default=0)
    return text[:len(text) - held]
