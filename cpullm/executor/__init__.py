"""Executors: what runs a step's forward pass for the engine core, over one worker or,
for tensor and pipeline parallelism, several ranks."""

from cpullm.config import EngineConfig
from cpullm.executor.uniproc import Executor, UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "create_executor"]


def create_executor(config: EngineConfig, eos_token_ids: set[int]) -> Executor:
    """One model runner here for a replica of one rank, else a worker process per rank."""
    if config.parallel.world_size == 1:
        return UniProcExecutor(config, eos_token_ids)
    from cpullm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, eos_token_ids)
