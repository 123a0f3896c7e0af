"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cpullm.entrypoints.openai.protocol import CompletionRequest, now, random_id
from cpullm.entrypoints.openai.serving_engine import (
    OpenAIError,
    ServingBase,
    clamp_logprob,
    merge,
    sse,
    top_entries,
    usage,
)
from cpullm.outputs import CompletionOutput, Logprob, RequestOutput


class ServingCompletion(ServingBase):
    def _prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if not prompt:
            raise OpenAIError("The prompt is empty.", 400, "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return [self.encode(p) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
                for p in prompt]

    async def create(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported.", 400, "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of must equal n (beam search is not supported).", 400,
                              "best_of")
        prompts = self._prompts(request)
        max_tokens = [self.check_prompt(p, request.max_tokens) for p in prompts]
        params = [self.sampling_params(request, m, request.logprobs) for m in max_tokens]
        if request.echo and request.logprobs is not None:
            for p in params:
                p.prompt_logprobs = request.logprobs
        response_id = random_id("cmpl")
        streams = [self.generate(f"{response_id}-{i}", p, sp)
                   for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        if request.stream:
            return self._stream(request, response_id, prompts, streams)
        return await self._full(request, response_id, prompts, streams)

    async def _full(self, request: CompletionRequest, response_id: str,
                    prompts: list[list[int]], streams: list[AsyncIterator[RequestOutput]]
                    ) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in merge(streams):
            finals[index] = output
        choices = []
        completion_tokens = 0
        for index in range(len(prompts)):
            output = finals[index]
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                choices.append(self._choice(request, index * request.n + completion.index,
                                            output, completion, echo=request.echo))
        choices.sort(key=lambda c: c["index"])
        return {"id": response_id, "object": "text_completion", "created": now(),
                "model": self.served_model_name, "choices": choices,
                "usage": usage(sum(map(len, prompts)), completion_tokens)}

    async def _stream(self, request: CompletionRequest, response_id: str,
                      prompts: list[list[int]], streams: list[AsyncIterator[RequestOutput]]
                      ) -> AsyncIterator[str]:
        created = now()
        completion_tokens = 0
        echoed: set[int] = set()
        try:
            async for index, output in merge(streams):
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    choice_index = index * request.n + completion.index
                    echo = request.echo and choice_index not in echoed
                    echoed.add(choice_index)
                    yield sse({"id": response_id, "object": "text_completion",
                               "created": created, "model": self.served_model_name,
                               "choices": [self._choice(request, choice_index, output,
                                                        completion, echo)]})
            if request.stream_options and request.stream_options.include_usage:
                yield sse({"id": response_id, "object": "text_completion", "created": created,
                           "model": self.served_model_name, "choices": [],
                           "usage": usage(sum(map(len, prompts)), completion_tokens)})
        except OpenAIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    def _choice(self, request: CompletionRequest, index: int, output: RequestOutput,
                completion: CompletionOutput, echo: bool) -> dict[str, Any]:
        text = completion.text
        logprobs = None
        if request.logprobs is not None:
            entries: list[tuple[int, dict[int, Logprob] | None]] = []
            if echo and output.prompt_logprobs is not None:
                entries.extend(zip(output.prompt_token_ids, output.prompt_logprobs, strict=True))
            entries.extend(zip(completion.token_ids, completion.logprobs or [], strict=True))
            logprobs = self._logprobs(entries, request.logprobs, len(output.prompt or "")
                                      if echo else 0)
        if echo:
            text = (output.prompt or self.engine.tokenizer.decode(output.prompt_token_ids)) + text
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    def _logprobs(self, entries: list[tuple[int, dict[int, Logprob] | None]], k: int,
                  offset: int) -> dict[str, Any]:
        tokens: list[str | None] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str | None, float] | None] = []
        offsets: list[int] = []
        decode = self.engine.tokenizer.decode
        for token_id, entry in entries:
            text = entry[token_id].decoded_token if entry else decode([token_id])
            tokens.append(text)
            offsets.append(offset)
            offset += len(text or "")
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(clamp_logprob(entry[token_id].logprob))
            top.append({lp.decoded_token: clamp_logprob(lp.logprob)
                        for _, lp in top_entries(entry, k)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}
