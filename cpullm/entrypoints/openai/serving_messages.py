"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, translated to
a chat request (ServingChat renders it, samples it and splits its answer) and its answer
translated back into Anthropic's content blocks, stop reasons, SSE events and errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from cpullm.entrypoints.openai.protocol import (
    CONTEXT_LENGTH,
    SERVED_MODEL,
    VLLM_SAMPLING_EXTRAS,
    ChatCompletionRequest,
    OpenAIModel,
    _Refusing,
    random_id,
    sampling_extras,
)
from cpullm.entrypoints.openai.serving_chat import ServingChat
from cpullm.entrypoints.openai.serving_engine import OpenAIError
from cpullm.outputs import CompletionOutput, RequestOutput

MESSAGES_ROUTE = "/v1/messages"

# Anthropic's error types by HTTP status (an overloaded server is Anthropic's 529 type)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An error body in Anthropic's shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(OpenAIModel):
    """An earlier answer's reasoning, which clients send back: not shown to the model
    again (as chat templates drop an earlier turn's reasoning)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # (Anthropic's server tools have none)
    # Anthropic's server tools (web search, code execution, ...) carry a versioned type
    type: str | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


_SERVER_SIDE = "runs on Anthropic's servers; this server runs the model only"


class CountTokensRequest(_Refusing):
    """The fields of a Messages request that make its prompt."""

    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # the reasoning parser decides what is reasoning

    REFUSED = {"mcp_servers": (lambda v: not v, f"an MCP connector {_SERVER_SIDE}"),
               "container": (lambda v: v is None, f"a code-execution container {_SERVER_SIDE}")}

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The same conversation as a chat completions request."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else \
                "".join(block.text for block in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages.extend(_chat_messages(message))
        extra: dict[str, Any] = {}
        if self.tools:
            extra["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description,
                "parameters": tool.input_schema}} for tool in self.tools]
        choice = self.tool_choice
        if choice is not None and (self.tools or choice.type != "none"):
            if choice.type == "tool":
                if not choice.name:
                    raise OpenAIError("tool_choice: a tool choice of type tool needs a name.",
                                      400, "tool_choice")
                extra["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                extra["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
            if choice.disable_parallel_tool_use:
                extra["parallel_tool_calls"] = False
        return ServingChat.translated(
            {**sampling_extras(self), "model": self.model, "messages": messages, **extra,
             **sampling})


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None
    effort: str | None = None  # (a model without an effort setting answers as it does)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, json_schema_extra=CONTEXT_LENGTH)
    output_config: OutputConfig | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        fields = {"max_tokens": self.max_tokens, "stop": self.stop_sequences,
                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "stream": self.stream}
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return super().chat_request(**{k: v for k, v in fields.items() if v is not None},
                                    **sampling)


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results become tool
    messages (ahead of its text, as Anthropic orders them); an assistant turn's tool uses,
    its tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    if message.role == "user":
        results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                   for block in message.content if isinstance(block, ToolResultBlock)]
        if any(isinstance(block, ToolUseBlock) for block in message.content):
            raise OpenAIError("messages: tool_use blocks belong to assistant messages.", 400,
                              "messages")
        return results + ([{"role": "user", "content": text}] if text or not results else [])
    if any(isinstance(block, ToolResultBlock) for block in message.content):
        raise OpenAIError("messages: tool_result blocks belong to user messages.", 400,
                          "messages")
    calls = [{"id": block.id, "type": "function", "function": {
        "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
        for block in message.content if isinstance(block, ToolUseBlock)]
    return [{"role": "assistant", "content": text or None,
             **({"tool_calls": calls} if calls else {})}]


def stop_reason(completion: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished answer."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class ServingMessages:
    """Anthropic's Messages API over the chat completions server's parts."""

    route = MESSAGES_ROUTE

    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat

    def _request(self, request: CountTokensRequest) -> ChatCompletionRequest:
        self.chat.check_fields(request, self.route, VLLM_SAMPLING_EXTRAS)
        for tool in request.tools or []:
            if tool.type not in (None, "custom"):
                raise OpenAIError(f"tools: the {tool.type} tool {_SERVER_SIDE}.", 400, "tools")
            if tool.input_schema is None:
                raise OpenAIError(f"tools: the tool {tool.name!r} needs an input_schema.", 400,
                                  "tools")
        return request.chat_request()

    def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        self.chat.check_model(request.model)
        chat_request = self._request(request)
        self.chat.tool_mode(chat_request)
        return {"input_tokens": len(self.chat.render(chat_request))}

    async def create(self, request: MessagesRequest) -> dict[str, Any] | AsyncIterator[str]:
        chat_request = self._request(request)
        turn = self.chat.prepare(chat_request)
        message_id = random_id("msg")
        stream = self.chat.generate(message_id, turn.token_ids, turn.params,
                                    chat_request.cache_salt, lora=turn.lora)
        if request.stream:
            return self._stream(chat_request, turn.mode, message_id, len(turn.token_ids),
                                stream)
        final: RequestOutput | None = None
        async for output in stream:
            final = output
        assert final is not None
        completion = final.outputs[0]
        message, called = self.chat.message(chat_request, turn.mode, completion.text)
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls", []):
            content.append({"type": "tool_use", "id": call["id"],
                            "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        reason, sequence = stop_reason(completion, called)
        message_body = self._message(message_id, len(turn.token_ids), len(completion.token_ids))
        message_body["usage"]["cache_read_input_tokens"] = final.num_cached_tokens
        return {**message_body, "content": content, "stop_reason": reason,
                "stop_sequence": sequence}

    def _message(self, message_id: str, input_tokens: int, output_tokens: int
                 ) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant",
                "model": self.chat.served_model_name, "content": [], "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

    async def _stream(self, request: ChatCompletionRequest, mode: str | None, message_id: str,
                      num_prompt: int, stream: AsyncIterator[RequestOutput]
                      ) -> AsyncIterator[str]:
        """Anthropic's event stream: message_start, then each content block (thinking, text,
        tool_use) opened, its deltas, closed; message_delta with the stop reason and usage,
        message_stop."""
        yield _event("message_start", {"type": "message_start",
                                       "message": self._message(message_id, num_prompt, 0)})
        blocks = _Blocks()
        try:
            async for piece in self.chat.pieces(request, mode, stream):
                if piece.thought:
                    yield from_blocks(blocks.delta("thinking", piece.thought))
                if piece.content:
                    yield from_blocks(blocks.delta("text", piece.content))
                for call in piece.calls:
                    yield from_blocks(blocks.call(call))
                if piece.final:
                    yield from_blocks(blocks.close())
                    reason, sequence = stop_reason(piece.completion, piece.called)
                    yield _event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"output_tokens": piece.output_tokens,
                                  "cache_read_input_tokens": piece.cached_tokens}})
                    yield _event("message_stop", {"type": "message_stop"})
        except OpenAIError as e:
            yield _event("error", anthropic_error(e.status, e.message))


def from_blocks(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(_event(name, data) for name, data in events)


class _Blocks:
    """The content blocks of a streamed answer: which one is open, and the events that
    open, fill and close them."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": self.index,
                                                  "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def delta(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self.open != kind:
            events = self._start({"type": kind, kind: ""} if kind == "text" else
                                 {"type": kind, kind: "", "signature": ""})
        return events + [self._delta({"type": f"{kind}_delta", kind: text})]

    def call(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """A tool call's OpenAI delta: its id and name open a tool_use block; arguments
        go out as input_json_delta fragments."""
        events = []
        if "id" in delta:
            events = self._start({"type": "tool_use", "id": delta["id"],
                                  "name": delta["function"]["name"], "input": {}})
        fragment = delta["function"].get("arguments")
        if fragment:
            events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events
