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
from dataclasses import dataclass

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


_layout = RankLayout()
_tp_group: dist.ProcessGroup | None = None


def layout() -> RankLayout:
    """This process's place in its replica (a world of one unless initialised)."""
    return _layout


def tp_size() -> int:
    return _layout.tp_size


def tp_rank() -> int:
    return _layout.tp_rank


def init_distributed(rank_layout: RankLayout, store: dist.Store,
                     timeout: datetime.timedelta) -> None:
    """Join the replica's gloo group (every rank calls this with the same store) and make
    the tensor-parallel group of each stage. ``timeout`` bounds every collective: a rank
    that hangs fails the others with an error instead of a hang (one that dies fails them
    at once: its connections close)."""
    global _layout, _tp_group
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


def shutdown_distributed() -> None:
    global _layout, _tp_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _layout, _tp_group = RankLayout(), None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the stage's tensor-parallel ranks (in place)."""
    if _layout.tp_size > 1:
        dist.all_reduce(x, group=_tp_group)
    return x


def tp_gather(x: torch.Tensor) -> torch.Tensor | None:
    """Every tensor-parallel rank's ``x`` [rows, n], side by side [rows, n * tp], on the
    stage's first rank; None on the others."""
    if _layout.tp_size == 1:
        return x
    x = x.contiguous()
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
