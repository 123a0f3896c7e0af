"""The executor seam of the engine core, and its single-worker implementation.

The engine core hands each step's SchedulerOutput to an Executor and gets one
ModelRunnerOutput back; it never calls a model runner itself. UniProcExecutor runs the one
ModelRunner in the core's own process; MultiprocExecutor (cpullm/executor/multiproc.py)
the ranks of a tensor- and pipeline-parallel replica, each in a worker process with its
share of the model and of the KV heads.
"""

from __future__ import annotations

from typing import Protocol

from cpullm.config import EngineConfig
from cpullm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from cpullm.worker.model_runner import ModelRunner


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over the scheduled tokens, and the sampled tokens."""

    def bind_threads(self) -> None:
        """Pin the compute threads to the calling thread's pool."""

    def release_calling_thread(self) -> None:
        """Give the calling thread its CPUs back."""

    def check_health(self) -> None:
        """Raise if a rank is gone (between steps)."""

    def shutdown(self) -> None:
        """Stop the ranks."""


class UniProcExecutor:
    """One ModelRunner, in this process."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        if config.model.is_encoder:
            from cpullm.worker.pooling_runner import PoolingRunner

            self.model_runner: ModelRunner | PoolingRunner = PoolingRunner(config, eos_token_ids)
        else:
            self.model_runner = ModelRunner(config, eos_token_ids)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute(scheduler_output)

    def bind_threads(self) -> None:
        self.model_runner.bind_threads()

    def release_calling_thread(self) -> None:
        self.model_runner.release_calling_thread()

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
