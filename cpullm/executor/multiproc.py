"""The executor of a tensor- and pipeline-parallel replica: every rank in a worker process.

    engine core (the driver, not a rank)           worker process of rank r (0 .. world - 1)
      a TCPStore at master_addr:master_port  <---  joins it, then the ranks' gloo group
      each step, the pickled SchedulerOutput  ---> its PULL socket (address in the store)
      the ModelRunnerOutput, or an error  <------  the output rank (first of the last stage);
                                                   any rank whose step raised

Every rank receives every step and builds its own inputs from it; the layers' collectives
(cpullm/distributed.py) keep the ranks in step within the forward pass, and the first rank
of the last stage samples. Sending to a rank never blocks (ZeroMQ queues), so the driver
waits on one thing only, the step's result, and checks while it waits that every rank
lives: a rank that dies fails the step (and, between steps, ``check_health``) with an error
naming it, and its peers, whose collectives then fail, stop too. A rank that hangs fails
its peers' collectives after ``TIMEOUT``. Workers die with the driver (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq

from cpullm import distributed, envs
from cpullm.config import EngineConfig
from cpullm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from cpullm.logger import init_logger
from cpullm.utils import die_with_parent

logger = init_logger(__name__)

# Of one collective (a rank that hangs this long fails its peers) and of joining the store.
TIMEOUT = datetime.timedelta(minutes=5)
_POLL_MS = 250
_SHUTDOWN = b""
_HEARTBEAT_S = 1.0  # how often a rank says it lives
_HEARTBEAT_TIMEOUT = 8.0  # silence after which a rank on another host counts as gone


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reachable_address(master_addr: str) -> str:
    """This host's address on the route to ``master_addr`` (loopback for a local one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


class RankFailed(RuntimeError):
    """A rank of the replica died or its step raised."""


class MultiprocExecutor:
    """The driver's side: starts this host's ranks, sends each step to every rank, returns
    the output rank's result."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.stages = parallel.pipeline_parallel_size
        self.output_rank = distributed.RankLayout(parallel.tensor_parallel_size,
                                                  parallel.pipeline_parallel_size).output_rank
        host = parallel.master_addr
        port = parallel.master_port or free_port(host)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=TIMEOUT)
        self._zmq = zmq.Context()
        self._output = self._zmq.socket(zmq.PULL)
        address = reachable_address(host)
        self._output.bind_to_random_port(f"tcp://{address}")
        self.store.set("output", self._output.getsockopt_string(zmq.LAST_ENDPOINT))
        self._inputs: list[zmq.Socket] = []
        self._closed = False
        # Ranks on other hosts (``cpullm serve --headless``) are watched by their heartbeat.
        self._remote = [r for r in range(self.world_size) if r not in parallel.local_ranks]
        self._per_node = parallel.ranks_per_node
        self._beats: dict[int, tuple[bytes, float]] = {}
        self.workers = start_ranks(config, eos_token_ids, host, port)
        try:
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        for rank in range(self.world_size):
            sender = self._zmq.socket(zmq.PUSH)
            sender.setsockopt(zmq.SNDHWM, 0)
            sender.connect(self.store.get(f"worker/{rank}").decode())
            self._inputs.append(sender)
        logger.info("%d ranks ready (tensor-parallel %d x pipeline-parallel %d)",
                    self.world_size, parallel.tensor_parallel_size,
                    parallel.pipeline_parallel_size)

    def _wait_ready(self) -> None:
        """Until every rank has loaded its part of the model; a rank that fails to start
        fails this, with its error."""
        pending = set(range(self.world_size))
        last_log = time.monotonic()
        while pending:
            for rank in sorted(pending):
                if self.store.check([f"error/{rank}"]):
                    raise RankFailed(f"rank {rank} failed to start: "
                                     f"{self.store.get(f'error/{rank}').decode()}")
                if self.store.check([f"ready/{rank}"]):
                    pending.discard(rank)
            if pending:
                self._check_alive(starting=True)
                if time.monotonic() - last_log > 30:
                    logger.info("Waiting for ranks %s to load the model", sorted(pending))
                    last_log = time.monotonic()
                time.sleep(0.05)

    def _check_alive(self, starting: bool = False, skip: set[int] = frozenset()) -> None:
        for rank, process in self.workers.items():
            if process.exitcode is not None and rank not in skip:
                when = " while starting" if starting else ""
                raise RankFailed(f"rank {rank} (pid {process.pid}) exited with code "
                                 f"{process.exitcode}{when}")
        now = time.monotonic()
        for rank in self._remote:
            if rank in skip or not self.store.check([f"alive/{rank}"]):
                continue  # not started yet: _wait_ready waits for it
            beat = self.store.get(f"alive/{rank}")
            last = self._beats.get(rank)
            if last is None or last[0] != beat:
                self._beats[rank] = (beat, now)
            elif now - last[1] > _HEARTBEAT_TIMEOUT:
                raise RankFailed(f"rank {rank} (on node {rank // self._per_node}) sent no "
                                 f"heartbeat for {_HEARTBEAT_TIMEOUT:.0f} s")

    def check_health(self) -> None:
        """Between steps (none in flight): raise RankFailed if a rank is gone."""
        self._check_alive()
        if self._output.poll(0):  # only an error can come between steps
            message = pickle.loads(self._output.recv())
            if message[0] == "error":
                self._raise(message)

    def steps_in_flight(self, num_requests: int) -> int:
        return self.stages  # one per pipeline stage

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every rank, without waiting (pipeline parallelism keeps one in
        flight per stage)."""
        data = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        for sender in self._inputs:
            sender.send(data, copy=False)

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest step submitted and not yet collected."""
        while not self._output.poll(_POLL_MS):
            self._check_alive()
        message = pickle.loads(self._output.recv())
        if message[0] != "ok":
            self._raise(message)
        return message[1]

    def _raise(self, first: tuple[Any, ...]) -> None:
        """A rank's step raised. Its peers' collectives fail with it, so the errors of the
        next second are read too, to name the rank that started it: one that died without
        a word, else one whose own step raised, not a collective (gloo) on a peer."""
        errors = {first[1]: first[2]}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if self._output.poll(50):
                message = pickle.loads(self._output.recv())
                if message[0] == "error":
                    errors.setdefault(message[1], message[2])
        self._check_alive(skip=set(errors))
        rank = min(errors, key=lambda r: ("gloo" in errors[r], r))
        raise RankFailed(f"rank {rank} failed: {errors[rank]}")

    def bind_threads(self) -> None:
        """The ranks pin their own compute threads."""

    def release_calling_thread(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sender in self._inputs:
            sender.send(_SHUTDOWN)
        for process in self.workers.values():
            process.join(5)
            if process.is_alive():
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
                process.join(2)
        self._zmq.destroy(linger=0)


def start_ranks(config: EngineConfig, eos_token_ids: set[int], host: str, port: int
                ) -> dict[int, Any]:
    """This host's ranks of the replica, each a process started (spawn) on ``run_worker``."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    workers = {rank: context.Process(target=run_worker, name=f"cpullm-rank-{rank}",
                                     args=(config, eos_token_ids, rank, host, port))
               for rank in config.parallel.local_ranks}
    for process in workers.values():
        process.start()
    logger.info("Started ranks %s", ", ".join(f"{rank} (pid {process.pid})"
                                              for rank, process in workers.items()))
    return workers


