"""The engines behind the server, with asyncio queues: AsyncMPEngine (the engine core in its
own process, what ``cpullm serve`` runs; cpullm/engine/async_mp_engine.py) and AsyncEngine
(the whole engine on a thread, here).

The HTTP side hands in plain data (request id, prompt token ids, SamplingParams) and reads
RequestOutputs from a per-request asyncio queue. AsyncEngine's thread owns the LLMEngine:
it takes new requests and aborts from a thread-safe inbox between steps, so no engine
state is touched from two threads (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` serves so, and
tests that inject faults into the engine use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from cpullm.config import EngineConfig
from cpullm.engine.async_mp_engine import AsyncMPEngine, stream_outputs
from cpullm.engine.core import EngineStats
from cpullm.engine.errors import EngineDeadError, RequestFailedError, ServerShuttingDownError
from cpullm.engine.llm_engine import Frontend, LLMEngine
from cpullm.logger import init_logger
from cpullm.outputs import PoolingRequestOutput, RequestOutput
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass(slots=True)
class _Sink:
    """Where one request's outputs go: an asyncio queue owned by an event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def __call__(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _deliver(items: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for target, item in items:
        target.put_nowait(item)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams | PoolingParams
    sink: _Sink


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        # called on the engine thread after each step with the number of tokens it computed
        self.on_step = on_step
        self.stats = EngineStats()
        self.dead_error: BaseException | None = None
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self.num_open_requests = 0  # generate() calls not finished (event-loop side)
        self._thread: threading.Thread | None = None
        self._update_stats()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [self.stats]

    @property
    def frontend(self) -> Frontend:
        return self.engine.frontend

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any
                            ) -> str:
        return self.engine.apply_chat_template(messages, *args, **kwargs)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cpullm-engine", daemon=True)
        self._thread.start()

    def stop_requests(self) -> None:
        """End every open request (the server is stopping); the thread then exits."""
        self.dead_error = self.dead_error or ServerShuttingDownError("the server is shutting down")
        self._inbox.put(None)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def replica_of(self, request_id: str) -> int:
        """The replica that runs a request: this engine has one."""
        return 0

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | PoolingParams, cache_salt: str | None = None
                       ) -> AsyncGenerator[RequestOutput | PoolingRequestOutput, None]:
        """Yield the request's outputs until it finishes. Cancelling the consumer (a client
        that went away) aborts the request and frees its KV blocks."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error}")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_token_ids}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        self._inbox.put(_Add(request_id, prompt, params,
                             _Sink(asyncio.get_running_loop(), outputs)))
        async with contextlib.aclosing(stream_outputs(self, request_id, outputs)) as stream:
            async for item in stream:
                yield item

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            # Block for work only when nothing is running.
            for command in self._take_commands(block=not engine.has_unfinished_requests()):
                if command is None:
                    self._abort_all(ServerShuttingDownError("the server is shutting down"))
                    return
                self._apply(command)
            if not engine.has_unfinished_requests():
                self._update_stats()  # aborts may have freed blocks
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # the engine's state is unknown now: stop serving
                logger.exception("Engine step failed; failing all requests")
                self.dead_error = e
                self._abort_all(EngineDeadError(f"the engine failed: {e!r}"))
                self._drain_after_death()
                return
            self._update_stats()
            if self.on_step is not None:
                self.on_step(engine.last_step_num_tokens)
            # One wake-up of each event loop per step, not one per request.
            deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any],
                                                                   Any]]] = {}
            for request_id, error in engine.failed.items():
                logger.error("Request %s failed: %r", request_id, error)
                sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    deliveries.setdefault(sink.loop, []).append(
                        (sink.queue, RequestFailedError(f"the request failed: {error!r}")))
            for output in outputs:
                sink = self._sinks.get(output.request_id)
                if sink is not None:
                    deliveries.setdefault(sink.loop, []).append((sink.queue, output))
                if output.finished:
                    self._sinks.pop(output.request_id, None)
            for loop, items in deliveries.items():
                loop.call_soon_threadsafe(_deliver, items)

    def _take_commands(self, block: bool) -> list[_Add | _Abort | None]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            self._sinks.pop(command.request_id, None)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except ValueError as e:
            command.sink(e)
            return
        self._sinks[command.request_id] = command.sink

    def _abort_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            sink(error)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the error is sent
                pass
        self._sinks.clear()

    def _drain_after_death(self) -> None:
        """Answer requests that arrive after a failure instead of leaving them hanging."""
        while True:
            command = self._inbox.get()
            if command is None:
                return
            if isinstance(command, _Add):
                command.sink(EngineDeadError(f"the engine has stopped: {self.dead_error!r}"))

    def _update_stats(self) -> None:
        self.stats = self.engine.core.stats()


ServingEngine = AsyncEngine | AsyncMPEngine  # what the server's routes run on

__all__ = ["AsyncEngine", "AsyncMPEngine", "EngineDeadError", "RequestFailedError",
           "ServerShuttingDownError", "ServingEngine"]
