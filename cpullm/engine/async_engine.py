"""AsyncEngine: what ``cpullm serve`` runs. The engine core in its own process (or, under
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, on a thread of this one), one per data-parallel
replica, behind asyncio queues in the server's process. The HTTP side hands in plain data
(request id, prompt token ids, SamplingParams) and reads RequestOutputs from a
per-request asyncio queue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import shutil
from collections.abc import AsyncGenerator, Callable
from typing import Any

from cpullm.config import EngineConfig
from cpullm.engine import core_proc as msg
from cpullm.engine.core import EngineCoreOutput, EngineStats
from cpullm.engine.core_proc import CoreProcess, CoreThread
from cpullm.engine.errors import EngineDeadError, RequestFailedError, ServerShuttingDownError
from cpullm.engine.llm_engine import Frontend, check_cache_salt
from cpullm.engine.output_processor import OutputProcessor
from cpullm.logger import init_logger
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.outputs import PoolingRequestOutput, RequestOutput
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams

logger = init_logger(__name__)


async def stream_outputs(engine: Any, request_id: str,
                         outputs: asyncio.Queue[RequestOutput | BaseException]
                         ) -> AsyncGenerator[RequestOutput, None]:
    """A request's outputs from its queue until the finished one (an error in the queue is
    raised), counted in ``engine.num_open_requests`` meanwhile. A consumer that stops early
    (a client that went away) aborts the request, which frees its KV blocks."""
    engine.num_open_requests += 1
    finished = False
    try:
        while True:
            item = await outputs.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        engine.num_open_requests -= 1
        if not finished:
            engine.abort(request_id)


class AsyncEngine:
    """The engine cores (cpullm/engine/core_proc.py), one per data-parallel replica, each
    in its own process (``multiprocess``) or on a thread of this one, behind the same
    sockets and messages either way. This process keeps the front end: the tokenizer, the
    OutputProcessor (text, stop strings, logprobs, RequestOutputs) and the per-request
    queues, all touched only on the event loop; a task there reads the cores' per-step
    messages, and another watches the cores, so that a core that dies fails the requests
    and /health at once instead of leaving them waiting. Each request goes to the replica
    with the fewest open requests."""

    _WATCH_INTERVAL = 0.25  # seconds between checks that the core processes live

    def __init__(self, config: EngineConfig, frontend: Frontend, multiprocess: bool = True
                 ) -> None:
        import atexit
        import tempfile

        import zmq

        self.config = config
        self.frontend = frontend
        self.processor = OutputProcessor(frontend.tokenizer)
        self.on_step: Callable[[int], None] | None = None
        replicas = config.parallel.data_parallel_size
        self.replica_stats = [EngineStats() for _ in range(replicas)]
        self.dead_error: BaseException | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._replica_of: dict[str, int] = {}  # open request -> the replica running it
        self._served_by: dict[str, int] = {}  # the same, until its stream is closed
        self._load = [0] * replicas  # open requests per replica
        self.num_open_requests = 0  # generate() calls not finished
        self._tasks: list[asyncio.Task[None]] = []
        self._output: Any = None  # the PULL socket of the cores' messages, on the event loop
        self._stopped = False
        self._ipc_dir = tempfile.mkdtemp(prefix="cpullm-")
        self._zmq = zmq.Context()
        # Started together, so that the replicas load their models at the same time.
        self.cores: list[CoreProcess | CoreThread]
        if multiprocess:
            self._output_address = f"ipc://{self._ipc_dir}/output"
            self.cores = [CoreProcess(config.replica(i), frontend.eos_token_ids,
                                      f"ipc://{self._ipc_dir}/input-{i}", self._output_address)
                          for i in range(replicas)]
        else:
            name = f"inproc://cpullm-{id(self)}"
            self._output_address = f"{name}-output"
            self.cores = [CoreThread(config.replica(i), frontend.eos_token_ids,
                                     f"{name}-input-{i}", self._output_address, self._zmq)
                          for i in range(replicas)]
        atexit.register(self.shutdown)
        self._inputs = []
        try:
            for core in self.cores:
                core.wait_ready()
                sock = self._zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core reads all
                sock.connect(core.input_address)
                self._inputs.append(sock)
        except BaseException:
            self.shutdown()
            raise

    @property
    def tokenizer(self) -> Any:
        return self.frontend.tokenizer

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def stats(self) -> EngineStats:
        """The replicas' stats, added up."""
        if len(self.replica_stats) == 1:
            return self.replica_stats[0]
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(EngineStats):
            values = [getattr(s, f.name) for s in self.replica_stats]
            fields[f.name] = ([sum(c) for c in itertools.zip_longest(*values, fillvalue=0)]
                              if isinstance(values[0], list) else sum(values))
        total = EngineStats(**fields)
        total.kv_cache_usage = 1.0 - total.num_free_blocks / max(1, total.num_blocks)
        return total

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any
                            ) -> str:
        return self.frontend.apply_chat_template(messages, *args, **kwargs)

    def start(self) -> None:
        """On the event loop that serves requests."""
        import zmq
        import zmq.asyncio

        self._output = zmq.asyncio.Context.shadow(self._zmq).socket(zmq.PULL)
        self._output.bind(self._output_address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive(self._output)),
                       loop.create_task(self._watch())]

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        for replica, core in enumerate(self.cores):
            if core.alive and replica < len(self._inputs):
                self._send(replica, [msg.SHUTDOWN])
        for core in self.cores:
            core.stop()
        self._fail(ServerShuttingDownError("the server is shutting down"))
        if self._output is not None:  # a socket of the shadow context: destroy() misses it
            self._output.close(linger=0)
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | PoolingParams, cache_salt: str | None = None,
                       lora: LoRARequest | None = None, images: list[ImageInput] | None = None
                       ) -> AsyncGenerator[RequestOutput | PoolingRequestOutput, None]:
        """Yield the request's outputs until it finishes (a pooling request: its one
        output). Cancelling the consumer (a client that went away) aborts the request and
        frees its KV blocks."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_error}")
        if isinstance(params, PoolingParams):
            prompt_token_ids = self.frontend.check_pooling(params, prompt_token_ids)
        else:
            self.frontend.check_prompt(prompt_token_ids)
            self.frontend.check_params(params)
        check_cache_salt(cache_salt)
        self.frontend.check_lora(lora)
        sequences = self.processor.add_request(request_id, None, prompt_token_ids, params,
                                               cache_salt, lora, images)
        replica = min(range(len(self.cores)), key=lambda i: (self._load[i], i))
        self._load[replica] += 1
        self._replica_of[request_id] = replica
        self._served_by[request_id] = replica
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = outputs
        self._send(replica, [msg.ADD, [msg.encode_request(s) for s in sequences]])
        try:
            async with contextlib.aclosing(stream_outputs(self, request_id, outputs)) as stream:
                async for item in stream:
                    yield item
        finally:
            del self._served_by[request_id]

    def replica_of(self, request_id: str) -> int:
        """The replica that runs (or ran) a request whose outputs are being read."""
        return self._served_by.get(request_id, 0)

    def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        replica = self._close(request_id)
        sequences = self.processor.abort_request(request_id)
        if sequences and replica is not None and self.dead_error is None:
            self._send(replica, [msg.ABORT, sequences])

    def _close(self, request_id: str) -> int | None:
        """A request is done: its replica has one fewer open request."""
        replica = self._replica_of.pop(request_id, None)
        if replica is not None:
            self._load[replica] -= 1
        return replica

    def _send(self, replica: int, message: list[Any]) -> None:
        self._inputs[replica].send(msg.pack(message))

    async def _receive(self, output: Any) -> None:
        try:
            while True:
                self._handle(msg.unpack(await output.recv()))
        except Exception as e:  # a fault of this side: fail loudly rather than hang requests
            logger.exception("Reading the engine core's outputs failed; failing all requests")
            self._fail(EngineDeadError(f"the engine's outputs could not be read: {e!r}"))

    def _handle(self, message: list[Any]) -> None:
        kind, replica = message[0], message[1]
        if kind == msg.OUTPUTS:
            _, _, num_tokens, stats, outputs = message
            self.replica_stats[replica] = msg.decode_stats(stats)
            if self.on_step is not None:
                self.on_step(num_tokens)
            self._deliver(replica, [msg.decode_output(o) for o in outputs])
        elif kind == msg.STATS:
            self.replica_stats[replica] = msg.decode_stats(message[2])
        elif kind == msg.REJECTED:
            request_id = self.processor.request_of(message[2])
            if request_id is not None:
                waiting = self._queues.get(request_id)
                self.abort(request_id)
                if waiting is not None:
                    waiting.put_nowait(ValueError(message[3]))
        elif kind == msg.FAILED:
            logger.error("The engine core%s failed: %s; failing all requests",
                         self._name(replica), message[2])
            self._fail(EngineDeadError(f"the engine{self._name(replica)} failed: {message[2]}"))

    def _name(self, replica: int) -> str:
        return f" (replica {replica})" if len(self.cores) > 1 else ""

    def _deliver(self, replica: int, outputs: list[EngineCoreOutput]) -> None:
        step = self.processor.process(outputs)
        if step.to_finish:
            self._send(replica, [msg.ABORT, step.to_finish])
        for request_id, error in step.failed.items():
            logger.error("Request %s failed: %r", request_id, error)
            self._close(request_id)
            waiting = self._queues.pop(request_id, None)
            if waiting is not None:
                waiting.put_nowait(RequestFailedError(f"the request failed: {error!r}"))
        for request_output in step.outputs:
            if request_output.finished:
                self._close(request_output.request_id)
            waiting = self._queues.get(request_output.request_id)
            if waiting is not None:
                waiting.put_nowait(request_output)
                if request_output.finished:
                    del self._queues[request_output.request_id]

    async def _watch(self) -> None:
        while True:
            for replica, core in enumerate(self.cores):
                if core.exitcode is not None:
                    if self.dead_error is None:
                        logger.error("The engine core%s exited with code %s; failing all "
                                     "requests", self._name(replica), core.exitcode)
                        self._fail(EngineDeadError(
                            f"the engine core{self._name(replica)} exited unexpectedly "
                            f"(exit code {core.exitcode})"))
                    return
            await asyncio.sleep(self._WATCH_INTERVAL)

    def stop_requests(self) -> None:
        """End every open request (the server is stopping)."""
        self._fail(ServerShuttingDownError("the server is shutting down"))

    def _fail(self, error: EngineDeadError) -> None:
        if self.dead_error is None:
            self.dead_error = error
        for outputs in self._queues.values():
            outputs.put_nowait(error)
        self._queues.clear()
        self._replica_of.clear()
        self._load = [0] * len(self.cores)
        for request_id in [*self.processor.requests, *self.processor.pooling]:
            self.processor.abort_request(request_id)


ServingEngine = AsyncEngine  # what the server's routes run on

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError", "ServerShuttingDownError",
           "ServingEngine"]
