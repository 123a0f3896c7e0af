"""Tool-call parsers: a model's finished answer -> its text content and its tool calls, in
the format its family writes them (``--tool-call-parser``, vLLM's names).

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> ... (Qwen 2.5/3,
                 Hermes); text before the first call is content
    llama3_json  {"name": ..., "parameters": {...}}; {...} (Llama 3.1-3.3), optionally
                 after <|python_tag|>
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; text before is content
    pythonic     [get_weather(city="Paris"), f(x=1)] (Llama 4, Llama 3.2 small models)

An answer that does not parse as the format's calls (malformed JSON, a call without a
name) is content, whole: a client then sees what the model wrote.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import regex

from cpullm.entrypoints.openai.reasoning_parsers import hold_back


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(data: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., "arguments" (or "parameters"): {...} or its JSON text} -> a ToolCall."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(arguments_key, data.get("parameters", data.get("arguments", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    name: str
    # What opens the calls: a marker anywhere (text before it is content), or, with
    # ``opens_answer``, one the answer begins with (else the answer is all content).
    markers: tuple[str, ...]
    opens_answer: bool = False
    # The calls are {"name": ..., "arguments": {...}} JSON objects, whose arguments a stream
    # sends as they are written (else each call is sent whole when the answer ends).
    json_calls: bool = True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer; content None when there is none."""
        raise NotImplementedError


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return _content(text[:start]), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("{", "<|python_tag|>")
    opens_answer = True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                data, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call(data, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return None, calls


class MistralParser(ToolParser):
    name = "mistral"
    _MARKER = "[TOOL_CALLS]"
    markers = (_MARKER,)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self._MARKER)
        if start < 0:
            return text, []
        try:
            data = json.loads(text[start + len(self._MARKER):].strip())
        except json.JSONDecodeError:
            return text, []
        calls = [_call(item) for item in (data if isinstance(data, list) else [data])]
        if not calls or any(c is None for c in calls):
            return text, []
        return _content(text[:start]), calls  # type: ignore[return-value]


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("[", "<|python_start|>")
    opens_answer = True
    json_calls = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        body = body.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                    or node.args:
                return text, []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return text, []
            if None in arguments:  # **kwargs
                return text, []
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return None, calls


class JsonCallScanner:
    """JSON tool calls read as they are written: {"name": ..., "arguments" (or
    "parameters"): {...}} objects one after another, with whitespace, commas, semicolons,
    brackets and the format's ``tags`` between them. A call's name is sent as soon as it is
    written and its arguments as they grow (OpenAI's argument fragments); a call written
    another way (its arguments first) is sent whole when it closes. Text that is not a
    call ends the scan."""

    _HEAD = regex.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                          r'"(?:arguments|parameters)"\s*:\s*(?=\{)')
    _BETWEEN = " \t\r\n,;[]"

    def __init__(self, tags: tuple[str, ...] = ()) -> None:
        self.tags = tags
        self.pending = ""  # text not read yet
        self.state = "between"  # between, head, arguments, tail, whole, done
        self.depth, self.in_string, self.escaped = 0, False, False
        self.broken = False  # a character no JSON value holds, outside a string
        self.element = ""  # a call being read whole
        self.calls: list[ToolCall] = []  # the calls begun, their arguments so far

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The tool-call deltas of the next piece of text."""
        self.pending += text
        deltas: list[dict[str, Any]] = []
        while self.pending and self.state != "done":
            if not getattr(self, f"_{self.state}")(deltas):
                break  # more text needed
        merged: dict[int, dict[str, Any]] = {}  # one delta per call per piece
        for delta in deltas:
            if delta["index"] in merged:
                merged[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
            else:
                merged[delta["index"]] = delta
        return list(merged.values())

    def _between(self, deltas: list[dict[str, Any]]) -> bool:
        text = self.pending
        for tag in self.tags:
            if text.startswith(tag):
                self.pending = text[len(tag):]
                return True
            if tag.startswith(text):
                return False
        if text[0] in self._BETWEEN:
            self.pending = text[1:]
        elif text[0] == "{":
            self.state = "head"
        else:
            self.state = "done"
        return True

    def _head(self, deltas: list[dict[str, Any]]) -> bool:
        match = self._HEAD.match(self.pending, partial=True)
        if match is None:  # not name first: the call whole, when it closes
            self.state, self.element, self.depth = "whole", "", 0
            return True
        if match.partial:
            return False
        name = json.loads(match.group(1))
        call = ToolCall(name, "")
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                       "function": {"name": name, "arguments": ""}})
        self.pending = self.pending[match.end():]
        self.state, self.depth = "arguments", 0
        return True

    def _scan(self, text: str) -> int:
        """Read JSON characters until the value begun at depth 0 closes (or breaks): how
        many were read (all of them if it is still open)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char == "<":  # a tag (hermes' </tool_call>) in an unclosed value: broken
                self.broken = True
                return i
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(text)

    def _arguments(self, deltas: list[dict[str, Any]]) -> bool:
        read = self._scan(self.pending)
        piece, self.pending = self.pending[:read], self.pending[read:]
        if piece:
            self.calls[-1].arguments += piece
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        if self.broken:
            self.state = "done"
        elif self.depth == 0:
            self.state = "tail"
        return True

    def _tail(self, deltas: list[dict[str, Any]]) -> bool:
        text = self.pending.lstrip()
        if not text:
            self.pending = ""
            return False
        self.pending, self.state = text[1:], ("between" if text[0] == "}" else "done")
        return True

    def _whole(self, deltas: list[dict[str, Any]]) -> bool:
        read = self._scan(self.pending)
        self.element += self.pending[:read]
        self.pending = self.pending[read:]
        if self.broken:
            self.state = "done"
            return True
        if self.depth != 0:
            return False
        try:
            call = _call(json.loads(self.element))
        except json.JSONDecodeError:
            call = None
        if call is None:
            self.state = "done"
            return True
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1, **call.to_json()})
        self.state = "between"
        return True


