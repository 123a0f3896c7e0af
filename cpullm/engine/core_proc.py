"""The engine core in its own process, and the messages between it and the front end.

``cpullm serve`` runs the EngineCore (scheduler and model runner) in a process of its own,
started with multiprocessing (spawn), so that the model's compute threads never wait on
the HTTP process's GIL (event loop, tokenizing, chat templates, detokenizing, JSON). The
two talk over ZeroMQ sockets on IPC paths, with msgpack-encoded messages:

    front end -> core (PUSH -> PULL, the core binds):
        [ADD, [request, ...]]     a new sequence, once: id, prompt ids, params, arrival
        [ABORT, [id, ...]]        sequences to finish: client gone, stop string found
        [SHUTDOWN]
    core i -> front end (PUSH -> PULL, the front end binds one for every replica):
        [OUTPUTS, i, tokens, stats, [output, ...]]   after each step: per sequence that
                                  moved, its new token ids, token stop, logprob rows (a
                                  pooling request's output as float32 bytes)
        [STATS, i, stats]         after commands that left the core idle (aborts freed blocks)
        [REJECTED, i, id, message]   a sequence the core could not take
        [FAILED, i, message]      a step raised: the core is stopping

Each side connects its sending socket, which ZeroMQ queues on at once, and binds the one it
receives on, so no send ever blocks on the other side being ready (or gone). The process
dies with its parent (PR_SET_PDEATHSIG, and a check of the parent's pid when idle).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import torch
import zmq

from cpullm.config import EngineConfig
from cpullm.engine.core import EngineCore, EngineCoreOutput, EngineCoreRequest, EngineStats
from cpullm.engine.sched_output import LogprobsLists
from cpullm.logger import init_logger
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import RequestOutputKind, SamplingParams
from cpullm.utils import die_with_parent

logger = init_logger(__name__)

ADD, ABORT, SHUTDOWN = 0, 1, 2
OUTPUTS, STATS, REJECTED, FAILED = 0, 1, 2, 3

_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias: int keys


def encode_request(request: EngineCoreRequest) -> list[Any]:
    if isinstance(request.params, PoolingParams):  # a dict: a pooling request's
        return [request.request_id, request.prompt_token_ids,
                dataclasses.asdict(request.params), request.arrival_time, request.cache_salt,
                None, []]
    params = [getattr(request.params, name) for name in _PARAM_FIELDS]
    params[_PARAM_FIELDS.index("output_kind")] = request.params.output_kind.value
    guided = request.params.structured_outputs
    params[_PARAM_FIELDS.index("structured_outputs")] = (
        None if guided is None else dataclasses.asdict(guided))
    lora = request.lora
    return [request.request_id, request.prompt_token_ids, params, request.arrival_time,
            request.cache_salt, None if lora is None else dataclasses.astuple(lora),
            [image.encode() for image in request.images]]


def decode_request(data: list[Any]) -> EngineCoreRequest:
    request_id, prompt_token_ids, values, arrival_time, cache_salt, lora, images = data
    if isinstance(values, dict):
        return EngineCoreRequest(request_id, prompt_token_ids, PoolingParams(**values),
                                 arrival_time, cache_salt)
    fields = dict(zip(_PARAM_FIELDS, values, strict=True))
    # (structured_outputs travels as a dict, which SamplingParams turns back into its params)
    fields["output_kind"] = RequestOutputKind(fields["output_kind"])
    return EngineCoreRequest(request_id, prompt_token_ids, SamplingParams(**fields),
                             arrival_time, cache_salt,
                             None if lora is None else LoRARequest(*lora),
                             [ImageInput.decode(image) for image in images])


def _encode_rows(rows: LogprobsLists | None) -> list[Any] | None:
    return None if rows is None else [rows.token_ids, rows.logprobs, rows.ranks]


def _decode_rows(data: list[Any] | None) -> LogprobsLists | None:
    return None if data is None else LogprobsLists(*data)


def encode_output(output: EngineCoreOutput) -> list[Any]:
    return [output.request_id, output.new_token_ids, output.finish_reason, output.stop_reason,
            _encode_rows(output.logprobs), _encode_rows(output.prompt_logprobs),
            output.prompt_logprobs_start, output.num_cached_tokens, output.scheduled_time,
            output.first_token_time, output.last_token_time, output.error,
            None if output.pooled is None else output.pooled.numpy().tobytes()]


def decode_output(data: list[Any]) -> EngineCoreOutput:
    (request_id, new_token_ids, finish_reason, stop_reason, logprobs, prompt_logprobs,
     prompt_logprobs_start, num_cached_tokens, scheduled_time, first_token_time,
     last_token_time, error, pooled) = data
    return EngineCoreOutput(request_id, new_token_ids, finish_reason, stop_reason,
                            _decode_rows(logprobs), _decode_rows(prompt_logprobs),
                            prompt_logprobs_start, num_cached_tokens, scheduled_time,
                            first_token_time, last_token_time, error,
                            None if pooled is None else torch.frombuffer(
                                bytearray(pooled), dtype=torch.float32))


def encode_stats(stats: EngineStats) -> list[Any]:
    return list(dataclasses.astuple(stats))


def decode_stats(data: list[Any]) -> EngineStats:
    return EngineStats(*data)


def run_engine_core(config: EngineConfig, eos_token_ids: set[int], input_address: str,
                    output_address: str, ready: Connection) -> None:
    """The engine-core process: load the model, say ready, then serve the sockets."""
    die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group; the front end stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def started(core: EngineCore | None, error: str | None) -> None:
        ready.send(("ready", None) if error is None else ("error", error))
        ready.close()

    context = zmq.Context()
    try:
        serve_core(config, eos_token_ids, context, input_address, output_address, started,
                   parent=os.getppid())
    finally:
        context.term()


def serve_core(config: EngineConfig, eos_token_ids: set[int], context: zmq.Context,
               input_address: str, output_address: str,
               started: Callable[[EngineCore | None, str | None], None],
               parent: int | None = None) -> None:
    """An engine core's life, in its process or on its thread: bind the input socket,
    load the model, report (``started``: the core, or why it failed), then serve the
    sockets until SHUTDOWN (a step that raises ends it with SystemExit(1)) or, for a
    process, until its ``parent`` (the front end) is gone."""
    inbox = context.socket(zmq.PULL)
    inbox.bind(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    try:
        try:
            core = EngineCore(config, eos_token_ids)
        except BaseException as e:
            started(None, f"{type(e).__name__}: {e}")
            raise
        started(core, None)
        try:
            _serve(core, config.parallel.data_parallel_rank, inbox, outbox, parent)
        finally:
            core.shutdown()
    finally:
        outbox.close(linger=1000)  # a FAILED message still goes out
        inbox.close(linger=0)


def _serve(core: EngineCore, index: int, inbox: zmq.Socket, outbox: zmq.Socket,
           parent: int | None) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        # Wait for work only when nothing runs (waking each second to check the parent).
        timeout = 0 if core.has_unfinished_requests() else 1000
        commands = False
        while poller.poll(timeout):
            timeout = 0
            message = unpack(inbox.recv())
            if message[0] == SHUTDOWN:
                return
            commands = True
            if message[0] == ADD:
                for data in message[1]:
                    try:
                        core.add_request(decode_request(data))
                    except (ValueError, TypeError) as e:
                        outbox.send(pack([REJECTED, index, data[0], str(e)]))
            elif message[0] == ABORT:
                core.finish_requests(message[1])
        try:
            if not core.has_unfinished_requests():
                if commands:
                    outbox.send(pack([STATS, index, encode_stats(core.stats())]))
                elif parent is not None and os.getppid() != parent:
                    return  # the front end is gone
                else:
                    core.check_health()  # a rank that died while idle stops it now
                continue
            outputs = core.step()
        except Exception as e:  # the engine's state is unknown now: stop serving
            logger.exception("Engine step failed; the engine core stops")
            outbox.send(pack([FAILED, index, f"{type(e).__name__}({str(e)!r})"]))
            raise SystemExit(1) from None
        outbox.send(pack([OUTPUTS, index, core.last_step_num_tokens,
                          encode_stats(core.stats()), [encode_output(o) for o in outputs]]))


class CoreProcess:
    """One engine-core process, from the front end's side: started (spawn, so that no
    thread or OpenMP state of this process is copied), waited for until its model is
    loaded, watched, and stopped."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int], input_address: str,
                 output_address: str) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        receiver, sender = context.Pipe(duplex=False)
        self.input_address = input_address
        self.process = context.Process(
            target=run_engine_core,
            name=f"cpullm-engine-core-{config.parallel.data_parallel_rank}",
            args=(config, eos_token_ids, input_address, output_address, sender))
        self.process.start()
        sender.close()
        self._ready = receiver

    def wait_ready(self) -> None:
        """Block until the model is loaded; raises RuntimeError if the process failed."""
        try:
            while not self._ready.poll(0.2):
                if not self.process.is_alive():
                    raise RuntimeError(f"the engine core process exited with code "
                                       f"{self.process.exitcode} while starting")
            status, message = self._ready.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine core process exited with code "
                               f"{self.process.exitcode} while starting") from None
        finally:
            self._ready.close()
        if status != "ready":
            self.process.join(5)
            raise RuntimeError(f"the engine core failed to start: {message}")

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """After SHUTDOWN was sent: wait for the process, then end it if it lingers."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2)


class CoreThread:
    """An engine core on a thread of this process, behind the same sockets as a
    CoreProcess (ZeroMQ's inproc transport, on the front end's context): what the server
    runs under ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and what tests that inject faults
    into the engine reach (``core``, once started). Its steps then share this process's
    GIL with the event loop."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int], input_address: str,
                 output_address: str, context: zmq.Context) -> None:
        self.input_address = input_address
        self.core: EngineCore | None = None
        self.exitcode: int | None = None  # as a process's: 0 stopped, 1 failed
        self._started = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(
            target=self._run, args=(config, eos_token_ids, input_address, output_address,
                                    context),
            name=f"cpullm-engine-core-{config.parallel.data_parallel_rank}", daemon=True)
        self._thread.start()

    def _run(self, config: EngineConfig, eos_token_ids: set[int], input_address: str,
             output_address: str, context: zmq.Context) -> None:
        def started(core: EngineCore | None, error: str | None) -> None:
            self.core, self._error = core, error
            self._started.set()

        code = 1
        try:
            serve_core(config, eos_token_ids, context, input_address, output_address, started)
            code = 0
        except SystemExit as e:  # a step raised (logged, and FAILED sent)
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:  # noqa: BLE001 - starting failed: wait_ready raises it
            if not self._started.is_set():
                self._error = f"{type(e).__name__}: {e}"
        finally:
            self.exitcode = code
            self._started.set()

    def wait_ready(self) -> None:
        """Block until the model is loaded; raises RuntimeError if that failed."""
        self._started.wait()
        if self._error is not None:
            raise RuntimeError(f"the engine core failed to start: {self._error}")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """After SHUTDOWN was sent: wait for the thread."""
        self._thread.join(timeout)


