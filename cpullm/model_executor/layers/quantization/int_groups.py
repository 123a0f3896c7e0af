"""Integer weights with a scale (and a zero point) per group of input columns — what AWQ,
GPTQ and compressed-tensors store, each in its own packing — and the linear method that
loads them into the kernels' layout.

Each format's ``CheckpointScheme`` names the tensors of a quantized layer and unpacks one
shard's tensors into ``IntGroups``:

    w[r, c] = scales[r, g] * (q[r, c] - zeros[r, g]),   g = the group of column c

with q unsigned (0 .. 2^bits - 1). ``IntGroups.to_weight`` keeps it for the kernels as a
``QuantizedWeight``: u = q, a block per group (groups larger than the kernels' largest
block of 128, and per-channel scales, repeat their scale per block), float16 scales where
they fit, and a zero point where every group has the same one (symmetric checkpoints), or
a min per block, m = -s z, otherwise. Act order (GPTQ's ``desc_act``, compressed-tensors'
``actorder``) sorts the columns by group and gathers x to match. Where the kernels do not
run, a shard is dequantized once, exactly, in float32 (``IntGroups.dequantize``).

Which layers are quantized is read from the checkpoint itself: a shard whose tensors are
the scheme's is kept quantized, one with a float ``weight`` dense (``ignore`` lists,
``modules_to_not_convert``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from cpullm.model_executor.layers.quantization.gguf_blocks import BlockFormat, pack
from cpullm.model_executor.layers.quantization.kept import (
    KeptLinearMethod,
    QuantizedWeight,
    Shard,
)

if TYPE_CHECKING:
    from cpullm.model_executor.layers.linear import LinearBase
    from cpullm.model_executor.layers.quantization.fp8 import Float8Groups

KERNEL_BLOCKS = (128, 64, 32, 16)  # the block sizes the kernels run, largest first
_FLOAT16_TINY = 2.0 ** -14  # float16's smallest normal number


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values of ``bits`` (4 or 8) bits packed 32 / bits to an int32 along ``dim`` (value j
    of a word in bits [j bits, (j + 1) bits)), as uint8 [.., words * 32 / bits, ..]. The
    words are read as their four little-endian bytes (value j of a 4-bit word: the low or
    high half of byte j / 2), never widened."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit values are not supported (4 or 8 bits)")
    rows, cols = packed.shape
    words = packed.contiguous().view(torch.uint8).view(rows, cols, 4)
    values = words if bits == 8 else torch.stack((words & 0x0F, words >> 4), dim=-1)
    per_word = 32 // bits
    if dim == 0:  # [rows, cols, per_word] -> [rows * per_word, cols]
        return values.reshape(rows, cols, per_word).permute(0, 2, 1).reshape(rows * per_word,
                                                                             cols)
    return values.reshape(rows, cols * per_word)


@dataclass
class IntGroups:
    """A weight [n, k] as unsigned integers ``q`` with ``scales`` [n, groups] and ``zeros``
    [n, groups] (None: 2^(bits - 1) everywhere), ``group_size`` consecutive columns a group
    (after ``perm``, if any: column j of ``q`` is column perm[j] of the weight)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    perm: torch.Tensor | None = None
    # the checkpoint quantizes the activations to int8 per token itself (W8A8): so may the
    # kernels (QuantizedWeight.per_token)
    per_token: bool = False

    @classmethod
    def with_group_index(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         bits: int, group_size: int, g_idx: torch.Tensor | None) -> IntGroups:
        """From a checkpoint whose column c is in group g_idx[c] (act order): the columns
        sorted by group, if they are not in order already."""
        k = q.shape[1]
        if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group_size):
            return cls(q, scales, zeros, bits, group_size)
        g_idx = g_idx.long()
        counts = torch.bincount(g_idx, minlength=scales.shape[1])
        if counts.numel() != scales.shape[1] or not bool((counts == group_size).all()):
            raise ValueError(f"act order: every group must have {group_size} columns; the "
                             f"group index gives {sorted(set(counts.tolist()))}")
        perm = torch.argsort(g_idx, stable=True)
        return cls(q[:, perm].contiguous(), scales, zeros, bits, group_size, perm)

    @classmethod
    def int8_rows(cls, w: torch.Tensor, slice_rows: int = 4096) -> IntGroups:
        """A float weight [n, k] as 8-bit values with one scale per row: s = max |w| / 127,
        q = round(w / s), stored as q + 128; quantized ``slice_rows`` rows at a time (each
        slice in float32)."""
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.uint8)
        scales = torch.empty(n, 1)
        for start in range(0, n, slice_rows):
            rows = w[start:start + slice_rows].float()
            s = rows.abs().amax(dim=1, keepdim=True) / 127
            scales[start:start + len(rows)] = s
            # a row of zeros: any divisor gives q = 0
            q[start:start + len(rows)] = (torch.round(rows / s.clamp(min=1e-30)) + 128
                                          ).to(torch.uint8)
        return cls(q, scales, None, 8, k)

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit weights are not supported (4 or 8 bits)")
        if k % self.group_size or self.scales.shape != (n, k // self.group_size):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not fit a [{n}, {k}] weight "
                             f"in groups of {self.group_size}")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zero points {tuple(self.zeros.shape)} do not match scales "
                             f"{tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def narrow(self, dim: int, start: int, length: int) -> IntGroups:
        """Rows [start, start + length) (dim 0), or columns (dim 1: whole groups only)."""
        if dim == 0:
            end = start + length
            return IntGroups(self.q[start:end], self.scales[start:end],
                             None if self.zeros is None else self.zeros[start:end], self.bits,
                             self.group_size, self.perm, self.per_token)
        if self.perm is not None:
            raise ValueError("act order (desc_act) weights split by input columns are not "
                             "supported")
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"columns {start}..{start + length} do not fall on the groups of "
                             f"{self.group_size}")
        groups = slice(start // self.group_size, (start + length) // self.group_size)
        return IntGroups(self.q[:, start:start + length].contiguous(),
                         self.scales[:, groups].contiguous(),
                         None if self.zeros is None else self.zeros[:, groups].contiguous(),
                         self.bits, self.group_size, per_token=self.per_token)

    def zero_points(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros.to(torch.int32)
        return torch.full(self.scales.shape, 1 << (self.bits - 1), dtype=torch.int32)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32, in the checkpoint's column order: s (q - z)."""
        n, k = self.q.shape
        q = self.q.to(torch.int32).view(n, -1, self.group_size)  # [n, groups, group_size]
        w = (q - self.zero_points()[..., None]).float() * self.scales.float()[..., None]
        w = w.view(n, k)
        if self.perm is None:
            return w
        restored = torch.empty_like(w)
        restored[:, self.perm] = w
        return restored

    @staticmethod
    def kernels_run(ops: KernelTable | None, dtype: torch.dtype) -> bool:
        return QuantizedWeight.kernels_run(ops, dtype)

    def block(self) -> int | None:
        """The kernels' block for these groups: the largest that divides the group."""
        k = self.q.shape[1]
        return next((b for b in KERNEL_BLOCKS if self.group_size % b == 0 and k % b == 0), None)

    def to_weight(self, qtype: str, origin: str) -> QuantizedWeight | None:
        """The weight in the kernels' layout, or None where no block fits (a row length
        that is not a multiple of 16)."""
        block = self.block()
        if block is None:
            return None
        repeat = self.group_size // block
        scales = self.scales.float().repeat_interleave(repeat, dim=1)  # [n, k / block]
        zeros = self.zero_points()
        constant = int(zeros.flatten()[0]) if bool((zeros == zeros.flatten()[0]).all()) else None
        mins = None
        if constant is None:
            mins = (-scales * zeros.float().repeat_interleave(repeat, dim=1))
        fits = all(bool((t.abs()[t != 0] >= _FLOAT16_TINY).all()) and
                   float(t.abs().max()) < 65504 for t in (scales, mins) if t is not None)
        dtype = torch.float16 if fits else torch.float32
        fmt = BlockFormat(self.bits, block, str(dtype).removeprefix("torch."), constant)
        data = torch.from_numpy(pack(self.q.to(torch.uint8).numpy(), self.bits, block))
        return QuantizedWeight(fmt, data, scales.to(dtype).contiguous(),
                               None if mins is None else mins.to(dtype).contiguous(),
                               self.q.shape[1], qtype, origin, self.per_token)


class CheckpointScheme(ABC):
    """How one format stores a quantized linear layer: its tensors' names and how one
    shard's tensors unpack."""

    origin: str  # the format's name, for the logs
    # name -> whether it holds integers (packed words, zero points, group index)
    tensors: dict[str, bool]

    @abstractmethod
    def is_quantized(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether a shard's tensors are a quantized weight (else a dense ``weight``)."""

    @abstractmethod
    def unpack(self, tensors: dict[str, torch.Tensor], rows: int, k: int
               ) -> IntGroups | Float8Groups:
        """A quantized shard [rows, k] as integer groups (or FP8 bytes with their scales)."""

    def qtype(self, groups: IntGroups | Float8Groups) -> str:
        if not isinstance(groups, IntGroups):
            return groups.qtype()
        size = "channel" if groups.group_size == groups.q.shape[1] else f"g{groups.group_size}"
        return f"int{groups.bits} {size}"


class GroupQuantConfig(QuantizationConfig):
    """A checkpoint of one ``CheckpointScheme``: every linear layer gets its method."""

    scheme: CheckpointScheme
    lm_head_scheme: CheckpointScheme | None = None  # where the LM head is quantized too

    def linear_method(self, layer: LinearBase) -> LinearMethod:
        return GroupedLinearMethod(self.scheme)


class GroupedLinearMethod(KeptLinearMethod):
    """A linear layer from an AWQ, GPTQ or compressed-tensors checkpoint: each shard's
    tensors collected as they load, then unpacked and kept (see the module docstring)."""

    def __init__(self, scheme: CheckpointScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        layer.pending = {}  # shard id -> checkpoint tensor name -> tensor
        names = {"weight": False, **self.scheme.tensors}
        for name, integer in names.items():
            param = nn.Parameter(torch.empty(0, dtype=torch.int32 if integer else dtype),
                                 requires_grad=False)
            param.weight_loader = lambda p, loaded, shard_id=None, name=name: (  # type: ignore[attr-defined]
                layer.pending.setdefault(shard_id, {}).__setitem__(name, loaded))
            param.optional = True  # type: ignore[attr-defined] - which ones come is the shard's
            param.takes_integers = True  # type: ignore[attr-defined]
            setattr(layer, name, param)
        super().create_weights(layer, bias, dtype)

    def process_weights_after_loading(self, layer: LinearBase, ops: KernelTable | None) -> None:
        expected = {None} if None in layer.pending else set(layer.shard_ids)
        if set(layer.pending) != expected:
            missing = sorted(map(str, expected - set(layer.pending)))
            raise ValueError(f"the checkpoint lacks the weights of shards {missing}")
        for shard_id, tensors in layer.pending.items():
            if not self.scheme.is_quantized(tensors):
                weight = tensors.get("weight")
                if weight is None or not weight.is_floating_point():
                    raise ValueError(f"shard {shard_id!r} has neither a float weight nor the "
                                     f"tensors of {self.scheme.origin} "
                                     f"(it has {sorted(tensors)})")
                loaded: IntGroups | Float8Groups | torch.Tensor = weight
            else:
                try:  # the whole checkpoint tensor, then this rank's part of it
                    loaded = self.scheme.unpack(tensors, *layer.checkpoint_shape(shard_id))
                except (ValueError, RuntimeError) as e:
                    raise ValueError(f"shard {shard_id!r}: {e}") from None
            for shard, part in layer.rank_parts(loaded, shard_id):
                start, end = self.check_shape(layer, shard, tuple(part.shape))
                if isinstance(part, torch.Tensor):
                    layer.shards[start] = Shard(end, part.to(layer.compute_dtype).contiguous())
                    continue
                weight = part.to_weight(self.scheme.qtype(part), self.scheme.origin) \
                    if part.kernels_run(ops, layer.compute_dtype) else None
                if weight is None:
                    layer.shards[start] = Shard(end, part.dequantize().to(layer.compute_dtype))
                else:
                    layer.shards[start] = Shard(end, weight, part.perm)
        layer.pending = {}
        for name in ("weight", *self.scheme.tensors):
            delattr(layer, name)
        super().process_weights_after_loading(layer, ops)