class ToolCallStream:
    """One streamed choice's answer, piece by piece, as OpenAI streams tool calls: content
    deltas, and tool-call deltas (a call's index, id and name first, then fragments of its
    arguments). ``mode``: "named" (the answer is the arguments of the function ``name``),
    "required" (a JSON list of {"name", "parameters"}) or "auto" (``parser``'s format,
    whose calls are read as they come where they are JSON, else sent whole at the end)."""

    # what the scanner steps over between calls, in any of the formats
    _TAGS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]")

    def __init__(self, mode: str, parser: ToolParser | None = None, name: str = "") -> None:
        assert mode in ("named", "required", "auto") and (mode != "auto" or parser)
        self.mode, self.parser = mode, parser
        self.text = ""
        self.sent = 0  # characters of the text sent as content
        self.decided: str | None = None  # auto: "content" or "calls", once the text shows
        self.scanner = JsonCallScanner(self._TAGS)
        self.named = ToolCall(name, "")
        self.whole = False  # auto: the calls were sent whole, at the end
        self.searched = 0  # the text before this holds no whole marker (auto)

    @property
    def called(self) -> bool:
        """Whether the answer was sent as tool calls."""
        if self.mode == "named":
            return bool(self.named.arguments)
        return bool(self.scanner.calls) or self.whole

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the next piece; ``final``: the answer is
        complete."""
        self.text += piece
        if self.mode == "named":
            if not piece:
                return "", []
            first = not self.named.arguments
            self.named.arguments += piece
            return "", [{"index": 0, **self.named.to_json()} if first else
                        {"index": 0, "function": {"arguments": piece}}]
        if self.mode == "required":
            deltas = self.scanner.feed(piece)
            if final and not self.scanner.calls:  # (cut before a call's name): the text
                return self.text, []
            return "", deltas
        content = ""
        if self.decided is None:
            begin = self._calls_begin(final)
            if begin is None:
                return "", []
            if begin >= 0:
                self.decided = "calls"
                content, self.sent = self.text[self.sent:begin], begin
                piece = self.text[begin:]
            elif self.parser.opens_answer or final:  # type: ignore[union-attr]
                self.decided = "content"
        if self.decided != "calls":  # all content, less what may begin a marker
            end = len(self.text) if final or self.decided else len(
                hold_back(self.text, self.parser.markers))  # type: ignore[union-attr]
            content, self.sent = self.text[self.sent:end], max(self.sent, end)
            return content, []
        assert self.parser is not None
        deltas = self.scanner.feed(piece) if self.parser.json_calls else []
        if final and not self.scanner.calls:  # none read as they came: the answer's calls
            _, calls = self.parser.extract(self.text)
            if not calls:  # not calls after all: content, as the whole answer's parse says
                return content + self.text[self.sent:], []
            self.whole = True
            deltas = [{"index": i, **call.to_json()} for i, call in enumerate(calls)]
        return content, deltas

    def _calls_begin(self, final: bool) -> int | None:
        """Where the calls begin in the text so far; -1 if not (yet); None while an answer
        that may open with a marker has not shown whether it does."""
        assert self.parser is not None
        if not self.parser.opens_answer:
            # from where a marker may still begin: each piece is searched once, not the
            # whole answer again (a long answer without calls)
            start = max(0, self.searched - max(map(len, self.parser.markers)) + 1)
            self.searched = len(self.text)
            found = [i for i in (self.text.find(m, start) for m in self.parser.markers)
                     if i >= 0]
            return min(found, default=-1)
        stripped = self.text.lstrip()
        if any(stripped.startswith(m) for m in self.parser.markers):
            return len(self.text) - len(stripped)
        if not final and any(m.startswith(stripped) for m in self.parser.markers):
            return None
        return -1


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser,
                                       PythonicParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool call parser {name!r} is not supported; supported: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
