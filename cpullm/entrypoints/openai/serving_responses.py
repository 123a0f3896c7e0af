"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, translated
to a chat request (ServingChat renders it, samples it and splits its answer into reasoning,
text and function calls), with a bounded in-memory store for ``previous_response_id``."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from cpullm.entrypoints.openai.protocol import (
    CONTEXT_LENGTH,
    SERVED_MODEL,
    VLLM_SAMPLING_EXTRAS,
    ChatCompletionRequest,
    OpenAIModel,
    _absent,
    _Refusing,
    random_id,
    sampling_extras,
)
from cpullm.entrypoints.openai.serving_chat import ServingChat
from cpullm.entrypoints.openai.serving_engine import OpenAIError
from cpullm.outputs import RequestOutput


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(_Refusing):
    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # the reasoning parser decides what is reasoning
    max_output_tokens: int | None = Field(default=None, ge=1, json_schema_extra=CONTEXT_LENGTH)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None

    REFUSED = {"background": (lambda v: not v, "background mode is not supported; send the "
                                                "request and wait for it (or stream it)"),
               "conversation": (_absent, "conversations are not stored; chain responses "
                                         "with previous_response_id"),
               "prompt": (_absent, "stored prompt templates are not supported")}


def _text_of(content: Any, where: str) -> str:
    """The text of an input message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of content parts.", 400,
                          "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise OpenAIError(f"{where}.content: parts of type {kind!r} are not supported "
                              "(this server takes text).", 400, "input")
        texts.append(str(part.get("refusal" if kind == "refusal" else "text", "")))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages as they are, function calls as an
    assistant message's tool calls, function call outputs as tool messages (reasoning items
    are left out, as chat templates leave out an earlier turn's reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}.role must be user, system, developer or assistant, "
                                  f"got {role!r}.", 400, "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function", "function": {
                "name": _field(item, "name", where),
                "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": output if isinstance(output, str)
                             else _text_of(output, where)})
        elif kind != "reasoning":
            raise OpenAIError(f"{where}: input items of type {kind!r} are not supported.", 400,
                              "input")
    return messages


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{where}.{name} must be a non-empty string.", 400, "input")
    return value


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a next turn continues from."""
    return input_messages([item for item in output if item["type"] != "reasoning"])


@dataclass
class _Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation so far, instructions left out
    expires: float  # time.monotonic()


class ResponseStore:
    """Responses kept for ``previous_response_id`` and GET: at most ``max_entries`` (the
    oldest go first), each for ``ttl`` seconds. In memory: a restart forgets them."""

    def __init__(self, max_entries: int, ttl: float) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            self._entries[response["id"]] = _Stored(response, history,
                                                    time.monotonic() + self.ttl)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> _Stored:
        with self._lock:
            now = time.monotonic()
            while self._entries:  # the oldest first: drop those past their age
                oldest = next(iter(self._entries.values()))
                if oldest.expires > now:
                    break
                self._entries.popitem(last=False)
            stored = self._entries.get(response_id)
        if stored is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404,
                              "previous_response_id")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._entries.pop(response_id, None)


