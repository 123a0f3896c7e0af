"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cpullm.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from cpullm.entrypoints.openai.serving_engine import (
    OpenAIError,
    ServingBase,
    clamp_logprob,
    prompt_logprobs_json,
    sse,
    top_entries,
    usage,
)
from cpullm.outputs import CompletionOutput, Logprob, RequestOutput


class ServingChat(ServingBase):
    route = "/v1/chat/completions"

    def render(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise OpenAIError("messages must contain at least one message.", 400, "messages")
        try:
            messages = [m.for_template() for m in request.messages]
            prompt = self.engine.apply_chat_template(
                messages, request.chat_template, request.add_generation_prompt,
                request.continue_final_message, **(request.chat_template_kwargs or {}))
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        except Exception as e:  # a template that raises on this conversation (Jinja errors)
            raise OpenAIError(f"chat template failed: {e}", 400, "messages") from None
        return self.encode(prompt, add_special_tokens=False)

    async def create(self, request: ChatCompletionRequest
                     ) -> dict[str, Any] | AsyncIterator[str]:
        self.check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.", 400, "top_logprobs")
        token_ids = self.render(request)
        max_tokens = self.check_prompt(
            token_ids, request.max_completion_tokens if request.max_completion_tokens is not None
            else request.max_tokens)
        params = self.sampling_params(request, max_tokens,
                                      (request.top_logprobs or 0) if request.logprobs else None)
        response_id = random_id("chatcmpl")
        stream = self.generate(response_id, token_ids, params, request.cache_salt)
        if request.stream:
            return self._stream(request, response_id, len(token_ids), stream)
        final: RequestOutput | None = None
        async for output in stream:
            final = output
        assert final is not None
        choices = [self._choice(request, c, {"role": "assistant", "content": c.text})
                   for c in final.outputs]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = {"id": response_id, "object": "chat.completion", "created": now(),
                    "model": self.served_model_name, "choices": choices,
                    "usage": usage(len(token_ids), completion_tokens)}
        if request.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return response

    async def _stream(self, request: ChatCompletionRequest, response_id: str, num_prompt: int,
                      stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        created = now()
        completion_tokens = 0
        started: set[int] = set()

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                        "model": self.served_model_name, "choices": choices, **extra})

        try:
            async for output in stream:
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    delta: dict[str, Any] = {}
                    if completion.index not in started:
                        # The role rides on the first generated token, not ahead of the
                        # prompt's computation: clients time their TTFT by the first chunk.
                        started.add(completion.index)
                        delta = {"role": "assistant", "content": completion.text}
                    elif completion.text:
                        delta = {"content": completion.text}
                    extra = ({"usage": usage(num_prompt, completion_tokens)}
                             if request.usage_in_every_chunk else {})
                    yield chunk([self._choice(request, completion, delta, key="delta")], **extra)
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
