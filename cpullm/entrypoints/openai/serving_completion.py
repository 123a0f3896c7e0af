"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cpullm import beam_search
from cpullm.beam_search import BeamSearchParams
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
from cpullm.lora.request import LoRARequest
from cpullm.outputs import CompletionOutput, Logprob, RequestOutput
from cpullm.sampling_params import SamplingParams


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
        lora = self.check_request(request)
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of must equal n (with use_beam_search, n is the beam "
                              "width).", 400, "best_of")
        prompts = self._prompts(request)
        response_id = random_id("cmpl")
        if request.use_beam_search:
            streams = self._beam_searches(request, response_id, prompts, lora)
            if request.stream:
                return self._stream(request, response_id, prompts, streams)
            return await self._full(request, response_id, prompts, streams)
        # echo_only computes one token, which the answer leaves out.
        max_tokens = [self.check_prompt(p, 1 if request.echo_only else request.max_tokens)
                      for p in prompts]
        params = [self.sampling_params(request, m, request.logprobs) for m in max_tokens]
        if request.echo and request.logprobs is not None:
            for p in params:
                p.prompt_logprobs = request.logprobs
        streams = [self.generate(f"{response_id}-{i}", p, sp, request.cache_salt, lora=lora)
                   for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        if request.stream:
            return self._stream(request, response_id, prompts, streams)
        return await self._full(request, response_id, prompts, streams)

    def _beam_searches(self, request: CompletionRequest, response_id: str,
                       prompts: list[list[int]], lora: LoRARequest | None
                       ) -> list[AsyncIterator[RequestOutput]]:
        """vLLM's use_beam_search: each prompt's ``n`` best beams as its choices, each
        search a stream of one final output."""
        for name, unset in (("logprobs", request.logprobs is None), ("echo", not request.echo),
                            ("prompt_logprobs", request.prompt_logprobs is None),
                            ("stop", not request.stop),
                            ("structured outputs", request.structured_outputs_params() is None)):
            if not unset:
                raise OpenAIError(f"{name} cannot be combined with use_beam_search.", 400,
                                  name.replace(" ", "_"))
        config = self.engine.config.model
        eos = self.engine.frontend.eos_token_ids
        searches = []
        for prompt in prompts:
            try:
                params = BeamSearchParams(
                    beam_width=request.n, max_tokens=self.check_prompt(prompt,
                                                                       request.max_tokens),
                    ignore_eos=request.ignore_eos, temperature=request.temperature or 0.0,
                    length_penalty=request.length_penalty,
                    include_stop_str_in_output=request.include_stop_str_in_output)
                beam_search.check_width(params, config.max_logprobs, config.vocab_size, eos)
            except ValueError as e:
                raise OpenAIError.from_value_error(e) from None
            searches.append(beam_search.BeamSearch(prompt, params, eos))
        self.metrics.beam_searches.inc(len(searches))

        async def score(tokens: list[int], params: SamplingParams) -> RequestOutput:
            final = None
            async for output in self.generate(random_id("beam"), tokens, params,
                                              request.cache_salt, record=False, lora=lora):
                final = output
            return final

        async def search(index: int, prompt: list[int], found: beam_search.BeamSearch
                         ) -> AsyncIterator[RequestOutput]:
            await beam_search.run_async(found, score)
            result = found.output(lambda ids: self.engine.tokenizer.decode(
                ids, skip_special_tokens=request.skip_special_tokens))
            yield beam_search.as_request_output(f"{response_id}-{index}", None, prompt, result)

        return [search(i, p, s) for i, (p, s) in enumerate(zip(prompts, searches, strict=True))]

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
                "model": request.model or self.served_model_name, "choices": choices,
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
                        "model": request.model or self.served_model_name, "choices": choices,
                        **extra})

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
