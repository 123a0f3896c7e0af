"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic

from cpullm.entrypoints.openai.media import load_image
from cpullm.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from cpullm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from cpullm.entrypoints.openai.serving_engine import (
    OpenAIError,
    ServingBase,
    clamp_logprob,
    prompt_logprobs_json,
    sse,
    top_entries,
    usage,
)
from cpullm.entrypoints.openai.tool_parsers import (
    ToolCall,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
)
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.outputs import CompletionOutput, Logprob, RequestOutput
from cpullm.sampling_params import SamplingParams
from cpullm.structured_output import StructuredOutputsParams


@dataclass
class ChatTurn:
    """A chat request ready for the engine."""

    mode: str | None  # the tool mode (ServingChat.tool_mode)
    token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None  # the adapter the request's model names
    images: list[ImageInput] = field(default_factory=list)  # a vision-language model's


class AnswerStream:
    """One streamed answer, split piece by piece as ``ServingChat.message`` splits a whole
    one: the reasoning (with a reasoning parser, unless the answer is a required or named
    call), the content, and OpenAI's tool-call deltas (``ToolCallStream``)."""

    def __init__(self, mode: str | None, tool_parser: ToolParser | None,
                 reasoning_parser: ReasoningParser | None, name: str = "") -> None:
        self.reasoning = None if reasoning_parser is None or mode in ("required", "named") \
            else ReasoningStream(reasoning_parser)
        self.calls = ToolCallStream(mode, tool_parser, name) \
            if mode in ("auto", "required", "named") else None

    @property
    def called(self) -> bool:
        """Whether the answer was sent as tool calls."""
        return self.calls is not None and self.calls.called

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool-call deltas) of the next piece of the answer."""
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final=final)
        if self.calls is None:
            return thought, text, []
        content, deltas = self.calls.feed(text, final=final)
        return thought, content, deltas


@dataclass
class AnswerPiece:
    """The next piece of a one-choice streamed answer, split (``AnswerStream``)."""

    completion: CompletionOutput  # its engine output
    output_tokens: int  # generated so far
    thought: str
    content: str
    calls: list[dict[str, Any]]  # OpenAI's tool-call deltas
    called: bool  # the answer so far was sent as tool calls
    cached_tokens: int  # prompt tokens found in the prefix cache

    @property
    def final(self) -> bool:
        return self.completion.finish_reason is not None


class ServingChat(ServingBase):
    """Chat completions, with tools: ``tool_choice`` "auto" parses the model's answer with
    the ``--tool-call-parser``; "required" and a named function hold the answer to a JSON
    schema of the tools' arguments (structured outputs), so any model's calls validate."""

    route = "/v1/chat/completions"

    def __init__(self, *args: Any, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None
                 ) -> None:
        super().__init__(*args)
        self.tool_parser: ToolParser | None = (
            None if tool_call_parser is None else get_tool_parser(tool_call_parser))
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser: ReasoningParser | None = (
            None if reasoning_parser is None else get_reasoning_parser(reasoning_parser))

    @staticmethod
    def translated(fields: dict[str, Any]) -> ChatCompletionRequest:
        """The chat request another API's request translates to; what it does not take is a
        400 naming the field (the other API's field where its name is kept)."""
        try:
            return ChatCompletionRequest.model_validate(fields)
        except pydantic.ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise OpenAIError(f"{where}: {error['msg']}", 400,
                              str(error["loc"][0]) if error["loc"] else None) from None

    def tool_mode(self, request: ChatCompletionRequest) -> str | None:
        """None (no tools), "none", "auto", "required" or "named"; refuses what cannot be
        served."""
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none"):
                raise OpenAIError("tool_choice needs tools.", 400, "tool_choice")
            return None
        if choice is None:
            choice = "auto"  # OpenAI's default when tools are given
        if choice == "none":
            return "none"
        if choice == "auto":
            if not self.enable_auto_tool_choice or self.tool_parser is None:
                raise OpenAIError('tool_choice "auto" requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set.", 400, "tool_choice")
            return "auto"
        if request.structured_outputs_params() is not None:
            raise OpenAIError("tool_choice required or a named function cannot be combined "
                              "with structured outputs.", 400, "tool_choice")
        if choice == "required":
            return "required"
        names = [tool.function.name for tool in request.tools]
        if choice.function.name not in names:
            raise OpenAIError(f"tool_choice names {choice.function.name!r}, which is not one "
                              f"of the tools ({', '.join(names)}).", 400, "tool_choice")
        return "named"

    @staticmethod
    def tool_schema(request: ChatCompletionRequest, mode: str) -> dict[str, Any]:
        """The JSON schema the answer is held to for "required" and "named"."""
        tools = request.tools or []
        if mode == "named":
            assert not isinstance(request.tool_choice, str | None)
            tool = next(t for t in tools if t.function.name == request.tool_choice.function.name)
            return tool.function.parameters or {"type": "object"}
        calls = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": tool.function.parameters or {"type": "object"}},
            "required": ["name", "parameters"], "additionalProperties": False}
            for tool in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def message(self, request: ChatCompletionRequest, mode: str | None, text: str
                ) -> tuple[dict[str, Any], bool]:
        """The assistant message of a finished answer, and whether it calls tools. With a
        reasoning parser, the reasoning is kept apart, out of the content and of the tool
        calls' parsing (a required or named call's answer is the calls only)."""
        content: str | None = text
        reasoning: str | None = None
        if self.reasoning_parser is not None and mode not in ("required", "named"):
            reasoning, content = self.reasoning_parser.split(text)
            text = content or ""
        calls: list[ToolCall] = []
        if mode == "auto":
            assert self.tool_parser is not None
            content, calls = self.tool_parser.extract(text)
        elif mode == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]
                content = None
            except (json.JSONDecodeError, TypeError, KeyError):
                calls = []  # cut by max_tokens: the text as it is
        elif mode == "named":
            assert not isinstance(request.tool_choice, str | None)
            try:
                json.loads(text)
                calls, content = [ToolCall(request.tool_choice.function.name, text)], None
            except json.JSONDecodeError:
                pass
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
        return message, bool(calls)

    def load_images(self, request: ChatCompletionRequest) -> list[Any]:
        """The conversation's images (PIL), read from their URLs (which may wait on the
        network: call it off the event loop); 400 for an image that cannot be had, for
        images to a model that takes none, and for more than --limit-mm-per-prompt."""
        urls = [(f"messages[{i}].content: image_url", url)
                for i, message in enumerate(request.messages) for url in message.image_urls()]
        if not urls:
            return []
        if self.engine.config.model.mm_config is None:
            raise OpenAIError(f"The model `{self.served_model_name}` takes no images.", 400,
                              "messages")
        if len(urls) > self.media.max_images:
            raise OpenAIError(f"{len(urls)} images in the conversation; this server takes at "
                              f"most {self.media.max_images} (--limit-mm-per-prompt).", 400,
                              "messages")
        try:
            return [load_image(url, self.media, where) for where, url in urls]
        except ValueError as e:
            raise OpenAIError(str(e), 400, "messages") from None

    def render(self, request: ChatCompletionRequest) -> list[int]:
        return self.render_with_images(request)[0]

    def render_with_images(self, request: ChatCompletionRequest,
                           images: list[Any] | None = None
                           ) -> tuple[list[int], list[ImageInput]]:
        """The conversation's prompt token ids, and its images (``images``, load_images',
        or loaded here) as the engine takes them: the model's processor expands each
        image's token."""
        if not request.messages:
            raise OpenAIError("messages must contain at least one message.", 400, "messages")
        if images is None:
            images = self.load_images(request)
        frontend = self.engine.frontend
        image_token = frontend.image_token() if images else None
        try:
            messages = [m.for_template(image_token) for m in request.messages]
            kwargs = dict(request.chat_template_kwargs or {})
            if request.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
            prompt = self.engine.apply_chat_template(
                messages, request.chat_template, request.add_generation_prompt,
                request.continue_final_message, **kwargs)
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        except Exception as e:  # a template that raises on this conversation (Jinja errors)
            raise OpenAIError(f"chat template failed: {e}", 400, "messages") from None
        if not images:
            return self.encode(prompt, add_special_tokens=False), []
        try:
            _, token_ids, inputs = frontend.process_images(
                {"prompt": prompt, "multi_modal_data": {"image": images}},
                add_special_tokens=False)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "messages") from None
        return token_ids, inputs

    def prepare(self, request: ChatCompletionRequest, images: list[Any] | None = None
                ) -> ChatTurn:
        """The checked request as the engine takes it: the tool mode, the rendered prompt's
        token ids and the sampling parameters (a required or named call's JSON schema held
        by structured outputs). /v1/messages and /v1/responses come through here too."""
        lora = self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.", 400, "top_logprobs")
        mode = self.tool_mode(request)
        token_ids, inputs = self.render_with_images(request, images)
        max_tokens = self.check_prompt(
            token_ids, request.max_completion_tokens if request.max_completion_tokens is not None
            else request.max_tokens)
        params = self.sampling_params(request, max_tokens,
                                      (request.top_logprobs or 0) if request.logprobs else None)
        if mode in ("required", "named"):
            params.structured_outputs = StructuredOutputsParams(  # compact JSON calls
                json=self.tool_schema(request, mode), disable_any_whitespace=True)
            try:
                self.engine.frontend.check_params(params)
            except ValueError as e:
                raise OpenAIError.from_value_error(e) from None
        return ChatTurn(mode, token_ids, params, lora, inputs)

    def answer_stream(self, request: ChatCompletionRequest, mode: str | None) -> AnswerStream:
        """A streamed answer's splitter, which splits it as ``message`` splits the whole."""
        name = "" if isinstance(request.tool_choice, str | None) else \
            request.tool_choice.function.name
        return AnswerStream(mode, self.tool_parser, self.reasoning_parser, name)

    async def pieces(self, request: ChatCompletionRequest, mode: str | None,
                     stream: AsyncIterator[RequestOutput]) -> AsyncIterator[AnswerPiece]:
        """A one-choice answer's stream in split pieces, for the APIs that translate to chat
        (/v1/messages, /v1/responses) to spell in their own events."""
        answer = self.answer_stream(request, mode)
        output_tokens = 0
        async for output in stream:
            completion = output.outputs[0]
            output_tokens += len(completion.token_ids)
            thought, content, calls = answer.feed(completion.text,
                                                  completion.finish_reason is not None)
            yield AnswerPiece(completion, output_tokens, thought, content, calls, answer.called,
                              output.num_cached_tokens)

    async def create(self, request: ChatCompletionRequest
                     ) -> dict[str, Any] | AsyncIterator[str]:
        images = await asyncio.to_thread(self.load_images, request)
        turn = self.prepare(request, images)
        mode, token_ids, params = turn.mode, turn.token_ids, turn.params
        response_id = random_id("chatcmpl")
        stream = self.generate(response_id, token_ids, params, request.cache_salt,
                               lora=turn.lora, images=turn.images)
        if request.stream:
            if mode in ("auto", "required", "named"):
                return self._stream_tools(request, mode, response_id, len(token_ids), stream)
            return self._stream(request, response_id, len(token_ids), stream)
        final: RequestOutput | None = None
        async for output in stream:
            final = output
        assert final is not None
        choices = []
        for completion in final.outputs:
            message, calls = self.message(request, mode, completion.text)
            choice = self._choice(request, completion, message)
            if calls and completion.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
            choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {"id": response_id, "object": "chat.completion", "created": now(),
                    "model": request.model or self.served_model_name, "choices": choices,
                    "usage": usage(len(token_ids), completion_tokens)}
        if request.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response

    def _chunker(self, response_id: str, model: str) -> Callable[..., str]:
        """The SSE event of a chunk of this response: its choices, and any extra fields."""
        created = now()

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": choices, **extra})

        return chunk

    async def _stream(self, request: ChatCompletionRequest, response_id: str, num_prompt: int,
                      stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        chunk = self._chunker(response_id, request.model or self.served_model_name)
        completion_tokens = 0
        started: set[int] = set()
        reasoning: dict[int, ReasoningStream] = {}

        try:
            async for output in stream:
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    delta: dict[str, Any] = {}
                    text, thought = completion.text, ""
                    if self.reasoning_parser is not None:
                        split = reasoning.setdefault(completion.index,
                                                     ReasoningStream(self.reasoning_parser))
                        thought, text = split.feed(completion.text,
                                                   final=completion.finish_reason is not None)
                    if completion.index not in started:
                        # The role rides on the first generated token, not ahead of the
                        # prompt's computation: clients time their TTFT by the first chunk.
                        started.add(completion.index)
                        delta = {"role": "assistant", "content": text}
                    elif text:
                        delta = {"content": text}
                    if thought:
                        delta["reasoning_content"] = thought
                    extra = ({"usage": usage(num_prompt, completion_tokens)}
                             if request.usage_in_every_chunk else {})
                    yield chunk([self._choice(request, completion, delta, key="delta")], **extra)
            if request.usage_at_end:
                yield chunk([], usage=usage(num_prompt, completion_tokens))
        except OpenAIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    async def _stream_tools(self, request: ChatCompletionRequest, mode: str, response_id: str,
                            num_prompt: int, stream: AsyncIterator[RequestOutput]
                            ) -> AsyncIterator[str]:
        """A stream whose answer may be tool calls, as OpenAI streams them: the role at the
        first token, content as it comes, and each call's index, id and name, then its
        arguments in fragments (``ToolCallStream``); ``finish_reason`` "tool_calls" when the
        answer called tools. A reasoning parser's reasoning goes out first, apart."""
        chunk = self._chunker(response_id, request.model or self.served_model_name)
        completion_tokens = 0
        answers: dict[int, AnswerStream] = {}

        try:
            async for output in stream:
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    index, final = completion.index, completion.finish_reason is not None
                    delta: dict[str, Any] = {}
                    if index not in answers:
                        answers[index] = self.answer_stream(request, mode)
                        delta = {"role": "assistant", "content": ""}
                    thought, content, tool_calls = answers[index].feed(completion.text, final)
                    if thought:
                        delta["reasoning_content"] = thought
                    if content:
                        delta["content"] = content
                    if tool_calls:
                        delta["tool_calls"] = tool_calls
                    finish = completion.finish_reason
                    if finish == "stop" and answers[index].called:
                        finish = "tool_calls"
                    if delta or final:
                        yield chunk([{"index": index, "delta": delta, "logprobs": None,
                                      "finish_reason": finish,
                                      "stop_reason": completion.stop_reason}])
            if request.usage_at_end:
                yield chunk([], usage=usage(num_prompt, completion_tokens))
        except OpenAIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    def _choice(self, request: ChatCompletionRequest, completion: CompletionOutput,
                message: dict[str, Any], key: str = "message") -> dict[str, Any]:
        logprobs = None
        if request.logprobs and completion.logprobs is not None:
            k = request.top_logprobs or 0
            logprobs = {"content": [self._token_logprob(t, e, k) for t, e in
                                    zip(completion.token_ids, completion.logprobs, strict=True)]}
        return {"index": completion.index, key: message, "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    @staticmethod
    def _token_logprob(token_id: int, entry: dict[int, Logprob], k: int) -> dict[str, Any]:
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        return {"token": text, "logprob": clamp_logprob(chosen.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": lp.decoded_token or "",
                                  "logprob": clamp_logprob(lp.logprob),
                                  "bytes": list((lp.decoded_token or "").encode())}
                                 for _, lp in top_entries(entry, k)]}
