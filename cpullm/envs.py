"""Every environment variable cpullm reads, in one place.

The names and meanings are vLLM CPU's, so a deployment tuned for vLLM carries over.
Values are read when accessed (``envs.VLLM_CPU_KVCACHE_SPACE``), not at import, so tests
and launchers can set them late.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _optional_float(name: str) -> float | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of GiB, got {value!r}") from None


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _optional_bool(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


environment_variables: dict[str, Callable[[], Any]] = {
    # KV cache size in GiB for the CPU backend; unset means a default chosen at startup.
    "VLLM_CPU_KVCACHE_SPACE": lambda: _optional_float("VLLM_CPU_KVCACHE_SPACE"),
    # CPU ids the compute threads are bound to: "auto", "nobind", "0-31" or "0-31|32-63".
    "VLLM_CPU_OMP_THREADS_BIND": lambda: os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
    # CPUs kept free of compute threads for the front-end (auto binding only).
    "VLLM_CPU_NUM_OF_RESERVED_CPU": lambda: _optional_int("VLLM_CPU_NUM_OF_RESERVED_CPU"),
    # NUMA nodes (comma list) visible to auto binding, in order.
    "CPU_VISIBLE_MEMORY_NODES": lambda: os.environ.get("CPU_VISIBLE_MEMORY_NODES"),
    # Log level of the cpullm logger.
    "VLLM_LOGGING_LEVEL": lambda: os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
    # Bearer key the OpenAI server requires when --api-key is not given.
    "VLLM_API_KEY": lambda: os.environ.get("VLLM_API_KEY"),
    # Whether the server has /v1/load_lora_adapter and /v1/unload_lora_adapter (true or 1).
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: os.environ.get(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
    # Whether the engine core runs in a process of its own: 0 keeps it in the calling process
    # (the server then steps it on a thread), 1 moves it out (also under LLM()). Unset
    # (None): the server moves it out, LLM() keeps it.
    "VLLM_ENABLE_V1_MULTIPROCESSING": lambda: _optional_bool("VLLM_ENABLE_V1_MULTIPROCESSING"),
    # On the AMD Zen platform (zentorch installed): 0 hands zentorch the weights in their
    # plain layout instead of prepacking them for it at load.
    "VLLM_ZENTORCH_WEIGHT_PREPACK": lambda: _optional_bool("VLLM_ZENTORCH_WEIGHT_PREPACK")
    is not False,
    # cpullm's own: 0 sends the tensor-parallel all-reduces of one host through gloo
    # instead of shared memory (for measuring; shared memory is the default).
    "CPULLM_SHM_ALLREDUCE": lambda: _optional_bool("CPULLM_SHM_ALLREDUCE") is not False,
    # cpullm's own: the kernel library's instruction-set level (avx2, avx512, avx512_bf16)
    # where the CPU runs a higher one: runs and measures an older CPU's kernels on a newer
    # one. Unset: the highest this CPU runs.
    "CPULLM_KERNEL_ISA": lambda: os.environ.get("CPULLM_KERNEL_ISA") or None,
    # cpullm's own: compute lanes of one rank (cpullm/executor/uniproc.py), each a share of
    # its CPUs running steps of its own share of the requests, overlapping the other lanes'
    # steps; 1 turns them off. Unset: the platform's choice.
    "CPULLM_COMPUTE_LANES": lambda: _optional_int("CPULLM_COMPUTE_LANES"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