def _heartbeat(host: str, port: int, rank: int) -> None:
    """Say every second that this rank lives, for a driver on another host."""
    store = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    beat = 0
    while True:
        beat += 1
        try:
            store.set(f"alive/{rank}", str(beat))
        except RuntimeError:
            return  # the driver is gone
        time.sleep(_HEARTBEAT_S)


def _driver_lives(store: dist.Store) -> bool:
    """Whether the driver's store still answers."""
    try:
        return store.check(["output"])
    except RuntimeError:
        return False


def run_worker(config: EngineConfig, eos_token_ids: set[int], rank: int, host: str,
               port: int) -> None:
    """A rank's process: join the replica, load its part of the model, then run every step
    the driver sends until it sends the shutdown (or goes away)."""
    from cpullm.worker.model_runner import ModelRunner

    parent = os.getppid()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops the ranks
    parallel = config.parallel
    layout = distributed.RankLayout(parallel.tensor_parallel_size,
                                    parallel.pipeline_parallel_size, rank)
    store = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    context = zmq.Context()
    outbox = context.socket(zmq.PUSH)
    outbox.connect(store.get("output").decode())
    inbox = context.socket(zmq.PULL)
    try:
        if parallel.binding.mode == "nobind" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.world_size))
        torch.manual_seed(config.model.seed)
        one_host = parallel.nnodes == 1
        distributed.init_distributed(layout, store, TIMEOUT,
                                     shared_memory=one_host and envs.CPULLM_SHM_ALLREDUCE)
        runner = ModelRunner(config, eos_token_ids)
        inbox.bind_to_random_port(f"tcp://{reachable_address(host)}")
        store.set(f"worker/{rank}", inbox.getsockopt_string(zmq.LAST_ENDPOINT))
    except BaseException as e:
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    store.set(f"ready/{rank}", "1")
    if parallel.nnodes > 1:
        threading.Thread(target=_heartbeat, args=(host, port, rank), daemon=True).start()
    try:
        while True:
            if not inbox.poll(1000):
                if os.getppid() != parent or not _driver_lives(store):
                    return  # the driver (or, on another host, the launcher) is gone
                continue
            data = inbox.recv()
            if data == _SHUTDOWN:
                return
            try:
                output = runner.execute(pickle.loads(data))
            except Exception as e:
                logger.exception("Rank %d: the step failed", rank)
                outbox.send(pickle.dumps(("error", rank, f"{type(e).__name__}: {e}")))
                raise SystemExit(1) from None
            if rank == layout.output_rank:
                outbox.send(pickle.dumps(("ok", output), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        outbox.close(linger=1000)  # an error still goes out
        inbox.close(linger=0)
        context.term()
        distributed.shutdown_distributed()


def run_headless(config: EngineConfig, eos_token_ids: set[int]) -> int:
    """``cpullm serve --headless``: this host's ranks only, for the driver on node 0 (at
    ``master_addr``); returns when they have all exited (the driver stopped, or a rank
    failed), 0 if they all exited cleanly."""
    parallel = config.parallel
    workers = start_ranks(config, eos_token_ids, parallel.master_addr, parallel.master_port)

    def stop(number: int, _: Any) -> None:
        logger.info("Stopping the ranks on %s", signal.Signals(number).name)
        for process in workers.values():
            process.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    codes = {}
    for rank, process in workers.items():
        process.join()
        codes[rank] = process.exitcode
    logger.info("Ranks exited: %s", ", ".join(f"{r} (code {c})" for r, c in codes.items()))
    return 0 if all(code == 0 for code in codes.values()) else 1
