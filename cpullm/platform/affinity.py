"""Applying a binding plan to the threads of this process, and NUMA memory policy."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from typing import TYPE_CHECKING

import torch

from cpullm.logger import init_logger
from cpullm.platform.topology import CpuTopology, format_cpu_list

if TYPE_CHECKING:
    from cpullm.model_executor.layers.ops import KernelTable

logger = init_logger(__name__)

_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_MPOL_PREFERRED = 1
_warned_mempolicy = False


def bind_compute_threads(cpus: list[int], ops: KernelTable | None) -> list[int]:
    """Pin torch's intra-op threads of the calling thread, one per CPU in ``cpus``.

    Must run on the thread that executes the model: OpenMP keeps a thread pool per calling
    thread. Returns the CPU each pool thread got (-1 where the kernel refused).
    """
    # torch sizes a thread's pool once, lazily, from the process-wide count that the last
    # binding of any thread set: let it do so now, so that this thread keeps its own size.
    torch.get_num_threads()
    if ops is not None:
        return list(ops.bind_threads(cpus))
    # Without the compiled helper the pool threads cannot be reached one by one: size the
    # pool and confine the calling thread (and the threads it starts later) to the set.
    torch.set_num_threads(len(cpus))
    os.sched_setaffinity(0, cpus)
    logger.warning("CPU kernels unavailable: threads confined to CPUs %s as a set, not one "
                   "per core", format_cpu_list(cpus))
    return [-1] * len(cpus)


def thread_affinities() -> dict[int, list[int]]:
    """CPUs each thread of this process may run on, read back from /proc."""
    result = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            result[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:
            continue
    return result


def prefer_local_memory(topology: CpuTopology, cpus: list[int]) -> None:
    """Prefer the NUMA node of ``cpus`` for this thread's allocations; where the kernel
    denies NUMA syscalls (containers), warn once and carry on."""
    global _warned_mempolicy
    nodes = sorted({topology.node_of(c) for c in cpus})
    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if len(topology.nodes) < 2 or len(nodes) != 1 or number is None:
        return
    mask = ctypes.c_ulong(1 << nodes[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _MPOL_PREFERRED, ctypes.byref(mask), 64) != 0:
        err = ctypes.get_errno()
        if not _warned_mempolicy:
            logger.warning("set_mempolicy: %s; running without NUMA memory binding",
                           os.strerror(err) if err != errno.EPERM else "Operation not permitted")
            _warned_mempolicy = True


def bind_frontend_thread(cpus: list[int]) -> None:
    """Keep the calling (front-end) thread on the reserved CPUs, if there are any."""
    if cpus:
        os.sched_setaffinity(0, cpus)
        logger.info("Front-end thread %s on reserved CPUs %s", threading.current_thread().name,
                    format_cpu_list(cpus))
