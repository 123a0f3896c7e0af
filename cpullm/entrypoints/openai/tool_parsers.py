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

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer; content None when there is none."""
        raise NotImplementedError


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


class HermesParser(ToolParser):
    name = "hermes"
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


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser,
                                       PythonicParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool call parser {name!r} is not supported; supported: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