class ServingResponses:
    """OpenAI's Responses API over the chat completions server's parts."""

    route = "/v1/responses"

    def __init__(self, chat: ServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    def _chat_request(self, request: ResponsesRequest
                      ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request, and the conversation it carries (for the store)."""
        self.chat.check_fields(request, self.route, VLLM_SAMPLING_EXTRAS)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            self.chat.check_model(request.model)
            history = list(self.store.get(request.previous_response_id).history)
        history += input_messages(request.input)
        messages = ([{"role": "system", "content": request.instructions}]
                    if request.instructions else []) + history
        fields: dict[str, Any] = {**sampling_extras(request), "model": request.model,
                                  "messages": messages, "stream": request.stream}
        for name, value in (("max_tokens", request.max_output_tokens),
                            ("temperature", request.temperature), ("top_p", request.top_p),
                            ("parallel_tool_calls", request.parallel_tool_calls)):
            if value is not None:
                fields[name] = value
        if request.tools:
            fields["tools"] = [self._tool(tool) for tool in request.tools]
        choice = request.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise OpenAIError("tool_choice: only none, auto, required and "
                                  '{"type": "function", "name": ...} are supported.', 400,
                                  "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice is not None:
            fields["tool_choice"] = choice
        fmt = request.text.format if request.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise OpenAIError("text.format: a json_schema format needs a schema.", 400,
                                  "text")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        if not history:
            raise OpenAIError("input holds no message.", 400, "input")
        return self.chat.translated(fields), history

    @staticmethod
    def _tool(tool: dict[str, Any]) -> dict[str, Any]:
        kind = tool.get("type")
        if kind != "function":
            raise OpenAIError(f"tools: the {kind} tool is not supported by this server (only "
                              "function tools, which the client runs).", 400, "tools")
        if not isinstance(tool.get("name"), str):
            raise OpenAIError("tools: a function tool needs a name.", 400, "tools")
        return {"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict")
            if tool.get(key) is not None}}

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> dict[str, Any]:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create(self, request: ResponsesRequest) -> dict[str, Any] | AsyncIterator[str]:
        chat_request, history = self._chat_request(request)
        turn = self.chat.prepare(chat_request)
        response = self._response(random_id("resp"), request, chat_request)
        stream = self.chat.generate(response["id"], turn.token_ids, turn.params,
                                    chat_request.cache_salt, lora=turn.lora)
        if request.stream:
            return self._stream(request, chat_request, turn.mode, response,
                                len(turn.token_ids), history, stream)
        final: RequestOutput | None = None
        async for output in stream:
            final = output
        assert final is not None
        completion = final.outputs[0]
        message, _ = self.chat.message(chat_request, turn.mode, completion.text)
        items = _Items()
        if message.get("reasoning_content"):
            items.reasoning(message["reasoning_content"])
        if message["content"]:
            items.text(message["content"])
        for call in message.get("tool_calls", []):
            items.call({"index": 0, **call})
        items.close()
        self._finish(response, items.done, completion.finish_reason, len(turn.token_ids),
                     len(completion.token_ids), final.num_cached_tokens)
        if request.store:
            self.store.put(response, history + output_messages(response["output"]))
        return response

    def _response(self, response_id: str, request: ResponsesRequest,
                  chat_request: ChatCompletionRequest) -> dict[str, Any]:
        """The response object as it begins: in progress, without output."""
        fmt = request.text.format if request.text is not None and request.text.format \
            else TextFormat()
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens,
                "model": self.chat.served_model_name, "output": [],
                "parallel_tool_calls": request.parallel_tool_calls is not False,
                "previous_response_id": request.previous_response_id,
                "reasoning": request.reasoning or {"effort": None, "summary": None},
                "store": request.store, "temperature": request.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
                "tools": request.tools or [], "top_p": request.top_p,
                "truncation": "disabled", "usage": None, "user": request.user,
                "metadata": request.metadata or {}}

    @staticmethod
    def _finish(response: dict[str, Any], output: list[dict[str, Any]],
                finish_reason: str | None, input_tokens: int, output_tokens: int,
                cached_tokens: int) -> None:
        incomplete = finish_reason == "length"
        response.update(
            status="incomplete" if incomplete else "completed", output=output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={"input_tokens": input_tokens,
                   "input_tokens_details": {"cached_tokens": cached_tokens},
                   "output_tokens": output_tokens,
                   "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": input_tokens + output_tokens})

    async def _stream(self, request: ResponsesRequest, chat_request: ChatCompletionRequest,
                      mode: str | None, response: dict[str, Any], num_prompt: int,
                      history: list[dict[str, Any]], stream: AsyncIterator[RequestOutput]
                      ) -> AsyncIterator[str]:
        """OpenAI's typed event stream: response.created and .in_progress, then each output
        item added, filled by its deltas and done, and response.completed with the whole
        response."""
        sequence = 0

        def event(kind: str, **data: Any) -> str:
            nonlocal sequence
            sequence += 1
            payload = {"type": kind, "sequence_number": sequence - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        items = _Items()
        try:
            async for piece in self.chat.pieces(chat_request, mode, stream):
                if piece.thought:
                    items.reasoning(piece.thought)
                if piece.content:
                    items.text(piece.content)
                for call in piece.calls:
                    items.call(call)
                if piece.final:
                    items.close()
                for kind, data in items.take_events():
                    yield event(kind, **data)
                if piece.final:
                    self._finish(response, items.done, piece.completion.finish_reason,
                                 num_prompt, piece.output_tokens, piece.cached_tokens)
                    if request.store:
                        self.store.put(response, history + output_messages(response["output"]))
                    # completed, whatever the status (as vLLM does): the clients' stream
                    # helpers wait for response.completed (OpenAI ends an incomplete one
                    # with response.incomplete, which they take for a cut stream)
                    yield event("response.completed", response=response)
        except OpenAIError as e:
            yield event("error", code=str(e.status), message=e.message, param=e.param)


class _Items:
    """The output items of an answer as it is split (reasoning, text, function calls), the
    events that add, fill and finish each, and the finished items."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.events: list[tuple[str, dict[str, Any]]] = []

    def take_events(self) -> list[tuple[str, dict[str, Any]]]:
        events, self.events = self.events, []
        return events

    def _where(self) -> dict[str, Any]:
        """The open item's place, which its events name (it joins ``done`` when closed)."""
        assert self.current is not None
        return {"item_id": self.current["id"], "output_index": len(self.done)}

    def _open(self, item: dict[str, Any]) -> None:
        self.close()
        self.current = item
        self.events.append(("response.output_item.added",
                            {"output_index": len(self.done), "item": dict(item)}))

    def reasoning(self, text: str) -> None:
        if self.current is None or self.current["type"] != "reasoning":
            self._open({"type": "reasoning", "id": random_id("rs"), "summary": [],
                        "content": [], "status": "in_progress"})
        self.current["text"] = self.current.get("text", "") + text  # type: ignore[index]
        self.events.append(("response.reasoning_text.delta",
                            {**self._where(), "content_index": 0, "delta": text}))

    def text(self, text: str) -> None:
        if self.current is None or self.current["type"] != "message":
            self._open({"type": "message", "id": random_id("msg"), "status": "in_progress",
                        "role": "assistant", "content": []})
            self.events.append(("response.content_part.added", {
                **self._where(), "content_index": 0, "part": _text_part("")}))
        self.current["text"] = self.current.get("text", "") + text  # type: ignore[index]
        self.events.append(("response.output_text.delta",
                            {**self._where(), "content_index": 0, "delta": text,
                             "logprobs": []}))

    def call(self, delta: dict[str, Any]) -> None:
        """A tool call's OpenAI delta: its id and name open a function_call item; the
        arguments go out as fragments."""
        function = delta["function"]
        if "id" in delta:
            self._open({"type": "function_call", "id": random_id("fc"),
                        "call_id": delta["id"], "name": function["name"], "arguments": "",
                        "status": "in_progress"})
        fragment = function.get("arguments") or ""
        if fragment:
            assert self.current is not None and self.current["type"] == "function_call"
            self.current["arguments"] += fragment
            self.events.append(("response.function_call_arguments.delta",
                                {**self._where(), "delta": fragment}))

    def close(self) -> None:
        """Finish the open item, if any."""
        if self.current is None:
            return
        item, where, self.current = self.current, self._where(), None
        text = item.pop("text", "")
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            self.events.append(("response.reasoning_text.done",
                                {**where, "content_index": 0, "text": text}))
        elif item["type"] == "message":
            item["content"] = [_text_part(text)]
            self.events += [("response.output_text.done",
                             {**where, "content_index": 0, "text": text, "logprobs": []}),
                            ("response.content_part.done",
                             {**where, "content_index": 0, "part": _text_part(text)})]
        else:
            self.events.append(("response.function_call_arguments.done",
                                {**where, "name": item["name"],
                                 "arguments": item["arguments"]}))
        item["status"] = "completed"
        self.events.append(("response.output_item.done",
                            {"output_index": where["output_index"], "item": item}))
        self.done.append(item)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
