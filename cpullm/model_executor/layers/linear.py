"""Linear layers behind one small interface.

Every linear layer owns its parameters and a ``weight_loader(param, loaded, shard_id)``
that copies a checkpoint tensor into the right slice. Merged layers (QKV, gate-up) take
several checkpoint tensors as shards of one weight, so the forward pass runs one GEMM
instead of three or two. What the parameters are and how the matmul runs is the layer's
``LinearMethod`` (layers/quantization): dense unless the model's quantization config says
otherwise.

Under tensor parallelism (cpullm/distributed.py) a layer holds its rank's part only:
column-parallel layers (QKV, gate-up) a slice of the output rows of every checkpoint
shard, each rank computing its heads or its part of the intermediate; row-parallel layers
(the attention output and down projections) a slice of the input columns, the partial
products summed over the ranks. The checkpoint tensor arrives whole (a torch tensor, GGUF's
``RawBlocks``, AWQ/GPTQ's ``IntGroups``: anything with ``shape`` and ``narrow``) and the
layer's ``rank_parts`` cuts its rank's part out before the method keeps it, so quantized
layers split the same way as dense ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cpullm import distributed
from cpullm.model_executor.layers.activation import SiluAndMul
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.layers.quantization.dense import DenseLinearMethod


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with W of shape [output_size, input_size] (this rank's sizes)."""

    gemm: PackedGemm | None = None  # the dense method's packed weight, set after loading
    shard_ids: tuple[str | int | None, ...] = (None,)  # the checkpoint tensors it takes
    # How tensor parallelism splits it: None (whole on every rank), "column" (output rows)
    # or "row" (input columns, partial products summed over the ranks).
    split: str | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ((distributed.tp_rank(), distributed.tp_size())
                                      if self.split else (0, 1))
        self.input_size = input_size
        self.output_size = output_size
        # An activation the method applies to the output (a submodule, so not a class
        # attribute, which would hide it).
        self.act: SiluAndMul | None = None
        self.method = (DenseLinearMethod() if quant_config is None
                       else quant_config.linear_method(self))
        self.method.create_weights(self, bias, dtype)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        """Rows of the output that the checkpoint tensor ``shard_id`` fills."""
        assert shard_id is None, f"{type(self).__name__} has no shards"
        return 0, self.output_size

    def checkpoint_rows(self, shard_id: str | int | None) -> int:
        """Output rows of the whole checkpoint tensor ``shard_id`` (all ranks')."""
        start, end = self.shard_range(shard_id)
        return end - start

    def checkpoint_shape(self, shard_id: str | int | None) -> tuple[int, int]:
        """[rows, k] of the whole checkpoint tensor ``shard_id``."""
        k = self.input_size * (self.tp_size if self.split == "row" else 1)
        return self.checkpoint_rows(shard_id), k

    def rank_slice(self, shard_id: str | int | None) -> tuple[int, int, int]:
        """(dim, start, length): this rank's part of checkpoint tensor ``shard_id``."""
        rows = self.checkpoint_rows(shard_id)
        return 0, 0, rows

    def rank_parts(self, loaded: Any, shard_id: str | int | None) -> list[tuple[Any, Any]]:
        """(shard id, this rank's part) of a checkpoint tensor; a fused one (the shards of
        a merged layer in one tensor, ``shard_id`` None) in its shards when the layer is
        split, else whole."""
        if self.tp_size == 1:
            return [(shard_id, loaded)]
        parts = [(shard_id, loaded)]
        if shard_id is None and len(self.shard_ids) > 1:
            sizes = [self.checkpoint_rows(s) for s in self.shard_ids]
            if loaded.shape[0] != sum(sizes):
                raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, the "
                                 f"fused shards have {sum(sizes)} rows")
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            parts = [(s, loaded.narrow(0, start, size))
                     for s, start, size in zip(self.shard_ids, starts, sizes, strict=True)]
        return [(s, self._rank_part(part, s)) for s, part in parts]

    def _rank_part(self, loaded: Any, shard_id: str | int | None) -> Any:
        dim, start, length = self.rank_slice(shard_id)
        if len(loaded.shape) == 1 and dim == 1:  # a row-parallel layer's bias: added once
            return loaded if self.tp_rank == 0 else torch.zeros_like(loaded)
        full = self.checkpoint_shape(shard_id)[dim]
        if loaded.shape[dim] != full:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint "
                             f"{tuple(loaded.shape)}, {full} along dimension {dim} expected")
        try:
            return loaded.narrow(dim, start, length)
        except ValueError as e:
            raise ValueError(f"shard {shard_id!r} does not split over {self.tp_size} "
                             f"tensor-parallel ranks: {e}") from None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        """Copy this rank's part of a checkpoint tensor into the output rows of its
        shard."""
        for shard, part in self.rank_parts(loaded, shard_id):
            start, end = self.shard_range(shard)
            target = param.data[start:end]
            if target.shape != part.shape:
                raise ValueError(f"shape mismatch for shard {shard!r}: checkpoint "
                                 f"{tuple(part.shape)}, model {tuple(target.shape)}")
            target.copy_(part)

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        self.method.process_weights_after_loading(self, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def step_fn(self, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """``self(x)`` as one function of a 2-D contiguous x of ``dtype``, and the most
        rows it holds for (``LinearMethod.step_fn``); None where there is none, or where a
        subclass's forward does more than the product."""
        if type(self).forward is not LinearBase.forward:
            return None
        return self.method.step_fn(self, dtype)


class ReplicatedLinear(LinearBase):
    """A plain linear layer, whole on every rank."""


def _split(size: int, ranks: int, what: str) -> int:
    if size % ranks:
        raise ValueError(f"{what} ({size}) does not split over {ranks} tensor-parallel ranks")
    return size // ranks


class RowParallelLinear(LinearBase):
    """Each rank multiplies its slice of the input columns (the heads or the part of the
    intermediate that its column-parallel layer before computed); the partial outputs
    are summed over the ranks (``reduce``; a mixture of experts sums its experts first),
    the bias added once."""

    split = "row"

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, reduce: bool = True) -> None:
        self.reduce = reduce
        ranks = distributed.tp_size()
        super().__init__(_split(input_size, ranks, "the input size"), output_size, bias, dtype,
                         quant_config)

    def rank_slice(self, shard_id: str | int | None) -> tuple[int, int, int]:
        return 1, self.tp_rank * self.input_size, self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return distributed.tp_all_reduce(out) if self.reduce else out

    def step_fn(self, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """As LinearBase's, where there are no ranks' partial products to sum."""
        if type(self).forward is not RowParallelLinear.forward or (self.reduce
                                                                    and self.tp_size > 1):
            return None
        return self.method.step_fn(self, dtype)


class MergedColumnLinear(LinearBase):
    """Several linear layers with the same input, stacked along the output
    (gate_proj and up_proj -> gate_up_proj). Shard ids are the positions 0, 1, ...; None:
    all of them at once. Column-parallel: each rank holds its slice of every one."""

    split = "column"

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        ranks = distributed.tp_size()
        self.output_sizes = [_split(size, ranks, "the output size") for size in output_sizes]
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(self.output_sizes), bias, dtype, quant_config)

    def checkpoint_rows(self, shard_id: str | int | None) -> int:
        if shard_id is None:
            return self.output_size * self.tp_size
        assert isinstance(shard_id, int)
        return self.output_sizes[shard_id] * self.tp_size

    def rank_slice(self, shard_id: str | int | None) -> tuple[int, int, int]:
        size = self.checkpoint_rows(shard_id) // self.tp_size
        return 0, self.tp_rank * size, size

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id is None:  # a checkpoint that stores the layer fused (Phi-3)
            return 0, self.output_size
        assert isinstance(shard_id, int)
        start = sum(self.output_sizes[:shard_id])
        return start, start + self.output_sizes[shard_id]


class GateUpSiluLinear(MergedColumnLinear):
    """gate_proj and up_proj as one layer that returns silu(gate) * up [..., intermediate].
    With the own bf16 GEMM the activation is applied as the product is stored: a prompt
    step never writes the product, twice the intermediate size wide, to read it back
    (SiLU-mul alone had taken 40 ms of a 4096-token step of a 135M model)."""

    def __init__(self, input_size: int, intermediate_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None, ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(input_size, [intermediate_size] * 2, bias, dtype, quant_config)
        self.act = SiluAndMul(ops)


class QKVLinear(LinearBase):
    """q_proj, k_proj and v_proj as one layer; shard ids are "q", "k", "v"; None: all three
    at once. Column-parallel: each rank computes ``num_heads`` query heads (its share) and
    ``num_kv_heads`` key/value heads: its share, or, with fewer KV heads than ranks, the
    one its query heads read (each KV head then on tp / kv ranks)."""

    split = "column"
    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        ranks, rank = distributed.tp_size(), distributed.tp_rank()
        self.head_dim = head_dim
        self.num_heads = _split(num_heads, ranks, "the number of attention heads")
        if num_kv_heads >= ranks:
            self.num_kv_heads = _split(num_kv_heads, ranks, "the number of KV heads")
            self.first_kv_head = rank * self.num_kv_heads
        elif ranks % num_kv_heads == 0:
            self.num_kv_heads, self.first_kv_head = 1, rank * num_kv_heads // ranks
        else:
            raise ValueError(f"the number of KV heads ({num_kv_heads}) neither splits over nor "
                             f"divides {ranks} tensor-parallel ranks")
        self.total_kv_heads = num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype, quant_config)

    def checkpoint_rows(self, shard_id: str | int | None) -> int:
        q, kv = self.q_size * self.tp_size, self.total_kv_heads * self.head_dim
        return {"q": q, "k": kv, "v": kv, None: q + 2 * kv}[shard_id]

    def rank_slice(self, shard_id: str | int | None) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.tp_rank * self.q_size, self.q_size
        return 0, self.first_kv_head * self.head_dim, self.kv_size

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id is None:  # a checkpoint that stores the layer fused (Phi-3)
            return 0, self.output_size
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[str(shard_id)]
        return start, start + (self.q_size if shard_id == "q" else self.kv_size)
