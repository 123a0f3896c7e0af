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
    prompt_logprobs_json,
    sse,
    top_entries,
    usage,
)
from cpullm.outputs import CompletionOutput, Logprob, RequestOutput


class ServingCompletion(ServingBase):
    route = "/v1/completions"

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
        self.check_request(request)
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of must equal n (beam search is not supported).", 400,
                              "best_of")
        prompts = self._prompts(request)
        # echo_only computes one token, which the answer leaves out.
        max_tokens = [self.check_prompt(p, 1 if request.echo_only else request.max_tokens)
                      for p in prompts]
        params = [self.sampling_params(request, m, request.logprobs) for m in max_tokens]
        if request.echo and request.logprobs is not None:
            for p in params:
                p.prompt_logprobs = request.logprobs
        response_id = random_id("cmpl")
        streams = [self.generate(f"{response_id}-{i}", p, sp, request.cache_salt)
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
                completion_tokens += self._num_tokens(request, completion)
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
        num_prompt = sum(map(len, prompts))
        completion_tokens = 0
        echoed: set[int] = set()

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": response_id, "object": "text_completion", "created": created,
                        "model": self.served_model_name, "choices": choices, **extra})

        try:
            async for index, output in merge(streams):
                for completion in output.outputs:
                    completion_tokens += self._num_tokens(request, completion)
                    choice_index = index * request.n + completion.index
                    echo = request.echo and choice_index not in echoed
                    echoed.add(choice_index)
                    extra = ({"usage": usage(num_prompt, completion_tokens)}
                             if request.usage_in_every_chunk else {})
                    yield chunk([self._choice(request, choice_index, output, completion, echo)],
                                **extra)
            if request.usage_at_end:
                yield chunk([], usage=usage(num_prompt, completion_tokens))
        except OpenAIError as e:
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    @staticmethod
    def _num_tokens(request: CompletionRequest, completion: CompletionOutput) -> int:
        return 0 if request.echo_only else len(completion.token_ids)

    def _choice(self, request: CompletionRequest, index: int, output: RequestOutput,
                completion: CompletionOutput, echo: bool) -> dict[str, Any]:
        text = "" if request.echo_only else completion.text
        logprobs = None
        if request.logprobs is not None:
            entries: list[tuple[int, dict[int, Logprob] | None]] = []
            if echo and output.prompt_logprobs is not None:
                entries.extend(zip(output.prompt_token_ids, output.prompt_logprobs, strict=True))
            if not request.echo_only:
                entries.extend(zip(completion.token_ids, completion.logprobs or [], strict=True))
            logprobs = self._logprobs(entries, request.logprobs, len(output.prompt or "")
                                      if echo else 0)
        if echo:
            text = (output.prompt or self.engine.tokenizer.decode(output.prompt_token_ids)) + text
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return choice

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
