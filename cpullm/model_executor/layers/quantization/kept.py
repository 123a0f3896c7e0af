"""Weights kept quantized, whatever checkpoint format they come from: the weight object the
kernels run (``QuantizedWeight``) and the linear method that keeps a layer's shards as
segments of output rows (``KeptLinearMethod``; GGUF, AWQ, GPTQ and compressed-tensors
load into it).

A format's loader turns each checkpoint shard (q, k, v; gate, up) into a
``QuantizedWeight`` in one ``BlockFormat`` (u, a scale per block, a min or a zero point),
or a dense tensor for a shard the checkpoint keeps in floats, and optionally a permutation
of the input columns (GPTQ's act order: the columns sorted by group, x gathered to match).
After loading, consecutive shards of one kind become one segment, and a matmul runs each
segment into its columns of the output, on the weight laid out again for the kernels
(``for_kernels``: 16-row tiles, ``TiledWeight``; AMX-INT8 tiles for per-channel INT8).
Where the quantized kernels do not run (``QuantizedWeight.kept_here``: no kernels, another
compute dtype, K not a multiple of 32) the shards are dequantized once after loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.ops import Kernel, KernelTable
from cpullm.model_executor.layers.packed_gemm import PackedGemm
from cpullm.model_executor.layers.platform_gemm import create_gemm
from cpullm.model_executor.layers.quantization.base import LinearMethod
from cpullm.model_executor.layers.quantization.gguf_blocks import (
    BlockFormat,
    SplitBlocks,
    unpack,
)
from cpullm.platform.cpu import cpu_info

if TYPE_CHECKING:
    from cpullm.model_executor.layers.linear import LinearBase

# Up to this many rows of x, the integer dot products; above, on CPUs whose BF16 dot products
# outrun their VNNI ones, the bfloat16 GEMM on panels dequantized 32 rows at a time (see
# docs/quantization.md); and the most rows of an expert that a grouped call runs.
VNNI_MAX_ROWS = 20
# Where the CPU has AMX tiles, the blocks dequantized 32 rows at a time run on them above
# this many rows (the crossover of the 135M default model's layers, Q4_1, Q8_0 and Q4_K).
AMX_PANELS_MIN_ROWS = 12
# The most rows a decode step's function of a kept layer (step_fn) is made for.
_STEP_ROWS = 512


class QuantizedWeight(nn.Module):
    """A weight [n, k] in one ``BlockFormat``: ``data`` [n, k * bits / 8] (uint8),
    ``scales`` and ``mins`` [n, k / block] (mins absent for a format with a zero point).

    ``per_token``: the checkpoint quantizes the activations to int8 per token itself (W8A8),
    so a kernel may too. For such a weight of 8 bits with a zero point of 128 and one scale
    per row (per-channel INT8), ``row_scales`` holds that scale (float32 [n]), and where the
    CPU has AMX-INT8 the weight is laid out for it after loading (``for_kernels``)."""

    # The kernels (kernel_for's names) that can store silu(gate) * up of a gate-up weight
    # (gate and up stacked) as they store the product.
    silu_mul_kernels: tuple[str, ...] = ()
    # The kernels that take a float32 out (``logits``): the int8 ones then quantize x in two
    # levels, and every one stores its float32 sums unrounded.
    float32_kernels: tuple[str, ...] = ("torch",)

    def __init__(self, fmt: BlockFormat, data: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, k: int, qtype: str, origin: str = "GGUF",
                 per_token: bool = False, supers: torch.Tensor | None = None,
                 min_supers: torch.Tensor | None = None) -> None:
        super().__init__()
        # qtype: the checkpoint's name for the type (Q4_K; int4 g128); origin: its format
        self.fmt, self.k, self.qtype, self.origin = fmt, k, qtype, origin
        self.per_token = per_token
        self.register_buffer("data", data)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        # two-level scales (fmt.super_block): scales and mins int8, these float16 factors
        # [n, k / super_block]
        self.register_buffer("supers", supers)
        self.register_buffer("min_supers", min_supers)
        per_row = per_token and fmt.bits == 8 and fmt.zero == 128 and k % 64 == 0 \
            and scales.dim() == 2 \
            and scales.shape[0] % 16 == 0 and bool((scales == scales[:, :1]).all())
        self.register_buffer("row_scales", scales[:, 0].float().contiguous() if per_row else None)

    @classmethod
    def from_split(cls, split: SplitBlocks, qtype: str, origin: str = "GGUF"
                   ) -> QuantizedWeight:
        def tensor(values: np.ndarray | None) -> torch.Tensor | None:
            return None if values is None else torch.from_numpy(values)

        return cls(split.fmt, torch.from_numpy(np.ascontiguousarray(split.packed())),
                   torch.from_numpy(split.scales), tensor(split.mins), split.u.shape[1], qtype,
                   origin, supers=tensor(split.supers), min_supers=tensor(split.min_supers))

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format (and class), stacked."""
        first = parts[0]
        assert all(p.fmt == first.fmt and p.k == first.k for p in parts)
        if len(parts) == 1:
            return first

        def cat(name: str) -> torch.Tensor | None:
            return None if getattr(first, name) is None else \
                torch.cat([getattr(p, name) for p in parts])

        return type(first)(first.fmt, cat("data"), cat("scales"), cat("mins"), first.k,
                           "+".join(dict.fromkeys(p.qtype for p in parts)), first.origin,
                           all(p.per_token for p in parts), cat("supers"), cat("min_supers"))

    @property
    def n(self) -> int:
        return self.data.shape[0]

    def dequantize(self, dtype: torch.dtype, index: torch.Tensor | slice | None = None
                   ) -> torch.Tensor:
        """The weight (or its rows ``index``) in ``dtype``: [rows, k]."""
        def rows_of(values: torch.Tensor | None) -> torch.Tensor | None:
            return values if values is None or index is None else values[index]

        data = rows_of(self.data)
        scales = self._two_levels(rows_of(self.scales), rows_of(self.supers))
        mins = rows_of(self.mins)
        mins = None if mins is None else self._two_levels(mins, rows_of(self.min_supers))
        rows, k, block = data.shape[0], self.k, self.fmt.block
        u = torch.from_numpy(unpack(data.numpy(), self.fmt.bits, block, k))
        return self._weights(u.view(rows, k // block, block), scales, mins).view(rows, k).to(dtype)

    def _two_levels(self, values: torch.Tensor, supers: torch.Tensor | None) -> torch.Tensor:
        """Per-block values (scales or mins) as the dequantizer multiplies by them: where
        they are two-level, gguf's float32 product of the super-block's d and the block's."""
        if supers is None:
            return values
        return supers.float().repeat_interleave(self.fmt.per_super, dim=-1) * values.float()

    def _weights(self, u: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
                 ) -> torch.Tensor:
        """u [rows, blocks, block] with their blocks' scales and mins (or the zero point) as
        float32 weights."""
        s = scales.float()[..., None]
        if self.fmt.zero is not None:
            return (u.float() - float(self.fmt.zero)) * s
        assert mins is not None
        return s * u.float() + mins.float()[..., None]

    def for_kernels(self, ops: KernelTable | None) -> QuantizedWeight:
        """The weight in the layout the fastest kernel here takes: where the CPU has AMX,
        per-channel INT8 as AMX-INT8 tiles; wherever the AVX-512 VNNI and BF16 kernels run,
        the other blocks in 16-row tiles (``TiledWeight``); elsewhere as it is."""
        if ops is None:
            return self
        if self.row_scales is not None and ops.quant_gemm_int8_amx is not None:
            return AmxInt8Weight.of(self)
        if TiledWeight.runs(self, ops):
            return TiledWeight.of(self)
        return self

    @staticmethod
    def kernels_run(ops: KernelTable | None, dtype: torch.dtype) -> bool:
        """Whether cpullm's quantized kernels run here: AVX-512 VNNI or AVX2, bfloat16
        compute."""
        return ops is not None and ops.quant_gemm_tiled_int8 is not None \
            and dtype == torch.bfloat16

    def kept_here(self, ops: KernelTable | None, dtype: torch.dtype) -> bool:
        """Whether this weight stays quantized here: the kernels run, and its layout for them
        takes its shape (16-row tiles: K a multiple of 32)."""
        return self.kernels_run(ops, dtype) and self.k % 32 == 0

    def kernel_for(self, rows: int, ops: KernelTable | None, dtype: torch.dtype) -> str:
        """What multiplies ``rows`` rows of x: "torch" (ATen on weights dequantized a slice
        at a time). The kernels take the weight as ``for_kernels`` lays it out."""
        return "torch"

    def fuses_silu_mul(self, kernel: str, ops: KernelTable | None) -> bool:
        """Whether ``kernel`` (kernel_for's name) of ``ops`` can return silu(gate) * up of
        this weight (gate and up stacked, 16-row multiples each) in place of the product."""
        return self.n % 32 == 0 and kernel in self.silu_mul_kernels

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                    ops: KernelTable | None, kernel: str | None = None,
                    silu_mul: bool = False) -> None:
        """out [rows, n] = x [rows, k] @ W.T (+ bias); ``kernel`` forces one (tests).
        ``silu_mul`` (where ``fuses_silu_mul``): out [rows, n / 2] = silu(gate) * up."""
        kernel = kernel or self.kernel_for(x.shape[0], ops, x.dtype)
        assert kernel == "torch" and not silu_mul, kernel
        # Dequantize a slice of rows at a time: never the whole weight in floats at once.
        # (A float32 out, logits: in float32.)
        dtype = torch.float32 if out.dtype == torch.float32 else x.dtype
        x = x.to(dtype)
        step = max(32, (1 << 22) // self.k)
        for start in range(0, self.n, step):
            end = min(self.n, start + step)
            w = self.dequantize(dtype, slice(start, end))
            b = None if bias is None else bias[start:end].to(dtype)
            out[:, start:end] = F.linear(x, w, b)

    def grouped_kernel(self, ops: KernelTable) -> Kernel | None:
        """The kernel that runs several weights of this class, layout and shape in one call
        (``matmul_grouped``), or None where none does."""
        return None

    @staticmethod
    def matmul_grouped(out: torch.Tensor, x: torch.Tensor, weights: list[QuantizedWeight],
                       biases: list[torch.Tensor] | None, offsets: list[int],
                       ops: KernelTable) -> None:
        """out[offsets[i]:offsets[i + 1]] = x[offsets[i]:offsets[i + 1]] @ weights[i].T (+
        biases[i]), every weight of one class, layout and shape, in one call of their
        ``grouped_kernel`` (the int8 dot products: each run of rows at most
        VNNI_MAX_ROWS)."""
        fmt, run = weights[0].fmt, weights[0].grouped_kernel(ops)
        assert run is not None
        run(out, x, [w.data for w in weights], [w.scales for w in weights],
            [w.mins for w in weights] if fmt.zero is None else [], biases or [], offsets,
            fmt.bits, fmt.block, fmt.zero or 0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, ops: KernelTable | None
               ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty(rows.shape[0], self.n)
        self.matmul_into(out, rows, bias, ops)
        return out.view(*x.shape[:-1], self.n)

    def logits(self, x: torch.Tensor, ops: KernelTable | None) -> torch.Tensor:
        """x [rows, k] @ W.T as float32 (an LM head's logits). Rounded to bfloat16, logits
        near 20 are 0.06 apart, which ties tokens whose float32 margin is that small; and
        x's int8 blocks alone move them by ~0.01. So the int8 kernels quantize x in two
        levels (its remainder in a second int8 row, as a second token: the weight is read
        once for both) and the others store their sums unrounded; a kernel without a float32
        store (``float32_kernels``) has its product widened."""
        out = x.new_empty(x.shape[0], self.n, dtype=torch.float32)
        kernel = self.kernel_for(x.shape[0], ops, x.dtype)
        if kernel in self.float32_kernels:
            self.matmul_into(out, x, None, ops, kernel)
        else:
            out.copy_(self.matmul(x, None, ops))
        return out

    def describe(self, ops: KernelTable | None = None, dtype: torch.dtype | None = None
                 ) -> str:
        """The type, its layout, and (given the kernels and the compute dtype) what runs it."""
        name = f"{self.origin} {self.qtype} kept as {self.fmt.name}"
        if dtype is None:
            return name
        return f"{name}: dequantized a slice at a time, ATen linear"


class AmxInt8Weight(QuantizedWeight):
    """Per-channel INT8 (``QuantizedWeight.row_scales``) laid out as AMX-INT8 tiles:
    ``data`` [n / 16, k / 64, 16, 64], tile row i holding k = 64 j + 4 i .. + 3 of 16 rows of
    W (u = q + 128, as stored), which the kernel reads as they lie, x quantized per token
    (csrc/quant/int8_amx.cpp). Every number of rows runs on them."""

    def grouped_kernel(self, ops: KernelTable) -> Kernel | None:
        return None
    silu_mul_kernels = ("amx_int8",)
    float32_kernels = ("torch",)

    @classmethod
    def of(cls, weight: QuantizedWeight) -> AmxInt8Weight:
        n, k = weight.n, weight.k
        u = torch.from_numpy(unpack(weight.data.numpy(), 8, weight.fmt.block, k))  # [n, k]
        tiles = u.view(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4)
        return cls(weight.fmt, tiles.reshape(n // 16, k // 64, 16, 64).contiguous(),
                   weight.scales, None, k, weight.qtype, weight.origin, per_token=True)

    @property
    def n(self) -> int:
        return self.data.shape[0] * 16

    def dequantize(self, dtype: torch.dtype, index: torch.Tensor | slice | None = None
                   ) -> torch.Tensor:
        u = self.data.view(-1, self.k // 64, 16, 16, 4).permute(0, 3, 1, 2, 4)
        u = u.reshape(self.n, self.k)
        scales = self.row_scales
        if index is not None:
            u, scales = u[index], scales[index]
        return ((u.float() - 128.0) * scales[:, None]).to(dtype)

    def kernel_for(self, rows: int, ops: KernelTable | None, dtype: torch.dtype) -> str:
        """"amx_int8" where the kernels run (they do wherever this layout is made), else
        "torch"."""
        return "amx_int8" if self.kernels_run(ops, dtype) else "torch"

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                    ops: KernelTable | None, kernel: str | None = None,
                    silu_mul: bool = False) -> None:
        kernel = kernel or self.kernel_for(x.shape[0], ops, x.dtype)
        if kernel == "torch":
            super().matmul_into(out, x, bias, ops, kernel, silu_mul)
            return
        assert ops is not None and kernel == "amx_int8"
        ops.quant_gemm_int8_amx(out, x if x.stride(-1) == 1 else x.contiguous(), self.data,
                                self.row_scales, bias, silu_mul)

    def describe(self, ops: KernelTable | None = None, dtype: torch.dtype | None = None
                 ) -> str:
        name = f"{self.origin} {self.qtype} kept as AMX-INT8 tiles"
        if dtype is None or self.kernel_for(1, ops, dtype) == "torch":
            return name
        return f"{name}: cpullm AMX-INT8 tiles, x quantized to int8 per token"


class TiledWeight(QuantizedWeight):
    """A ``QuantizedWeight``'s blocks with 16 rows of W side by side, one per 32-bit lane:
    ``data`` [n / 16, k * 2 * bits], per 16 rows and 32 k steps of 64 bytes whose lane r
    holds 4 consecutive k of row r (8 bits: 8 steps, step q the k 4q .. 4q + 3; 4 bits: 4
    steps, step q those k in its low halves and 16 + 4q .. 16 + 4q + 3 in its high ones);
    ``scales`` and ``mins`` [n / 16, blocks, 16]. Dequantized, a step is rows of an AMX
    tile's B operand as they lie (and half of a row of the AVX-512 GEMM's panels), so the
    AMX GEMM needs no transposes of W or of its products; VNNI's dot products read the
    steps as they lie (csrc/quant/tiled*: quant_gemm_tiled_*). Made wherever the dot
    products run (AVX-512 VNNI; the panels' kernels need BF16 too)."""

    silu_mul_kernels = ("tiled_int8", "tiled_bf16", "tiled_amx")
    float32_kernels = ("tiled_int8", "tiled_bf16", "tiled_amx", "torch")
    # Rows of zeros past the weight's n, to a multiple of the 32 rows of a panel (an LM
    # head's odd vocabulary): the kernels write them into a scratch product.
    pad = 0
    # (the layer's bias, it with pad zeros): padded once, not in every call
    _padded_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def runs(weight: QuantizedWeight, ops: KernelTable) -> bool:
        """Whether ``weight`` (integer blocks as loaded, not FP8 nor another layout) can be
        tiled and run here: the kernels built, K a multiple of the tile depth (32)."""
        return type(weight) is QuantizedWeight and ops.quant_gemm_tiled_int8 is not None \
            and weight.k % 32 == 0

    @classmethod
    def of(cls, weight: QuantizedWeight) -> TiledWeight:
        k, fmt, pad = weight.k, weight.fmt, -weight.n % 32
        u = torch.from_numpy(unpack(weight.data.numpy(), fmt.bits, fmt.block, k))  # [n, k]
        fields = [weight.scales, weight.mins, weight.supers, weight.min_supers]
        if pad:  # zero rows: w = 0 s + 0 = 0
            u, *fields = (None if v is None else torch.cat([v, v.new_zeros(pad, v.shape[1])])
                          for v in [u, *fields])
        scales, mins, supers, min_supers = fields
        tiled = cls(fmt, cls._steps(u, fmt.bits), cls._grouped(scales, supers, fmt.per_super),
                    None if mins is None else cls._grouped(mins, min_supers, fmt.per_super),
                    k, weight.qtype, weight.origin, weight.per_token)
        tiled.pad = pad
        return tiled

    @staticmethod
    def _steps(u: torch.Tensor, bits: int) -> torch.Tensor:
        """u [n, k] as the tiles' steps [n / 16, k * 2 * bits]. Under 8 bits, a chunk's four
        steps hold the low 4 bits of u (k = 32 c + 16 h + 4 q + j: step q, h = 0 in the low
        halves, 1 in the high ones), then 5 or 6 bits its bits - 4 steps of the high ones:
        those of k with 4 h + q = i at bits e i % 8 of step 4 + e i // 8 (e = bits - 4)."""
        n, k = u.shape
        if bits == 8:
            return u.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, -1)
        parts = u.view(n // 16, 16, k // 32, 2, 4, 4)
        low = parts & 0x0F
        steps = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
        if bits > 4:
            e = bits - 4
            high = (parts >> 4).reshape(n // 16, 16, k // 32, e, 8 // e, 4)
            shifts = torch.arange(0, 8, e, dtype=torch.uint8).view(1, 1, 1, 1, -1, 1)
            planes = (high << shifts).sum(dim=4, dtype=torch.uint8)  # (disjoint bits: an or)
            steps = torch.cat([steps, planes.permute(0, 2, 3, 1, 4)], dim=2)
        return steps.reshape(n // 16, -1).contiguous()

    @staticmethod
    def _grouped(values: torch.Tensor, supers: torch.Tensor | None, per_super: int
                 ) -> torch.Tensor:
        """Per-block values [n, blocks] -> [n / 16, blocks, 16]; two-level ones (``supers``
        [n, k / super_block]) as records [n / 16, super-blocks, 32 + 16 per_super] (int8):
        the super-block's 16 float16 factors, then its blocks' int8 values [per_super][16]."""
        lanes = values.view(-1, 16, values.shape[1]).transpose(1, 2).contiguous()
        if supers is None:
            return lanes
        tiles, count = lanes.shape[0], supers.shape[1]
        factors = supers.view(-1, 16, count).transpose(1, 2).contiguous().view(torch.int8)
        return torch.cat([factors, lanes.view(tiles, count, 16 * per_super)], dim=2).contiguous()

    def _lane_values(self, values: torch.Tensor, tile: torch.Tensor, lane: torch.Tensor
                     ) -> torch.Tensor:
        """``_grouped``'s values of rows 16 tile + lane as [rows, blocks] of products."""
        if not self.fmt.super_block:
            return values[tile, :, lane]
        records, per = values[tile], self.fmt.per_super  # [rows, super-blocks, bytes]
        rows, count = records.shape[:2]
        factors = records[:, :, :32].contiguous().view(torch.float16)
        factors = factors.gather(2, lane.view(-1, 1, 1).expand(rows, count, 1)).squeeze(2)
        sub = records[:, :, 32:].reshape(rows, count, per, 16)
        sub = sub.gather(3, lane.view(-1, 1, 1, 1).expand(rows, count, per, 1))
        return self._two_levels(sub.reshape(rows, count * per), factors)

    @property
    def n(self) -> int:
        return self.data.shape[0] * 16 - self.pad

    def dequantize(self, dtype: torch.dtype, index: torch.Tensor | slice | None = None
                   ) -> torch.Tensor:
        k, bits, block = self.k, self.fmt.bits, self.fmt.block
        if isinstance(index, torch.Tensor):  # token ids: no table of every row to index
            rows = index.long()
        else:
            rows = torch.arange(self.n) if index is None else torch.arange(self.n)[index]
        shape, rows = rows.shape, rows.reshape(-1)
        tile, lane = rows // 16, rows % 16
        raw = self.data.view(-1, k // 32, bits, 16, 4)[tile, :, :, lane]  # [rows, chunks, bits, 4]
        if bits < 8:  # the low halves first: [rows, chunks, 2, 4, 4]
            u = torch.stack([raw[:, :, :4] & 0x0F, raw[:, :, :4] >> 4], dim=2)
            if bits > 4:
                e = bits - 4
                shifts = torch.arange(0, 8, e, dtype=torch.uint8).view(1, 1, 1, -1, 1)
                high = (raw[:, :, 4:].unsqueeze(3) >> shifts) & ((1 << e) - 1)
                u = u | (high.reshape(u.shape) << 4)
            raw = u
        mins = None if self.mins is None else self._lane_values(self.mins, tile, lane)
        w = self._weights(raw.reshape(len(rows), k // block, block),
                          self._lane_values(self.scales, tile, lane), mins)
        return w.view(*shape, k).to(dtype)

    def kernel_for(self, rows: int, ops: KernelTable | None, dtype: torch.dtype) -> str:
        """"tiled_int8" (VNNI's dot products) for a few rows; above them, where the CPU has
        AMX (more than AMX_PANELS_MIN_ROWS rows) "tiled_amx", where its BF16 dot products
        outrun its VNNI ones (more than VNNI_MAX_ROWS) "tiled_bf16" (the AVX-512 GEMM on
        panels dequantized 32 rows at a time), elsewhere "tiled_int8" for every number of
        rows (measured on Zen 4: docs/quantization.md); "torch" where the kernels do not
        run."""
        if not self.kernels_run(ops, dtype):
            return "torch"
        assert ops is not None
        if ops.quant_gemm_tiled_amx is not None:
            return "tiled_amx" if rows > AMX_PANELS_MIN_ROWS else "tiled_int8"
        if (rows > VNNI_MAX_ROWS and ops.quant_gemm_tiled_bf16 is not None
                and cpu_info().bf16_dots_outrun_vnni):
            return "tiled_bf16"
        return "tiled_int8"

    def grouped_kernel(self, ops: KernelTable) -> Kernel | None:
        return None if self.pad else ops.quant_gemm_tiled_grouped

    def fuses_silu_mul(self, kernel: str, ops: KernelTable | None) -> bool:
        # the stores round as silu_and_mul_bf16 does: in the libraries that have it
        return super().fuses_silu_mul(kernel, ops) and ops is not None \
            and ops.silu_and_mul_bf16 is not None

    @staticmethod
    def kernel(ops: KernelTable, name: str) -> Kernel:
        """The kernel that kernel_for's ``name`` stands for."""
        run = {"tiled_int8": ops.quant_gemm_tiled_int8, "tiled_bf16": ops.quant_gemm_tiled_bf16,
               "tiled_amx": ops.quant_gemm_tiled_amx}[name]
        assert run is not None, name
        return run

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                    ops: KernelTable | None, kernel: str | None = None,
                    silu_mul: bool = False) -> None:
        kernel = kernel or self.kernel_for(x.shape[0], ops, x.dtype)
        assert not silu_mul or kernel in self.silu_mul_kernels, kernel
        if kernel == "torch":
            super().matmul_into(out, x, bias, ops, kernel)
            return
        assert ops is not None
        run = self.kernel(ops, kernel)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.pad:  # (no SiLU-mul: n is not a multiple of 32)
            wide = out.new_empty(out.shape[0], self.n + self.pad)
            if bias is not None:
                if self._padded_bias is None or self._padded_bias[0] is not bias:
                    self._padded_bias = (bias, torch.cat([bias, bias.new_zeros(self.pad)]))
                bias = self._padded_bias[1]
            run(wide, x, self.data, self.scales, self.mins, self.fmt.bits, self.fmt.block,
                self.fmt.zero or 0, bias, False)
            out.copy_(wide[:, :self.n])
            return
        run(out, x, self.data, self.scales, self.mins, self.fmt.bits, self.fmt.block,
            self.fmt.zero or 0, bias, silu_mul)

    def describe(self, ops: KernelTable | None = None, dtype: torch.dtype | None = None
                 ) -> str:
        name = f"{self.origin} {self.qtype} kept as {self.fmt.name} in 16-row tiles"
        if dtype is None or self.kernel_for(1, ops, dtype) == "torch":
            return name
        few = "cpullm int8 dot products (AVX-512 VNNI)"
        many = self.kernel_for(1 << 20, ops, dtype)
        if many == "tiled_int8":
            return f"{name}: {few}, every number of rows"
        if many == "tiled_amx":
            return (f"{name}: {few} up to {AMX_PANELS_MIN_ROWS} rows, above it bf16 AMX tiles "
                    "of W dequantized 32 rows at a time")
        return (f"{name}: {few} up to {VNNI_MAX_ROWS} rows, above it the AVX-512 bf16 GEMM on "
                "W dequantized 32 rows at a time")


@dataclass
class Shard:
    """One checkpoint tensor's rows of a layer, as loaded: [start, end) of the output, the
    weight (kept quantized or dense) and, for GPTQ's act order, ``perm``: the input
    columns in the order the quantized weight's columns follow (x is gathered by it)."""

    end: int
    weight: QuantizedWeight | torch.Tensor
    perm: torch.Tensor | None = None

    def kind(self) -> tuple:
        """Shards of one kind stack into one segment."""
        if isinstance(self.weight, QuantizedWeight):
            perm = None if self.perm is None else tuple(self.perm.tolist())
            return (self.weight.fmt, self.weight.k, self.weight.origin, perm)
        return ("dense",)


@dataclass
class _Segment:
    """Output rows [start, end) of a layer, and the weight that computes them."""

    start: int
    end: int
    quantized: QuantizedWeight | None
    dense: torch.Tensor | None = None
    gemm: PackedGemm | None = None
    perm: torch.Tensor | None = None  # gathers x's columns for ``quantized``


class KeptLinearMethod(LinearMethod):
    """A linear layer whose checkpoint shards are each kept in their own format (a
    ``QuantizedWeight``, or dense). A format's method fills ``layer.shards`` (start ->
    ``Shard``) as its tensors load; this class does the rest."""

    def create_weights(self, layer: LinearBase, bias: bool, dtype: torch.dtype | None) -> None:
        layer.shards = {}
        layer.segments = []
        layer.compute_dtype = dtype
        self.create_bias(layer, bias, dtype)

    @staticmethod
    def check_shape(layer: LinearBase, shard_id: str | int | None, shape: tuple[int, ...]
                    ) -> tuple[int, int]:
        """The output rows of ``shard_id``, whose weight must be ``shape``."""
        start, end = layer.shard_range(shard_id)
        if tuple(shape) != (end - start, layer.input_size):
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint "
                             f"{tuple(shape)}, model {(end - start, layer.input_size)}")
        return start, end

    def process_weights_after_loading(self, layer: LinearBase, ops: KernelTable | None) -> None:
        # A shard with no quantized kernel for this CPU or compute dtype (AVX2, Arm, float32,
        # float16, --enforce-eager) is dequantized once, here, to run as a dense weight, as
        # fast as a checkpoint in that dtype (dequantizing at every matmul would be many
        # times slower); docs/quantization.md states the memory it costs.
        layer.shards = {
            start: shard if not isinstance(shard.weight, QuantizedWeight)
            or shard.weight.kept_here(ops, layer.compute_dtype)
            else Shard(shard.end, self.dense_weight(shard, layer.compute_dtype))
            for start, shard in layer.shards.items()}
        # Consecutive shards of one kind (one block format and column order, or float)
        # make one segment.
        segments: list[_Segment] = []
        last_kind: tuple | None = None
        for start, shard in sorted(layer.shards.items()):
            weight, kind = shard.weight, shard.kind()
            last = segments[-1] if segments else None
            if last is not None and last_kind == kind and last.end == start:
                if isinstance(weight, QuantizedWeight):
                    assert last.quantized is not None
                    last.quantized = QuantizedWeight.cat([last.quantized, weight])
                else:
                    assert last.dense is not None
                    last.dense = torch.cat([last.dense, weight])
                last.end = shard.end
            elif isinstance(weight, QuantizedWeight):
                segments.append(_Segment(start, shard.end, weight, perm=shard.perm))
            else:
                segments.append(_Segment(start, shard.end, None, weight))
            last_kind = kind
        layer.shards = {}
        bias = None if layer.bias is None else layer.bias.data
        for i, segment in enumerate(segments):
            if segment.dense is not None:
                seg_bias = None if bias is None else bias[segment.start:segment.end]
                segment.gemm = create_gemm(segment.dense, seg_bias, ops)
                if segment.gemm is not None:
                    segment.dense = None  # the packed copy replaces it
            elif segment.quantized is not None:
                segment.quantized = segment.quantized.for_kernels(ops)
                layer.add_module(f"quantized_{i}", segment.quantized)
        layer.segments = segments
        layer.ops = ops

    @staticmethod
    def dense_weight(shard: Shard, dtype: torch.dtype) -> torch.Tensor:
        """The shard's weight [rows, k] in ``dtype``, in the checkpoint's column order."""
        weight = shard.weight
        if not isinstance(weight, QuantizedWeight):
            return weight.to(dtype)
        dense = weight.dequantize(dtype)
        if shard.perm is None:
            return dense
        restored = torch.empty_like(dense)
        restored[:, shard.perm] = dense  # column j of the kept weight is column perm[j]
        return restored

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        segments, bias = layer.segments, layer.bias
        whole = segments[0].quantized if len(segments) == 1 and segments[0].perm is None else None
        kernel = None  # the one kernel_for asked, passed on
        if whole is not None:
            kernel = whole.kernel_for(rows.shape[0], layer.ops, rows.dtype)
            if layer.act is not None and whole.fuses_silu_mul(kernel, layer.ops):
                # gate and up in one kept weight: the kernel stores silu(gate) * up itself
                out = rows.new_empty(rows.shape[0], layer.output_size // 2)
                whole.matmul_into(out, rows, bias, layer.ops, kernel, silu_mul=True)
                return out.view(*x.shape[:-1], out.shape[-1])
        if len(segments) == 1 and segments[0].quantized is None:  # one dense weight: no copy
            dense = segments[0]
            out = dense.gemm(rows) if dense.gemm is not None else F.linear(rows, dense.dense, bias)
            out = out.view(*x.shape[:-1], layer.output_size)
            return layer.act(out) if layer.act is not None else out
        out = rows.new_empty(rows.shape[0], layer.output_size)
        for segment in segments:
            seg_bias = None if bias is None else bias[segment.start:segment.end]
            target = out[:, segment.start:segment.end]
            if segment.quantized is not None:
                inputs = rows if segment.perm is None else rows.index_select(1, segment.perm)
                segment.quantized.matmul_into(target, inputs, seg_bias, layer.ops,
                                              kernel if segment.quantized is whole else None)
            elif segment.gemm is not None:
                target.copy_(segment.gemm(rows))  # the packed weight carries the bias
            else:
                assert segment.dense is not None
                target.copy_(F.linear(rows, segment.dense, seg_bias))
        out = out.view(*x.shape[:-1], layer.output_size)
        return layer.act(out) if layer.act is not None else out

    def step_fn(self, layer: LinearBase, dtype: torch.dtype
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
        """A layer of one kept weight (no act order): the kernel ``apply`` picks for one row,
        with the arguments it passes, for as many rows as that kernel stays the pick."""
        segments = layer.segments
        if len(segments) != 1 or segments[0].quantized is None or segments[0].perm is not None:
            return None
        whole, ops, bias = segments[0].quantized, layer.ops, layer.bias
        kernel, silu_mul = whole.kernel_for(1, ops, dtype), layer.act is not None
        if silu_mul and not whole.fuses_silu_mul(kernel, ops):
            return None
        limit = 1
        while limit < _STEP_ROWS and whole.kernel_for(limit + 1, ops, dtype) == kernel:
            limit += 1
        size = layer.output_size // 2 if silu_mul else layer.output_size
        if isinstance(whole, TiledWeight) and kernel != "torch" and not whole.pad:
            assert ops is not None
            run = TiledWeight.kernel(ops, kernel)
            args = (whole.data, whole.scales, whole.mins, whole.fmt.bits, whole.fmt.block,
                    whole.fmt.zero or 0, bias, silu_mul)

            def product(x: torch.Tensor) -> torch.Tensor:
                out = x.new_empty(x.shape[0], size)
                run(out, x, *args)
                return out
        else:
            def product(x: torch.Tensor) -> torch.Tensor:
                out = x.new_empty(x.shape[0], size)
                whole.matmul_into(out, x, bias, ops, kernel, silu_mul)
                return out
        return product, limit

    def describe(self, layer: LinearBase) -> str:
        parts = []
        for segment in layer.segments:
            if segment.quantized is not None:
                parts.append(segment.quantized.describe(layer.ops, layer.compute_dtype)
                             + (", act order" if segment.perm is not None else ""))
            elif segment.gemm is not None:
                parts.append(segment.gemm.describe())
            else:
                parts.append("ATen linear")
        return "; ".join(parts)
