"""The OpenAI-compatible HTTP server: FastAPI routes over the engine, whose core runs in its
own process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import cpullm
from cpullm import envs
from cpullm.engine.async_engine import AsyncEngine, EngineDeadError, ServingEngine
from cpullm.engine.llm_engine import Frontend
from cpullm.engine_args import EngineArgs
from cpullm.entrypoints.openai.media import MediaPolicy, parse_limit
from cpullm.entrypoints.openai.metrics import ServerMetrics
from cpullm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from cpullm.entrypoints.openai.serving_chat import ServingChat
from cpullm.entrypoints.openai.serving_completion import ServingCompletion
from cpullm.entrypoints.openai.serving_engine import OpenAIError
from cpullm.entrypoints.openai.serving_messages import (
    MESSAGES_ROUTE,
    CountTokensRequest,
    MessagesRequest,
    ServingMessages,
    anthropic_error,
)
from cpullm.entrypoints.openai.serving_models import ServingModels, parse_lora_module
from cpullm.entrypoints.openai.serving_pooling import ServingPooling
from cpullm.entrypoints.openai.serving_responses import (
    ResponsesRequest,
    ResponseStore,
    ServingResponses,
)
from cpullm.logger import init_logger
from cpullm.platform.affinity import bind_frontend_thread

logger = init_logger(__name__)


def _error(status: int, message: str, param: str | None = None, path: str = "",
           headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the API the path belongs to: Anthropic's under
    /v1/messages, OpenAI's elsewhere."""
    body = anthropic_error(status, message) if path.startswith(MESSAGES_ROUTE) else \
        OpenAIError(message, status, param).body()
    return JSONResponse(body, status_code=status, headers=headers)


