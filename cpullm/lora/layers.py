"""LoRA on the linear-layer seam: a method that wraps a layer's own (dense, GGUF kept
quantized, AWQ/GPTQ, ...) and adds the adapters' products beside the kept weights.

Each wrapped layer holds ``max_loras`` slots of stacked weights, ``max_lora_rank`` wide
each (a smaller rank is zero-padded), the scaling folded into B. A step that runs rows of
adapters sets one mask for its tokens ([tokens, slots x rank]: ones in the block of the
token's slot, zeros for the base model's tokens), so every layer adds, whatever the mix of
adapters in the step, in three products:

    shrink = x @ A_all                  [tokens, shards x slots x rank]
    shrink *= mask                      (each token keeps its own adapter's columns)
    y[:, shard] += shrink[shard] @ B    per output shard (q/k/v, gate/up) of the layer

vLLM's punica ops group the rows by adapter; on a CPU one GEMM over every slot's columns
costs less than a gather and a GEMM per adapter at the ranks adapters use (the slots'
columns are ~6% of a 2048-wide layer's at 8 x 16). A step without adapters skips all of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm
from cpullm.model_executor.layers.platform_gemm import create_gemm
from cpullm.model_executor.layers.quantization.base import LinearMethod

if TYPE_CHECKING:
    from cpullm.model_executor.layers.linear import LinearBase

_step = threading.local()  # this thread's step (compute lanes run steps side by side)


def set_step_mask(mask: torch.Tensor | None) -> None:
    """The mask of the step this thread is about to run, or None (no adapter in it)."""
    _step.mask = mask


def step_mask() -> torch.Tensor | None:
    return getattr(_step, "mask", None)


class LoRALinearMethod(LinearMethod):
    """``inner``'s product plus the step's adapters' (see the module's docstring). The
    layer's fused activation (gate/up's SiLU-mul) moves here, after the adapters' sum."""

    def __init__(self, inner: LinearMethod, slots: int, rank: int) -> None:
        self.inner = inner
        self.slots, self.rank = slots, rank
        self.act: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.a = torch.empty(0)  # [input_size, shards x slots x rank]
        self.b: list[torch.Tensor] = []  # per shard [slots x rank, shard's outputs]
        self.ranges: list[tuple[int, int]] = []  # per shard: its output columns
        self.width = 1  # columns of A per shard: slots x rank
        # A and each B packed for the bfloat16 GEMMs, after every slot load (ATen's bf16
        # matmul took 0.5-0.7 ms for a [16, 2048] x [2048, 384] product, 40% of a 1B
        # model's decode step at 8 adapters); None: ATen's (float32)
        self.ops: KernelTable | None = None
        self.shrink: PackedGemm | None = None
        self.expand: list[PackedGemm | None] = []

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        self.inner.create_weights(layer, bias, dtype)

    def process_weights_after_loading(self, layer: LinearBase, ops: KernelTable | None) -> None:
        self.act, layer.act = layer.act, None  # the product comes back whole, then SiLU-mul
        self.inner.process_weights_after_loading(layer, ops)
        dtype = layer.lora_dtype  # type: ignore[attr-defined]
        self.ranges = [layer.shard_range(shard) for shard in layer.shard_ids]
        self.width = self.slots * self.rank
        self.a = torch.zeros(layer.input_size, len(self.ranges) * self.width, dtype=dtype)
        self.b = [torch.zeros(self.width, end - start, dtype=dtype)
                  for start, end in self.ranges]
        self.ops = ops
        self.pack()

    def pack(self) -> None:
        """Pack A and B for the GEMMs (after the slots change). A step in flight keeps the
        packed weights it started with: the slots it uses do not change under it."""
        self.shrink = create_gemm(self.a.t().contiguous(), None, self.ops)
        self.expand = [create_gemm(b.t().contiguous(), None, self.ops) for b in self.b]

    def load_slot(self, slot: int, shard: int,
                  weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot ``slot`` of output shard ``shard``: A [rank, input_size] and B [outputs,
        rank], scaled, or zeros (the adapter leaves the shard alone)."""
        column = shard * self.width + slot * self.rank
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        self.a[:, column:column + self.rank].zero_()
        self.b[shard][rows].zero_()
        if weights is not None:
            a, b = weights
            rank = a.shape[0]
            self.a[:, column:column + rank].copy_(a.t())
            self.b[shard][rows][:rank].copy_(b.t())

    def add_adapters(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's product of x) plus the step's adapters' products, then the
        fused activation."""
        mask = step_mask()
        if mask is not None:
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] != mask.shape[0]:
                raise RuntimeError(f"LoRA: a product of {rows.shape[0]} rows in a step of "
                                   f"{mask.shape[0]} tokens")
            flat = out.view(-1, out.shape[-1])
            shrink_gemm, expand = self.shrink, self.expand
            shrink = shrink_gemm(rows) if shrink_gemm is not None else rows @ self.a
            shrink.view(len(rows), len(self.ranges), self.width).mul_(mask.unsqueeze(1))
            for i, (start, end) in enumerate(self.ranges):
                part = shrink[:, i * self.width:(i + 1) * self.width]
                target = flat if len(self.ranges) == 1 else flat[:, start:end]
                if expand[i] is not None:
                    target += expand[i](part)  # (the GEMM reads a column slice in place)
                else:
                    target.addmm_(part, self.b[i])
        return self.act(out) if self.act is not None else out

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self.add_adapters(x, self.inner.apply(layer, x))

    def step_fn(self, layer: LinearBase, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        made = self.inner.step_fn(layer, dtype)
        if made is None:
            return None
        product, rows = made
        add = self.add_adapters
        return (lambda x: add(x, product(x))), rows

    def describe(self, layer: LinearBase) -> str:
        return f"{self.inner.describe(layer)}, LoRA ({self.slots} slots of rank {self.rank})"
