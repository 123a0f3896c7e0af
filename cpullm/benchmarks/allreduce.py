"""``cpullm bench allreduce``: what one tensor-parallel all-reduce costs on this host.

It starts ``--tensor-parallel-size`` processes, pinned a core each (as auto binding pins
ranks), joined as the engine joins its ranks, and times the all-reduce of bfloat16 hidden
states [rows, hidden] through gloo and through shared memory (the engine's default on one
host). A decoder layer does two (after attention, after the MLP); the table gives the
median per call and per layer, in microseconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from cpullm import distributed

_SIZES = (2048, 4096, 8192)  # hidden sizes of 1B, 8B and 70B Llama models
_ROWS = (1, 16, 128)  # one decode, a batch of decodes, a larger batch
_CALLS = 200


def add_allreduce_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2,
                        help="ranks (processes) summing")
    parser.add_argument("--hidden-sizes", type=int, nargs="+", default=list(_SIZES),
                        help="hidden sizes to time (default: those of 1B, 8B, 70B Llamas)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(_ROWS),
                        help="tokens in a step (rows of the summed hidden states)")
    parser.add_argument("--calls", type=int, default=_CALLS, help="timed calls per case")


def _time(call: Any, x: torch.Tensor, calls: int) -> float:
    for _ in range(20):  # warm up
        call(x)
    dist.barrier()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _rank(rank: int, ranks: int, port: int, args: argparse.Namespace,
          results: Any) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=datetime.timedelta(
        seconds=60))
    distributed.init_distributed(distributed.RankLayout(ranks, 1, rank), store,
                                 datetime.timedelta(seconds=60), shared_memory=True)
    shared = distributed._shared
    rows: list[tuple[int, int, float, float | None]] = []
    for hidden in args.hidden_sizes:
        for n in args.rows:
            x = torch.randn(n, hidden).bfloat16()
            gloo = _time(lambda t: dist.all_reduce(t), x, args.calls)
            shm = _time(shared.all_reduce, x, args.calls) if shared is not None else None
            rows.append((hidden, n, gloo, shm))
    if rank == 0:
        results.put(rows)
    distributed.shutdown_distributed()


def run_allreduce(args: argparse.Namespace) -> None:
    import multiprocessing

    from cpullm.executor.multiproc import free_port

    ranks = args.tensor_parallel_size
    if ranks < 2:
        raise SystemExit("--tensor-parallel-size must be at least 2")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port("127.0.0.1")
    processes = [context.Process(target=_rank, args=(r, ranks, port, args, results))
                 for r in range(ranks)]
    for process in processes:
        process.start()
    rows = results.get()
    for process in processes:
        process.join()
    print(f"All-reduce of bfloat16 [rows, hidden] over {ranks} ranks, median of {args.calls} "
          "calls (a decoder layer does two)")
    print(f"{'hidden':>7} {'rows':>5} {'gloo us':>9} {'shm us':>8} {'gloo/layer':>11} "
          f"{'shm/layer':>10}")
    for hidden, n, gloo, shm in rows:
        shm_text = f"{shm:8.1f}" if shm is not None else f"{'-':>8}"
        shm_layer = f"{2 * shm:10.1f}" if shm is not None else f"{'-':>10}"
        print(f"{hidden:>7} {n:>5} {gloo:9.1f} {shm_text} {2 * gloo:11.1f} {shm_layer}")