class CoreClient:
    """An engine core in its own process, driven step by step from this one: what
    LLMEngine runs under ``VLLM_ENABLE_V1_MULTIPROCESSING=1``. It has EngineCore's
    methods; ``step()`` returns the next step's outputs, which the process computes on its
    own while this one processes the previous ones. Requests added between two steps go
    out together at the next step, so the process schedules them as one batch, as an
    engine core in this process would, whatever the time taken to tokenize them."""

    _POLL_MS = 250  # between checks that the process lives, while waiting for a step

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        import atexit
        import tempfile

        self.config = config
        self.last_step_num_tokens = 0
        self._stats = EngineStats()
        self._unfinished: set[str] = set()
        self._to_add: list[Any] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="cpullm-")
        self._zmq = zmq.Context()
        self._output = self._zmq.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._ipc_dir}/output")
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._closed = False
        self.process = CoreProcess(config, eos_token_ids, f"ipc://{self._ipc_dir}/input-0",
                                   f"ipc://{self._ipc_dir}/output")
        atexit.register(self.shutdown)
        try:
            self.process.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._input.connect(self.process.input_address)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._unfinished.add(request.request_id)
        self._to_add.append(encode_request(request))

    def _send_added(self) -> None:
        if self._to_add:
            self._input.send(pack([ADD, self._to_add]))
            self._to_add = []

    def finish_requests(self, request_ids: list[str], status: Any = None) -> None:
        ids = [i for i in request_ids if i in self._unfinished]
        self._unfinished.difference_update(ids)
        if ids:
            self._send_added()  # an abort must follow its request's ADD
            self._input.send(pack([ABORT, ids]))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def stats(self) -> EngineStats:
        return self._stats

    def step(self) -> list[EngineCoreOutput]:
        if not self._unfinished:
            raise RuntimeError("step() with no sequence running in the engine core")
        self._send_added()
        while True:
            if not self._output.poll(self._POLL_MS):
                if self.process.exitcode is not None:
                    raise RuntimeError(f"the engine core process exited unexpectedly (exit "
                                       f"code {self.process.exitcode})")
                continue
            message = unpack(self._output.recv())
            if message[0] == OUTPUTS:
                _, _, self.last_step_num_tokens, stats, outputs = message
                self._stats = decode_stats(stats)
                decoded = [decode_output(o) for o in outputs]
                self._unfinished.difference_update(o.request_id for o in decoded
                                                   if o.finish_reason is not None)
                return decoded
            if message[0] == STATS:
                self._stats = decode_stats(message[2])
            elif message[0] == REJECTED:
                self._unfinished.discard(message[2])
                raise ValueError(message[3])
            elif message[0] == FAILED:
                raise RuntimeError(f"the engine core failed: {message[2]}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process.alive:
            self._input.send(pack([SHUTDOWN]))
        self.process.stop()
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
