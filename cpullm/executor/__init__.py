"""Executors: what runs a step's forward pass for the engine core, over one worker or,
for tensor and pipeline parallelism, several ranks."""

from cpullm.executor.uniproc import Executor, UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
