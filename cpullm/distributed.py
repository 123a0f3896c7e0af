"""The ranks of one engine replica, and the collectives its model's layers call.

A replica of ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks runs one model:
rank r is tensor-parallel rank ``r % tp`` of pipeline stage ``r // tp`` (vLLM's order, so
that the ranks of one stage are neighbours, on one NUMA node or host). Every rank is a
process with a ``torch.distributed`` gloo group over TCP; within a stage the layers
all-reduce their partial outputs (``tp_all_reduce``) and the LM head gathers its slices of
the vocabulary on the stage's first rank (``tp_gather``); stages hand hidden states on with
point-to-point sends.

A process that never calls ``init_distributed`` is a world of one: the layers' collectives
are then no-ops, and the model is the whole model.
"""

from __future__ import annotations

import datetime
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits in its replica."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The rank that samples: the first of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def stage_layers(self, num_layers: int, stage: int | None = None) -> range:
        """The decoder layers of ``stage`` (default: this rank's): contiguous, as even as
        they split, the first stages taking one more where they do not."""
        stage = self.pp_rank if stage is None else stage
        base, extra = divmod(num_layers, self.pp_size)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))


class SharedMemoryAllReduce:
    """The sum over the tensor-parallel ranks of one host, through a shared-memory segment
    instead of gloo's TCP loopback (which takes 0.5-2 ms a call on two Zen 5 cores, against
    microseconds here; ``cpullm bench allreduce`` measures both).

    Every rank has a slot in each of two buffers: a call copies x into the rank's slot of
    buffer ``seq % 2``, raises the rank's flag to ``seq``, waits until every flag reaches
    ``seq``, then adds the slots up in rank order (so every rank gets the same bits). A rank can
    start writing buffer ``seq % 2`` again two calls later only once every rank has raised
    its flag past ``seq + 1``, that is, has finished reading it. x86's store order keeps the
    data visible before the flag. A sum larger than a slot goes a slot at a time; a gather
    larger than a slot through gloo (every rank makes the same choice, from the same
    size)."""

    SLOT_BYTES = 8 << 20  # a decode step's hidden states; prompt steps' larger sums: gloo
    _FLAG_STRIDE = 8  # int64 flags a cache line apart

    def __init__(self, path: str, rank: int, ranks: int, create: bool) -> None:
        header = ranks * self._FLAG_STRIDE * 8
        size = header + 2 * ranks * self.SLOT_BYTES
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._map, dtype=np.int64,
                                    count=ranks * self._FLAG_STRIDE)[::self._FLAG_STRIDE]
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header,
                                      count=2 * ranks * self.SLOT_BYTES).view(
                                          2, ranks, self.SLOT_BYTES)
        self.rank, self.ranks, self._seq = rank, ranks, 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.SLOT_BYTES

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (at most a slot), [ranks, *x.shape], once all have put theirs."""
        nbytes = x.numel() * x.element_size()
        self._seq += 1
        seq = self._seq
        slots = self._data[seq % 2, :, :nbytes].view(x.dtype).view(self.ranks, *x.shape)
        slots[self.rank].copy_(x)
        self._flags[self.rank] = seq
        while (self._flags < seq).any():
            os.sched_yield()  # ranks may share cores
        return slots

    def all_reduce(self, x: torch.Tensor) -> None:
        """x (contiguous) = the sum of every rank's x, a slot's worth at a time."""
        flat = x.view(-1)
        step = self.SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step]
            slots = self._exchange(part)
            torch.add(slots[0], slots[1], out=part)  # (torch.sum over dim 0: 10x slower)
            for rank in range(2, self.ranks):
                part.add_(slots[rank])

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [rows, n] side by side [rows, n * ranks] on rank 0 (x at most a
        slot); None on the others."""
        slots = self._exchange(x)
        return torch.cat(list(slots), dim=-1) if self.rank == 0 else None


_layout = RankLayout()
_tp_group: dist.ProcessGroup | None = None
_shared: SharedMemoryAllReduce | None = None


def layout() -> RankLayout:
    """This process's place in its replica (a world of one unless initialised)."""
    return _layout


def tp_size() -> int:
    return _layout.tp_size


def tp_rank() -> int:
    return _layout.tp_rank


