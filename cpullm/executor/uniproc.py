"""The executor seam of the engine core, and its single-worker implementation.

The engine core hands each step's SchedulerOutput to an Executor and gets one
ModelRunnerOutput back; it never calls a model runner itself. UniProcExecutor runs the one
ModelRunner in the core's own process; MultiprocExecutor (cpullm/executor/multiproc.py)
the ranks of a tensor- and pipeline-parallel replica, each in a worker process with its
share of the model and of the KV heads.

Compute lanes. A large batch's decode step is two kinds of work in turn: the GEMMs, bound
by the cores' arithmetic, and the attention, bound by the memory's bandwidth. One step at a
time leaves the arithmetic idle while the attention streams the KV cache. With lanes, the
rank's CPUs are split in two (each lane a thread with its own OpenMP pool pinned to its
half) and the engine core keeps a step in flight per lane, each with half the requests:
the lanes' steps drift apart, so one lane's attention runs beside the other's GEMMs, and
each lane's kernels synchronize half as many threads. Lanes run only while every lane gets
at least ``LANE_MIN_REQUESTS`` requests: below that the GEMMs are bound by the weights'
reads, which two lanes would double, and a request's step would take one lane's CPUs
instead of all of them; there one step at a time runs on all the CPUs, as without lanes.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from cpullm import envs
from cpullm.config import EngineConfig
from cpullm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from cpullm.logger import init_logger
from cpullm.model_executor.layers.ops import load_ops
from cpullm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

# requests per lane below which steps run one at a time on all the CPUs
LANE_MIN_REQUESTS = 32
# the most CPUs a rank has for lanes to be on by default: measured on 2; with many cores a
# lane's GEMMs of 32-64 rows are bound by the weights' reads, which two lanes would double
AUTO_LANES_MAX_CPUS = 4


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over the scheduled tokens, and the sampled tokens."""

    def steps_in_flight(self, num_requests: int) -> int:
        """How many steps the engine core keeps in flight (``submit`` and ``collect``)
        with ``num_requests`` unfinished requests; 1: one ``execute_model`` at a time."""

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step; its output comes from ``collect``, oldest first."""

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted, when it is done."""

    def bind_threads(self) -> None:
        """Pin the compute threads to the calling thread's pool."""

    def release_calling_thread(self) -> None:
        """Give the calling thread its CPUs back."""

    def check_health(self) -> None:
        """Raise if a rank is gone (between steps)."""

    def shutdown(self) -> None:
        """Stop the ranks."""


class UniProcExecutor:
    """One ModelRunner, in this process; with compute lanes, it runs the steps in flight on
    the lanes' threads."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        self._lanes: list[ThreadPoolExecutor] = []
        self._in_flight: deque[Future[ModelRunnerOutput]] = deque()
        self.lane_steps: list[int] = []  # steps each lane ran
        if config.model.is_encoder:
            from cpullm.worker.pooling_runner import PoolingRunner

            self.model_runner: ModelRunner | PoolingRunner = PoolingRunner(config, eos_token_ids)
            return
        self.model_runner = runner = ModelRunner(config, eos_token_ids)
        shares = lane_cpus(config, runner.bound_cpus())
        for i, cpus in enumerate(shares):
            lane = ThreadPoolExecutor(1, thread_name_prefix=f"cpullm-lane-{i}")
            lane.submit(runner.bind_threads, cpus,
                        torch.Generator().manual_seed(config.model.seed + 1 + i)).result()
            self._lanes.append(lane)
        if shares:
            logger.info("%d compute lanes, on CPUs %s: from %d requests on, a step in "
                        "flight per lane", len(shares),
                        " | ".join(",".join(map(str, c)) for c in shares),
                        len(shares) * LANE_MIN_REQUESTS)
        self._turn = itertools.cycle(range(len(self._lanes)))
        self.lane_steps = [0] * len(self._lanes)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute(scheduler_output)

    def steps_in_flight(self, num_requests: int) -> int:
        lanes = len(self._lanes)
        return lanes if lanes and num_requests >= lanes * LANE_MIN_REQUESTS else 1

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        # In turn: the steps in flight (at most one per lane) are on distinct lanes.
        lane = next(self._turn)
        self.lane_steps[lane] += 1
        self._in_flight.append(self._lanes[lane].submit(self.model_runner.execute,
                                                         scheduler_output))

    def collect(self) -> ModelRunnerOutput:
        return self._in_flight.popleft().result()

    def bind_threads(self) -> None:
        self.model_runner.bind_threads()

    def release_calling_thread(self) -> None:
        self.model_runner.release_calling_thread()

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=True)
        self._lanes = []


def lane_cpus(config: EngineConfig, cpus: list[int] | None) -> list[list[int]]:
    """The CPUs of each compute lane of a rank bound to ``cpus`` (None: unbound, which has
    no lanes), or no lanes. ``CPULLM_COMPUTE_LANES`` asks for a number (1: none; at most one
    per CPU); unset, two lanes where the compiled kernels run on 2 to
    ``AUTO_LANES_MAX_CPUS`` CPUs without AMX tiles. (With AMX tiles, or many cores, a
    batch's GEMMs are bound by the weights' reads well past 64 rows, and two lanes would
    read the weights twice; lanes wait there for a measurement.)"""
    asked = envs.CPULLM_COMPUTE_LANES
    if asked is not None and asked < 1:
        raise ValueError(f"CPULLM_COMPUTE_LANES must be >= 1, got {asked}")
    if cpus is None or len(cpus) < 2:
        if asked is not None and asked > 1:
            logger.warning("CPULLM_COMPUTE_LANES=%d: no lanes where the compute threads are "
                           "not bound to two CPUs or more", asked)
        return []
    if asked is None:
        ops = None if config.model.enforce_eager else load_ops()
        asked = 2 if (ops is not None and not ops.amx
                      and len(cpus) <= AUTO_LANES_MAX_CPUS) else 1
    lanes = min(asked, len(cpus))
    if lanes == 1:
        return []
    return [cpus[i * len(cpus) // lanes:(i + 1) * len(cpus) // lanes] for i in range(lanes)]
