"""Linear layers behind one small interface.

Every linear layer owns its parameters and a ``weight_loader(param, loaded, shard_id)``
that copies a checkpoint tensor into the right slice. Merged layers (QKV, gate-up) take
several checkpoint tensors as shards of one weight, so the forward pass runs one GEMM
instead of three or two. Quantized and tensor-parallel variants implement the same
interface: ``forward(x)`` and ``weight_loader``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the few-row kernel beats oneDNN's GEMM (measured at 1, 4 and 8).
_SKINNY_ROWS = 4


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with W of shape [output_size, input_size]."""

    packed: torch.Tensor | None = None  # oneDNN layout, set after loading (bf16/fp16)
    skinny: Callable[..., None] | None = None  # the few-row bf16 kernel, set after loading

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        """Rows of the output that the checkpoint tensor ``shard_id`` fills."""
        assert shard_id is None, f"{type(self).__name__} has no shards"
        return 0, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        start, end = self.shard_range(shard_id)
        target = param.data[start:end]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint "
                             f"{tuple(loaded.shape)}, model {tuple(target.shape)}")
        target.copy_(loaded)

    def process_weights_after_loading(self, ops: ModuleType | None) -> None:
        """With the compiled kernels, a bfloat16/float16 weight is also kept in oneDNN's
        blocked layout, as its GEMM wants it, instead of letting every call reorder it (up
        to 1.8x faster at one row, 10-40% at 64-128). A bfloat16 weight stays in the plain
        layout too, for the few-row kernel (decode of up to 4 sequences: 25% less time
        per token at one sequence). float32 keeps the plain ATen GEMM."""
        if ops is None or self.weight.dtype not in (torch.bfloat16, torch.float16):
            return
        self.packed = pack_linear_weight(self.weight.data)
        if self.weight.dtype == torch.bfloat16 and self.input_size % 32 == 0:
            self.skinny = getattr(ops, "skinny_linear_bf16", None)
        if self.packed is not None and self.skinny is None:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype),
                                       requires_grad=False)  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= _SKINNY_ROWS:
            out = x.new_empty(x.shape[0], self.output_size)
            self.skinny(out, x.contiguous(), self.weight, self.bias)
            return out
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] reordered for oneDNN's GEMM, or None where oneDNN is missing."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 128)
    except (RuntimeError, AttributeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class ReplicatedLinear(LinearBase):
    """A plain linear layer, whole on every rank."""


class MergedColumnLinear(LinearBase):
    """Several linear layers with the same input, stacked along the output
    (gate_proj and up_proj -> gate_up_proj). Shard ids are the positions 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        start = sum(self.output_sizes[:shard_id])
        return start, start + self.output_sizes[shard_id]


class QKVLinear(LinearBase):
    """q_proj, k_proj and v_proj as one layer; shard ids are "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[str(shard_id)]
        return start, start + (self.q_size if shard_id == "q" else self.kv_size)
