"""GGUF weights kept quantized: the ``gguf`` quantization config and its linear method
(the embedding table and the LM head keep their blocks too, see layers/embedding.py).

A GGUF file's tensors reach the layers as ``RawBlocks`` (the blocks as stored) or, for the
float types, as plain tensors. A linear layer collects its shards (q, k, v; gate, up),
each of its own type — a Q4_K_M file mixes Q4_K, Q6_K and others even inside one merged
layer — and keeps them as segments of output rows (``KeptLinearMethod``): consecutive
shards of one ``BlockFormat`` become one ``QuantizedWeight``, float shards a dense weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from cpullm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from cpullm.model_executor.layers.quantization.gguf_blocks import block_bytes, split_blocks
from cpullm.model_executor.layers.quantization.kept import (
    KeptLinearMethod,
    QuantizedWeight,
    Shard,
)

if TYPE_CHECKING:
    from cpullm.model_executor.layers.linear import LinearBase


@dataclass
class RawBlocks:
    """One GGUF tensor as stored: ``raw`` [rows, bytes per row] of ``qtype`` blocks, for a
    weight of ``shape`` (torch order, [rows, k])."""

    qtype: GGMLQuantizationType
    raw: np.ndarray
    shape: tuple[int, ...]
    # ``to_weight``'s result, where it was computed ahead (``prepare``)
    prepared: QuantizedWeight | None = field(default=None, repr=False, compare=False)

    def narrow(self, dim: int, start: int, length: int) -> RawBlocks:
        """Rows [start, start + length) (dim 0), or columns (dim 1: whole blocks only)."""
        rows, k = self.shape
        if start == 0 and length == self.shape[dim]:
            return self
        if dim == 0:
            return RawBlocks(self.qtype, self.raw[start:start + length], (length, k))
        weights, nbytes = block_bytes(self.qtype)
        if start % weights or length % weights:
            raise ValueError(f"columns {start}..{start + length} of a {self.qtype.name} tensor "
                             f"do not fall on its blocks of {weights}")
        raw = np.ascontiguousarray(
            self.raw[:, start // weights * nbytes:(start + length) // weights * nbytes])
        return RawBlocks(self.qtype, raw, (rows, length))

    def to_weight(self) -> QuantizedWeight:
        """The blocks taken apart into the kernels' layout."""
        if self.prepared is not None:
            return self.prepared
        return QuantizedWeight.from_split(split_blocks(self.qtype, self.raw, self.shape[-1]),
                                          self.qtype.name)

    def prepare(self) -> None:
        """Take the blocks apart now (on a loader's thread), for ``to_weight`` to return."""
        self.prepared = self.to_weight()


class GGUFConfig(QuantizationConfig):
    """GGUF files: every linear layer, the embedding table and the LM head keep the file's
    blocks (see ``GGUFLinearMethod``)."""

    name = "gguf"

    def linear_method(self, layer: LinearBase) -> LinearMethod:
        return GGUFLinearMethod()


class GGUFLinearMethod(KeptLinearMethod):
    """A linear layer whose shards come from a GGUF file, each kept in its own type."""

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        # Filled shard by shard by ``load``; no parameter holds the weight until then.
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: self.load(  # type: ignore[attr-defined]
            layer, loaded, shard_id)
        super().create_weights(layer, bias, dtype)

    def load(self, layer: LinearBase, loaded: RawBlocks | torch.Tensor,
             shard_id: str | int | None) -> None:
        for shard, part in layer.rank_parts(loaded, shard_id):
            start, end = self.check_shape(layer, shard, tuple(part.shape))
            if isinstance(part, RawBlocks):
                layer.shards[start] = Shard(end, part.to_weight())
            else:
                layer.shards[start] = Shard(end, part.to(layer.compute_dtype).contiguous())
