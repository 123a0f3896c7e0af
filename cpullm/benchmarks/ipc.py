"""The transport between the API server and the engine-core process, measured:
``python -m cpullm.benchmarks.ipc`` times the round trip of one step's outputs (16
sequences, one new token each, encoded and decoded on both sides) to a second process
and back, over ZeroMQ IPC sockets with msgpack (what the server uses) and over a
multiprocessing Pipe with pickle."""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import tempfile
import time
from multiprocessing.connection import Connection

import zmq

from cpullm.engine import core_proc as msg
from cpullm.engine.core import EngineCoreOutput

_ROUNDS = 2000


def _step_outputs() -> list[EngineCoreOutput]:
    now = time.monotonic()
    return [EngineCoreOutput(f"cmpl-{i:032x}", [1234], num_cached_tokens=0, scheduled_time=now,
                             first_token_time=now, last_token_time=now) for i in range(16)]


def _zmq_echo(inbox_address: str, outbox_address: str) -> None:
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.bind(inbox_address)
    outbox.connect(outbox_address)
    for _ in range(_ROUNDS):
        outputs = [msg.decode_output(o) for o in msg.unpack(inbox.recv())]
        outbox.send(msg.pack([msg.encode_output(o) for o in outputs]))
    context.destroy(linger=1000)


def _pipe_echo(conn: Connection) -> None:
    for _ in range(_ROUNDS):
        conn.send(conn.recv())


def main() -> None:
    spawn = multiprocessing.get_context("spawn")
    outputs = _step_outputs()
    folder = tempfile.mkdtemp(prefix="cpullm-ipc-")
    inbox_address, outbox_address = f"ipc://{folder}/in", f"ipc://{folder}/out"
    context = zmq.Context()
    results, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    results.bind(outbox_address)
    outbox.connect(inbox_address)
    echo = spawn.Process(target=_zmq_echo, args=(inbox_address, outbox_address))
    echo.start()
    times = []
    for _ in range(_ROUNDS):
        start = time.perf_counter()
        outbox.send(msg.pack([msg.encode_output(o) for o in outputs]))
        [msg.decode_output(o) for o in msg.unpack(results.recv())]
        times.append(time.perf_counter() - start)
    echo.join()
    context.destroy(linger=0)
    size = len(msg.pack([msg.encode_output(o) for o in outputs]))
    print(f"ZeroMQ IPC + msgpack: median round trip {statistics.median(times) * 1e6:.0f} us "
          f"({size} bytes each way)")
    mine, theirs = spawn.Pipe()
    echo = spawn.Process(target=_pipe_echo, args=(theirs,))
    echo.start()
    times = []
    for _ in range(_ROUNDS):
        start = time.perf_counter()
        mine.send(outputs)
        mine.recv()
        times.append(time.perf_counter() - start)
    echo.join()
    print(f"multiprocessing Pipe + pickle: median round trip "
          f"{statistics.median(times) * 1e6:.0f} us ({len(pickle.dumps(outputs))} bytes each way)")


if __name__ == "__main__":
    main()
