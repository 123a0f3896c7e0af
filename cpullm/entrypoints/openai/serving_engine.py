"""What completions and chat completions share: validation, errors, logprobs, metrics."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from typing import TYPE_CHECKING, Any

from cpullm.engine.async_engine import (
    EngineDeadError,
    RequestFailedError,
    ServerShuttingDownError,
    ServingEngine,
)
from cpullm.entrypoints.openai.media import MediaPolicy
from cpullm.entrypoints.openai.metrics import ServerMetrics
from cpullm.entrypoints.openai.protocol import Usage, _SamplingFields
from cpullm.logger import init_logger
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.outputs import Logprob, PoolingRequestOutput, PromptLogprobs
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from cpullm.entrypoints.openai.serving_models import ServingModels

logger = init_logger(__name__)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError",
             408: "RequestTimeoutError", 413: "RequestEntityTooLargeError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}

    @classmethod
    def from_value_error(cls, error: ValueError) -> OpenAIError:
        message = str(error)
        first = message.split(" ", 1)[0].rstrip(":")
        return cls(message, 400, first if first.isidentifier() else None)


@functools.cache
def _max_token_bytes(vocab: tuple[str, ...]) -> int:
    return max((len(token.encode("utf-8", "replace")) for token in vocab), default=1)


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the UTF-8 bytes of text one token stands for, times four (for
    normalizers that drop characters): a token's spelling in the vocabulary is never
    shorter than its text (byte-level BPE spells each byte with one character, SentencePiece
    spells text as it is, byte fallback as <0xNN>)."""
    return 4 * _max_token_bytes(tuple(tokenizer.get_vocab()))


def clamp_logprob(value: float) -> float:
    """JSON has no -inf; report it as a very low number, as vLLM does."""
    return max(value, -9999.0)


def prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt position, None (the first) or token id ->
    logprob, rank and text."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(token): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                          "decoded_token": lp.decoded_token} for token, lp in entry.items()}
            for entry in entries]


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
    return [(token, lp) for token, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


class ServingBase:
    route = ""  # for log lines
    media = MediaPolicy()  # where a request's images may come from (build_app)
    models: ServingModels | None = None  # the base model and its adapters (build_app)

    def __init__(self, engine: ServingEngine, served_model_name: str, max_model_len: int,
                 metrics: ServerMetrics, max_open_requests: int | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.max_open_requests = max_open_requests  # past it: 503 at once
        self.vocab_size = engine.config.model.vocab_size
        self.max_token_bytes = max_token_bytes(engine.tokenizer)
        self._warned_fields: set[tuple[str, str]] = set()  # (route, field)

    def check_request(self, request: _SamplingFields) -> LoRARequest | None:
        """Refuse a request for another model, any request once the engine is dead, and
        fields not implemented yet; warn once about each field this server ignores. The
        LoRA adapter the request's model names, or None."""
        lora = self.check_model(request.model)
        if self.engine.config.model.is_pooling:
            raise OpenAIError(f"The model `{self.served_model_name}` is a pooling model "
                              f"(--task {self.engine.config.model.task}): it does not generate "
                              "text; use /v1/embeddings, /score or /rerank.", 400, "model")
        self.check_capacity()
        self.check_fields(request)
        return lora

    def check_fields(self, request: Any, route: str | None = None,
                     passed_on: Collection[str] = ()) -> None:
        """Refuse the request's first field not implemented yet (a 400 naming it); warn once
        about each field it sends that is ignored, except ``passed_on`` (those a translating
        route hands on to chat)."""
        refused = request.refused_field()
        if refused is not None:
            name, reason = refused
            raise OpenAIError(f"{name} is not supported by this server: {reason}.", 400, name)
        self.warn_ignored([name for name in request.ignored_fields() if name not in passed_on],
                          route)

    def warn_ignored(self, names: list[str], route: str | None = None) -> None:
        """Name in the log, once per route, each field a request sent that is ignored."""
        route = route or self.route
        new = [name for name in names if (route, name) not in self._warned_fields]
        if new:
            self._warned_fields.update((route, name) for name in new)
            logger.warning("%s: these request fields are not known to this server and are "
                           "ignored: %s (each is named once)", route, ", ".join(new))

    def check_capacity(self) -> None:
        """Refuse a request at once, with a 503 and Retry-After, when the requests already
        open (running and waiting) fill the server: a queue without a bound would only
        grow memory and latency under more load than the cores can take."""
        if self.max_open_requests is None:
            return
        open_requests = self.engine.num_open_requests
        if open_requests >= self.max_open_requests:
            self.metrics.rejected_overload.inc()
            raise OpenAIError(f"The server is at capacity ({open_requests} requests open); "
                              "retry later.", 503, headers={"Retry-After": "1"})

    def check_model(self, model: str | None) -> LoRARequest | None:
        """Refuse a request for another model, or any request once the engine is dead;
        the LoRA adapter ``model`` names, or None for the base model."""
        if self.engine.errored:
            raise OpenAIError(f"the engine has stopped: {self.engine.dead_error!r}", 500)
        if self.models is not None:
            return self.models.resolve(model)
        if model is not None and model != self.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return None

    def encode(self, text: str, add_special_tokens: bool = True, limit: bool = True
               ) -> list[int]:
        """The text's token ids. Text that is not valid Unicode (a lone surrogate, which
        JSON can spell) is refused; with ``limit``, so is text too long for the context
        whatever it tokenizes to, before it is tokenized (a 10 MB prompt would hold the
        event loop for seconds)."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise OpenAIError(f"The text is not valid Unicode: {e.reason} at position "
                              f"{e.start}.", 400, "prompt") from None
        if limit and size > self.max_model_len * self.max_token_bytes:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {size} bytes of text, more than any {self.max_model_len} "
                "tokens of this model spell.", 400, "prompt")
        # The Rust tokenizer directly: thread-safe, unlike the Python wrapper's settings.
        return self.engine.tokenizer.backend_tokenizer.encode(
            text, add_special_tokens=add_special_tokens).ids

    def check_prompt(self, token_ids: list[int], max_tokens: int | None) -> int:
        """Validate the prompt length against the context; returns the max_tokens to use."""
        if not token_ids:
            raise OpenAIError("The prompt is empty.", 400, "prompt")
        if max(token_ids) >= self.vocab_size or min(token_ids) < 0:
            raise OpenAIError(f"Token ids must be in [0, {self.vocab_size}).", 400, "prompt")
        prompt_len = len(token_ids)
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {prompt_len} tokens, which leaves no room for a completion.",
                400, "prompt")
        if max_tokens is None:
            return self.max_model_len - prompt_len
        if max_tokens < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {max_tokens}.", 400,
                              "max_tokens")
        if prompt_len + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                "the completion.", 400, "max_tokens")
        return max_tokens

    def sampling_params(self, request: _SamplingFields, max_tokens: int,
                        logprobs: int | None) -> SamplingParams:
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError("prompt_logprobs are not available when stream is true.", 400,
                              "prompt_logprobs")
        try:
            params = request.to_sampling_params(max_tokens, logprobs, request.stream)
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        try:
            self.engine.frontend.check_params(params)
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        return params

    async def generate(self, request_id: str, token_ids: list[int],
                       params: SamplingParams | PoolingParams, cache_salt: str | None = None,
                       record: bool = True, lora: LoRARequest | None = None,
                       images: list[ImageInput] | None = None) -> AsyncGenerator[Any, None]:
        """The engine's outputs for one prompt (RequestOutputs; a pooling request's one
        PoolingRequestOutput), with latency metrics recorded on the way (unless
        ``record`` is false: a step of a beam search, which is not a request of its own)."""
        start = last = time.monotonic()
        first = True
        num_tokens = 0
        streaming = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
        stream = self.engine.generate(request_id, token_ids, params, cache_salt, lora, images)
        finished = False
        try:
            async for output in stream:
                if not record:
                    yield output
                    continue
                now = time.monotonic()
                # under the replica that runs the request
                metrics = self.metrics.for_engine(self.engine.replica_of(request_id))
                if isinstance(output, PoolingRequestOutput):
                    metrics.record_pooled(len(output.prompt_token_ids), now - start)
                    yield output
                    continue
                assert isinstance(params, SamplingParams)
                new_tokens = sum(len(c.token_ids) for c in output.outputs)
                if new_tokens and streaming:
                    if first:
                        metrics.time_to_first_token.observe(now - start)
                        first = False
                    else:
                        metrics.inter_token_latency.observe(now - last)
                    last = now
                if output.finished and not streaming and "first_token_time" in output.metrics:
                    metrics.time_to_first_token.observe(
                        output.metrics["first_token_time"] - output.metrics["arrival_time"])
                num_tokens += new_tokens
                if output.finished:
                    finished = True
                    metrics.record_finished(output, params, len(token_ids), num_tokens,
                                            now - start)
                yield output
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None
        except ServerShuttingDownError as e:
            raise OpenAIError(str(e), 503, headers={"Retry-After": "1"}) from None
        except (EngineDeadError, RequestFailedError) as e:
            raise OpenAIError(str(e), 500) from None
        except (GeneratorExit, asyncio.CancelledError):
            # the client went away (or pressed stop): the engine aborts the request
            if record and not finished and isinstance(params, SamplingParams):
                self.metrics.for_engine(self.engine.replica_of(request_id)).record_aborted()
            raise
        finally:
            await stream.aclose()


async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, tagging each item with its iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any] | tuple[int, BaseException] | None] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()  # type: ignore[misc]
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens).model_dump()


# Characters that JSON leaves as they are but that str.splitlines() (and clients built on
# it, as httpx's iter_lines) takes for line ends; escaped, a streamed event stays one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: Any) -> str:
    import json

    return f"data: {json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"