def init_distributed(rank_layout: RankLayout, store: dist.Store,
                     timeout: datetime.timedelta, shared_memory: bool = False) -> None:
    """Join the replica's gloo group (every rank calls this with the same store) and make
    the tensor-parallel group of each stage. ``timeout`` bounds every collective: a rank
    that hangs fails the others with an error instead of a hang (one that dies fails them
    at once: its connections close). ``shared_memory``: the ranks share a host, so the
    stage's all-reduces may go through shared memory (SharedMemoryAllReduce)."""
    global _layout, _tp_group, _shared
    dist.init_process_group("gloo", store=store, rank=rank_layout.rank,
                            world_size=rank_layout.world_size, timeout=timeout)
    tp, pp = rank_layout.tp_size, rank_layout.pp_size
    _tp_group = None
    if pp > 1 and tp > 1:
        for stage in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if stage == rank_layout.pp_rank:
                _tp_group = group
    _layout = rank_layout
    _shared = _open_shared_memory(store) if shared_memory and tp > 1 else None


def _open_shared_memory(store: dist.Store) -> SharedMemoryAllReduce | None:
    """The stage's segment: made by its first rank, opened by the others, then unlinked
    (nothing is left behind, whatever happens to the ranks). None (gloo, with a warning)
    where /dev/shm cannot hold it."""
    from cpullm.logger import init_logger

    layout, key = _layout, f"shm/{_layout.pp_rank}"
    path = f"/dev/shm/cpullm-allreduce-{os.getpid()}-{layout.pp_rank}"
    shared: SharedMemoryAllReduce | None = None
    error = ""
    if layout.tp_rank == 0:
        try:
            shared = SharedMemoryAllReduce(path, 0, layout.tp_size, create=True)
            store.set(key, path)
        except OSError as e:
            store.set(key, "")
            error = str(e)
    else:
        path = store.get(key).decode()
        if path:
            shared = SharedMemoryAllReduce(path, layout.tp_rank, layout.tp_size, create=False)
    opened = torch.tensor([int(shared is not None)])
    dist.all_reduce(opened, op=dist.ReduceOp.MIN, group=_tp_group)  # every rank opened it
    if layout.tp_rank == 0 and shared is not None:
        os.unlink(path)
    if not opened.item():
        if layout.tp_rank == 0:
            init_logger(__name__).warning("All-reduce through gloo: no shared memory (%s)",
                                          error or "a rank could not open it")
        return None
    return shared


def shutdown_distributed() -> None:
    global _layout, _tp_group, _shared
    if dist.is_initialized():
        dist.destroy_process_group()
    _layout, _tp_group, _shared = RankLayout(), None, None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the stage's tensor-parallel ranks (in place)."""
    if _layout.tp_size > 1:
        if _shared is not None and x.is_contiguous():
            _shared.all_reduce(x)
        else:
            dist.all_reduce(x, group=_tp_group)
    return x


def tp_gather(x: torch.Tensor) -> torch.Tensor | None:
    """Every tensor-parallel rank's ``x`` [rows, n], side by side [rows, n * tp], on the
    stage's first rank; None on the others."""
    if _layout.tp_size == 1:
        return x
    x = x.contiguous()
    if _shared is not None and _shared.fits(x):
        return _shared.gather(x)
    first = _layout.pp_rank * _layout.tp_size
    parts = [torch.empty_like(x) for _ in range(_layout.tp_size)] \
        if _layout.tp_rank == 0 else None
    dist.gather(x, parts, dst=first, group=_tp_group)
    return None if parts is None else torch.cat(parts, dim=-1)


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """Hand ``tensors`` to the same tensor-parallel rank of the next stage."""
    peer = _layout.rank + _layout.tp_size
    for tensor in tensors:
        dist.send(tensor.contiguous(), peer)


def recv_from_previous_stage(shapes: list[tuple[int, ...]], dtype: torch.dtype
                             ) -> list[torch.Tensor]:
    """What the previous stage's ``send_to_next_stage`` sent, tensor by tensor."""
    peer = _layout.rank - _layout.tp_size
    tensors = [torch.empty(shape, dtype=dtype) for shape in shapes]
    for tensor in tensors:
        dist.recv(tensor, peer)
    return tensors