# Routes that touch the model or reveal what it says need the API key; /health, /metrics,
# /version and / stay open (load balancers and scrapers call them).
_GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class _ApiKeyCheck:
    """Requires ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``), one
    of the keys, on the guarded routes. A
    plain ASGI middleware: streamed responses pass through untouched (a decorator
    middleware would copy every server-sent event through an extra task and stream)."""

    def __init__(self, app: Callable[..., Awaitable[None]], api_keys: list[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        self.expected_plain = [key.encode() for key in api_keys]

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_GUARDED_PREFIXES):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            given_plain = headers.get(b"x-api-key", b"")
            # every key compared, so the time taken does not tell which one was close
            if sum(hmac.compare_digest(given, key) for key in self.expected) + sum(
                    hmac.compare_digest(given_plain, key) for key in self.expected_plain) == 0:
                await _error(401, "Invalid or missing API key.", path=scope["path"])(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """Refuses request bodies over ``limit`` bytes with a 413, before any of it is parsed:
    at once from Content-Length, else (chunked bodies) as the bytes arrive; and a body whose
    next bytes take more than ``timeout`` seconds (a client that sent half a request and
    stalls) with a 408. The body read here is handed on to the app as one piece."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int, timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = _error(413, f"The request body is larger than {self.limit} bytes.",
                           path=scope["path"])
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                await _error(408, f"The request body did not arrive within {self.timeout:g} s.",
                             path=scope["path"])(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left before sending it all
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later calls: the client's disconnect

        await self.app(scope, replay, send)


# Errors that name the value that is not allowed (a literal, an enum, a tagged union's tag)
_NAMING_ERRORS = ("literal_error", "enum", "union_tag_invalid")
_BRANCH = re.compile(r"str|int|float|bool|none|[\w-]+\[.*\]")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    # Of a union's errors (one per alternative), a value that is not one of the allowed
    # ones says most: "content parts of type 'image_url'" beats "not a string".
    first = next((e for e in errors if e.get("type") in _NAMING_ERRORS), errors[0])
    if first.get("type") == "json_invalid":
        return f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # (less the names of a union's branches: "str", "list[...]", "tagged-union[...]")
    location = [str(p) for p in first.get("loc", ())
                if p != "body" and not _BRANCH.fullmatch(str(p))]
    param = location[0] if location else None
    message = f"{'.'.join(location) or 'body'}: {first.get('msg')}"
    if first.get("type") in ("literal_error", "enum"):
        message += f", got {first.get('input')!r}"
    return message, param


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run the handler, cancelling it (and so aborting its engine requests) if the client
    goes away first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_until_disconnected(request))
    done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        listener.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)


DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# The chat page at / (--no-webui: none): plain files of the package, no build step
WEBUI_DIR = Path(__file__).parent / "webui"
_WEBUI_FILES = {"app.js": "text/javascript", "style.css": "text/css"}


def build_app(engine: ServingEngine, served_model_name: str,
              api_keys: list[str] | None = None,
              log_requests: bool = False,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              allowed_origins: list[str] | None = None,
              max_waiting_requests: int | None = None,
              request_body_timeout: float = 30.0,
              tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None,
              responses_store: ResponseStore | None = None,
              webui: bool = True,
              lora_modules: list[dict[str, Any]] | None = None,
              media: MediaPolicy | None = None) -> FastAPI:
    """The FastAPI app; the caller starts and stops the engine (see ``lifespan``).
    ``lora_modules``: the adapters to serve (``parse_lora_module``'s), read and checked
    here (ValueError for a bad one)."""
    model_config = engine.config.model
    models = ServingModels(model_config, served_model_name)
    for module in lora_modules or []:
        lora = models.add(module["name"], module["path"], module.get("base_model_name"))
        logger.info("Serving LoRA adapter %r from %s", lora.lora_name, lora.lora_path)
    max_model_len = model_config.max_model_len
    metrics = ServerMetrics(engine, served_model_name)
    max_open = None if max_waiting_requests is None else \
        engine.config.scheduler.max_num_seqs + max_waiting_requests
    completions = ServingCompletion(engine, served_model_name, max_model_len, metrics, max_open)
    chat = ServingChat(engine, served_model_name, max_model_len, metrics, max_open,
                       tool_call_parser=tool_call_parser,
                       enable_auto_tool_choice=enable_auto_tool_choice,
                       reasoning_parser=reasoning_parser)
    pooling = ServingPooling(engine, served_model_name, max_model_len, metrics, max_open)
    for serving in (completions, chat, pooling):
        serving.models = models
    chat.media = media or MediaPolicy()
    messages = ServingMessages(chat)
    responses = ServingResponses(chat, ResponseStore(1000, 3600.0) if responses_store is None
                                 else responses_store)
    metrics.track_responses_store(responses.store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="cpullm", version=cpullm.__version__, lifespan=lifespan)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = bind_model_limits(schema, served_model_name,
                                                   model_config.vocab_size, max_model_len)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, request.url.path, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, param, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(500, str(exc), path=request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A fault of this server's (the checks above should have caught the input): logged
        # with its traceback, answered in the API's error shape without one.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}", path=request.url.path)

    # Added last runs first: CORS (only when origins are given), the key, the body limit.
    app.add_middleware(_BodyLimit, limit=max_request_body_bytes, timeout=request_body_timeout)
    if api_keys:
        app.add_middleware(_ApiKeyCheck, api_keys=api_keys)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])

    @app.get("/", response_model=None)
    async def root(request: Request) -> dict[str, Any] | Response:
        # a browser asks for HTML: the chat page; API clients get the JSON below
        if webui and "text/html" in request.headers.get("accept", ""):
            return FileResponse(WEBUI_DIR / "index.html", media_type="text/html")
        return {"name": "cpullm", "version": cpullm.__version__, "model": served_model_name,
                "routes": {"docs": "/docs", "models": "/v1/models", "health": "/health",
                           "completions": "/v1/completions",
                           "chat_completions": "/v1/chat/completions",
                           "responses": "/v1/responses", "messages": "/v1/messages",
                           "embeddings": "/v1/embeddings", "score": "/v1/score",
                           "rerank": "/v1/rerank", "metrics": "/metrics"}}

    if webui:
        @app.get("/webui/{name}", include_in_schema=False)
        async def webui_file(name: str) -> Response:
            if name not in _WEBUI_FILES:  # only the page's own files, by name
                raise OpenAIError(f"No file /webui/{name}.", 404)
            return FileResponse(WEBUI_DIR / name, media_type=_WEBUI_FILES[name])

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return _error(500, f"the engine has stopped: {engine.dead_error!r}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": cpullm.__version__}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": models.cards()}

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            try:  # (reads the files: off the event loop)
                await asyncio.to_thread(models.add, body.lora_name, body.lora_path)
            except ValueError as e:
                raise OpenAIError(str(e), 400, "lora_path") from None
            logger.info("Loaded LoRA adapter %r from %s", body.lora_name, body.lora_path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                            media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            models.remove(body.lora_name)
            logger.info("Unloaded LoRA adapter %r", body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                            media_type="text/plain")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            chat_request = ChatCompletionRequest(messages=body.messages,
                                                 add_generation_prompt=body.add_generation_prompt)
            tokens = chat.render(chat_request)
        else:
            tokens = completions.encode(body.prompt, body.add_special_tokens, limit=False)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        completions.check_model(body.model)
        if any(not 0 <= t < completions.vocab_size for t in body.tokens):
            raise OpenAIError(f"Token ids must be in [0, {completions.vocab_size}).", 400,
                              "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    async def respond(request: Request, result: dict[str, Any] | AsyncIterator[str]) -> Any:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await _cancel_on_disconnect(request, _respond(pooling.embeddings(body), request,
                                                             respond))

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(body: ScoreRequest, request: Request) -> Any:
        return await _cancel_on_disconnect(request, _respond(pooling.score(body), request,
                                                             respond))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(body: RerankRequest, request: Request) -> Any:
        return await _cancel_on_disconnect(request, _respond(pooling.rerank(body), request,
                                                             respond))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        if log_requests:
            logger.info("completion request: n=%d max_tokens=%s stream=%s", body.n,
                        body.max_tokens, body.stream)
        metrics.api_requests("/v1/completions")
        return await _cancel_on_disconnect(
            request, _respond(completions.create(body), request, respond))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        if log_requests:
            logger.info("chat request: %d messages n=%d max_tokens=%s stream=%s",
                        len(body.messages), body.n,
                        body.max_completion_tokens or body.max_tokens, body.stream)
        metrics.api_requests("/v1/chat/completions")
        return await _cancel_on_disconnect(request, _respond(chat.create(body), request, respond))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        metrics.api_requests("/v1/responses")
        return await _cancel_on_disconnect(request, _respond(responses.create(body), request,
                                                             respond))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Any:
        metrics.api_requests("/v1/messages")
        return await _cancel_on_disconnect(request, _respond(messages.create(body), request,
                                                             respond))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, Any]:
        return messages.count_tokens(body)

    return app


async def _respond(create: Awaitable[dict[str, Any] | AsyncIterator[str]], request: Request,
                   respond: Callable[..., Awaitable[Any]]) -> Any:
    try:
        return await respond(request, await create)
    except OpenAIError as e:
        return _error(e.status, e.message, e.param, request.url.path, e.headers)
    except EngineDeadError as e:
        return _error(500, str(e), path=request.url.path)


def bind_model_limits(node: Any, served_model_name: str, vocab_size: int,
                      max_model_len: int) -> Any:
    """The OpenAPI schema with the model's bounds where protocol.py marks them: token ids
    below the vocabulary size, lengths below the context, the served model's name."""
    def bound(schema: Any, kind: str) -> None:
        if not isinstance(schema, dict):
            return
        if kind == "served_model" and schema.get("type") == "string":
            schema["enum"] = [served_model_name]
        elif kind != "served_model" and schema.get("type") == "integer":
            schema["maximum"] = vocab_size - 1 if kind == "token_id" else max_model_len - 1
        for branch in schema.get("anyOf", []):
            bound(branch, kind)

    if isinstance(node, dict):
        kind = node.pop("x-cpullm-limit", None)
        if kind is not None:
            bound(node, kind)
        for value in node.values():
            bind_model_limits(value, served_model_name, vocab_size, max_model_len)
    elif isinstance(node, list):
        for value in node:
            bind_model_limits(value, served_model_name, vocab_size, max_model_len)
    return node


def run_server(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    config = EngineArgs.from_cli_args(args).create_engine_config()
    try:
        lora_modules = [parse_lora_module(value) for value in args.lora_modules or []]
        media = MediaPolicy(args.allowed_local_media_path, args.allow_remote_media,
                            parse_limit(args.limit_mm_per_prompt))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if lora_modules and config.model.lora is None:
        raise SystemExit("--lora-modules needs --enable-lora")
    if args.headless:  # another host serves; this one runs its ranks of the model
        from cpullm.executor.multiproc import run_headless

        if config.parallel.node_rank == 0:
            raise SystemExit("--headless runs the ranks of a node other than 0 (--node-rank)")
        return run_headless(config, Frontend(config).eos_token_ids)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes, "
                         "llama3_json, mistral or pythonic)")
    if config.parallel.node_rank != 0:
        raise SystemExit(f"--node-rank {config.parallel.node_rank}: only node 0 serves; start "
                         "the other nodes with --headless")
    engine = AsyncEngine(config, Frontend(config),
                         multiprocess=envs.VLLM_ENABLE_V1_MULTIPROCESSING is not False)
    served_name = config.model.served_model_name
    if not config.model.is_pooling:  # the grammar checks' view of the vocabulary, read
        threading.Thread(target=engine.frontend.grammars.warm,  # while the core starts
                         name="grammar-vocabulary", daemon=True).start()
    bind_frontend_thread(list(config.parallel.binding.reserved_cpus))
    api_keys = args.api_key or ([envs.VLLM_API_KEY] if envs.VLLM_API_KEY else None)
    try:
        app = build_app(engine, served_name, api_keys,
                        log_requests=args.enable_log_requests and not args.disable_log_requests,
                        max_request_body_bytes=args.max_request_body_bytes,
                        allowed_origins=args.allowed_origins,
                        request_body_timeout=args.request_body_timeout,
                        max_waiting_requests=(args.max_waiting_requests
                                              if args.max_waiting_requests is not None
                                              else 8 * config.scheduler.max_num_seqs),
                        tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        reasoning_parser=args.reasoning_parser,
                        responses_store=ResponseStore(args.responses_store_size,
                                                      args.responses_store_ttl),
                        webui=args.webui, lora_modules=lora_modules, media=media)
    except ValueError as e:  # a bad adapter of --lora-modules
        raise SystemExit(str(e)) from None
    logger.info("Engine ready in %.1f s; serving %s on http://%s:%d", time.perf_counter() - start,
                served_name, args.host, args.port)
    # uvicorn shuts down gracefully on SIGTERM and SIGINT, then re-raises the signal to the
    # handler that was there before it; these let the process end with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _: logger.info("Shut down on %s",
                                                         signal.Signals(number).name))
    server = _DrainingServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + _FLUSH_SECONDS), engine,
        args.shutdown_timeout)
    server.run()
    return 0


_FLUSH_SECONDS = 2  # after the requests are ended, for their last events to go out


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or SIGINT stops taking connections and waits for
    the open ones; this one gives the running requests ``drain_timeout`` seconds (vLLM's
    --shutdown-timeout; 0: none), then ends those left, each cleanly (a 503, or an SSE
    error event and [DONE] for a stream), so that no response is cut off mid-message."""

    def __init__(self, config: uvicorn.Config, engine: ServingEngine, drain_timeout: int
                 ) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self._draining:
            return
        self._draining = True
        logger.info("%s: finishing open requests for up to %d s", signal.Signals(sig).name,
                    self.drain_timeout)
        loop = asyncio.get_event_loop()  # the signal arrives on the event loop's thread
        loop.call_soon_threadsafe(loop.call_later, self.drain_timeout, self.engine.stop_requests)
