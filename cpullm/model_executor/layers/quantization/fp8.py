"""FP8 (float8 e4m3) weights kept as the checkpoint stores them: one byte per weight and a
float32 scale per row and block of columns.

compressed-tensors ``float-quantized`` and ``quant_method: fp8`` checkpoints give a scale
per tensor, per output channel, or per block of 128 x 128 (``weight_block_size``); each
becomes ``Float8Groups``: the e4m3 bytes [n, k] and ``scales`` [n, ceil(k / block)], a
block's scale repeated over its rows. Kept for the kernels (``Float8Weight``, where
cpullm's AVX-512 BF16 kernels run), the bytes are laid out in panels of 32 rows
(``to_panels``: per pair of columns, 64 bytes in the order the kernels convert them) and a
matmul runs ``fp8_gemm_bf16`` (csrc/fp8_gemm.cpp): for the few rows of a decode step, BF16
dot products on the bytes as they are read; above, the bf16 GEMM on panels dequantized one
at a time. Half a bfloat16 weight's memory and reads, the same products. Elsewhere (and for
a weight whose rows are not a multiple of 32) each shard is dequantized once at load,
exactly, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpullm.model_executor.layers.ops import Kernel, KernelTable
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Up to this many rows of x, dot products on the bytes as read; above, the bf16 GEMM on
# dequantized panels (measured in docs/quantization.md).
FP8_DOT_MAX_ROWS = 8
# Where the CPU has AMX tiles, the dequantized panels run on them above this many rows.
FP8_AMX_MIN_ROWS = 4


def _scaled(weight: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """A float8 weight [n, k] times its scales [n, ceil(k / block)], in float32."""
    k = weight.shape[1]
    return weight.float() * scales.repeat_interleave(block, dim=1)[:, :k]


def to_panels(data: torch.Tensor) -> torch.Tensor:
    """FP8 bytes [n, k] (n a multiple of 32, k even) in the kernels' order, still [n, k]:
    per 32 rows and pair of columns, the 64 weights [row][2] go in as bytes 0, 2, .., 62
    (rows 0..15) and 1, 3, .., 63 (rows 16..31)."""
    n, k = data.shape
    pairs = data.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3)  # [panel, k / 2, row, 2]
    return pairs.reshape(n // 32, k // 2, 2, 32).transpose(2, 3).contiguous().view(n, k)


def from_panels(data: torch.Tensor) -> torch.Tensor:
    """The bytes [n, k] of ``to_panels`` back in row-major order."""
    n, k = data.shape
    pairs = data.view(n // 32, k // 2, 32, 2).transpose(2, 3)  # [panel, k / 2, half, 32]
    return pairs.reshape(n // 32, k // 2, 32, 2).permute(0, 2, 1, 3).reshape(n, k)


@dataclass(frozen=True)
class Float8Format:
    """How an FP8 weight is kept: e4m3 bytes, a float32 scale per ``block`` columns of a
    row (the whole row for per-tensor and per-channel scales)."""

    block: int
    bits: int = 8

    def bytes_per_weight(self) -> float:
        return 1 + 4 / self.block

    @property
    def name(self) -> str:
        return f"e4m3 bytes, a float32 scale per row and {self.block} columns"


@dataclass
class Float8Groups:
    """An FP8 weight [n, k] as loaded: ``weight`` (float8) and ``scales`` [n, blocks]
    (float32), w[r, c] = weight[r, c] * scales[r, c // block]."""

    weight: torch.Tensor
    scales: torch.Tensor
    block: int
    perm: None = None  # (FP8 has no act order; the linear method reads it of every format)

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor,
           block: tuple[int, int] | None) -> Float8Groups:
        """From a checkpoint's scales: one per tensor, per row ([n] or [n, 1]), or per block
        of ``block`` = (rows, columns) ([ceil(n / rows), ceil(k / columns)], the last blocks
        partial; None: FP8's usual 128 x 128, or the blocks that divide the weight)."""
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 weights in {weight.dtype} are not supported (e4m3)")
        n, k = weight.shape
        scale = scale.float()
        if scale.numel() == 1 or scale.shape in ((n,), (n, 1)):
            return cls(weight, scale.reshape(-1, 1).expand(n, 1).contiguous(), k)
        if scale.dim() != 2:
            raise ValueError(f"weight scales of shape {tuple(scale.shape)} do not fit [{n}, {k}]")
        if block is None:
            if scale.shape == (-(-n // 128), -(-k // 128)):
                block = (128, 128)
            elif n % scale.shape[0] == 0 and k % scale.shape[1] == 0:
                block = (n // scale.shape[0], k // scale.shape[1])
            else:
                raise ValueError(f"weight scales {tuple(scale.shape)} for a [{n}, {k}] weight "
                                 "need the block size (weight_block_size)")
        bn, bk = block
        if scale.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"weight scales {tuple(scale.shape)} do not fit a [{n}, {k}] "
                             f"weight in blocks of {bn} x {bk}")
        return cls(weight, scale.repeat_interleave(bn, dim=0)[:n].contiguous(), bk)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def narrow(self, dim: int, start: int, length: int) -> Float8Groups:
        """Rows [start, start + length) (dim 0), or columns (dim 1: whole blocks only)."""
        if dim == 0:
            return Float8Groups(self.weight[start:start + length],
                                self.scales[start:start + length], self.block)
        if self.scales.shape[1] == 1:  # one scale per row: any columns
            return Float8Groups(self.weight[:, start:start + length].contiguous(), self.scales,
                                length)
        if start % self.block or (length % self.block and start + length != self.shape[1]):
            raise ValueError(f"columns {start}..{start + length} do not fall on the FP8 "
                             f"blocks of {self.block}")
        blocks = slice(start // self.block, -(-(start + length) // self.block))
        return Float8Groups(self.weight[:, start:start + length].contiguous(),
                            self.scales[:, blocks].contiguous(), self.block)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32: weight * its block's scale."""
        return _scaled(self.weight, self.scales, self.block)

    def qtype(self) -> str:
        return "fp8 e4m3 " + ("channel" if self.scales.shape[1] == 1 else f"g{self.block}")

    @staticmethod
    def kernels_run(ops: KernelTable | None, dtype: torch.dtype) -> bool:
        return Float8Weight.kernels_run(ops, dtype)

    def to_weight(self, qtype: str, origin: str) -> Float8Weight | None:
        """The weight for the kernels, or None where they cannot take it (rows not a
        multiple of 32, an odd number of columns or of columns per block)."""
        n, k = self.shape
        if n % 32 or k % 2 or (self.scales.shape[1] > 1 and self.block % 2):
            return None
        data = to_panels(self.weight.contiguous().view(torch.uint8))
        return Float8Weight(Float8Format(self.block), data, self.scales.contiguous(), None, k,
                            qtype, origin)


class Float8Weight(QuantizedWeight):
    """A weight [n, k] kept in FP8: ``data`` the e4m3 bytes [n, k] (uint8) in panel order
    (``to_panels``), ``scales`` [n, blocks] float32; the ``fmt`` is a ``Float8Format``.
    Stacking such weights (``cat``) stacks whole panels."""

    fmt: Float8Format  # type: ignore[assignment]
    silu_mul_kernels = ()  # its kernels store the product; SiLU-mul runs after
    float32_kernels = ("torch",)

    def grouped_kernel(self, ops: KernelTable) -> Kernel | None:
        return None  # (the grouped kernels take integer blocks)

    def dequantize(self, dtype: torch.dtype, index: torch.Tensor | slice | None = None
                   ) -> torch.Tensor:
        data, scales = from_panels(self.data), self.scales
        if index is not None:
            data, scales = data[index], scales[index]
        return _scaled(data.view(torch.float8_e4m3fn), scales, self.fmt.block).to(dtype)

    @staticmethod
    def kernels_run(ops: KernelTable | None, dtype: torch.dtype) -> bool:
        """Whether cpullm's FP8 kernel runs here: AVX-512 BF16, bfloat16 compute."""
        return ops is not None and ops.fp8_gemm_bf16 is not None and dtype == torch.bfloat16

    def kept_here(self, ops: KernelTable | None, dtype: torch.dtype) -> bool:
        return self.kernels_run(ops, dtype)  # (its own kernels: K even, see to_weight)

    def amx_runs(self, ops: KernelTable) -> bool:
        return ops.fp8_gemm_bf16_amx is not None and self.k % 32 == 0

    def kernel_for(self, rows: int, ops: KernelTable | None, dtype: torch.dtype) -> str:
        """"dot" (BF16 dot products on the bytes as read), "panels" (cpullm's bf16 GEMM
        on panels dequantized 32 rows at a time), "amx" (those panels on AMX tiles) or
        "torch" (ATen on weights dequantized a slice at a time)."""
        if not self.kernels_run(ops, dtype):
            return "torch"
        assert ops is not None
        if self.amx_runs(ops):
            return "amx" if rows > FP8_AMX_MIN_ROWS else "dot"
        return "panels" if rows > FP8_DOT_MAX_ROWS else "dot"

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                    ops: KernelTable | None, kernel: str | None = None,
                    silu_mul: bool = False) -> None:
        assert not silu_mul  # (fuses_silu_mul: no FP8 kernel stores the activation)
        kernel = kernel or self.kernel_for(x.shape[0], ops, x.dtype)
        if kernel == "torch":
            super().matmul_into(out, x, bias, ops, "torch")
            return
        assert ops is not None
        if x.stride(-1) != 1 or x.stride(0) % 2:
            x = x.contiguous()
        if kernel == "amx":
            ops.fp8_gemm_bf16_amx(out, x, self.data, self.scales, self.fmt.block, bias)
        else:
            ops.fp8_gemm_bf16(out, x, self.data, self.scales, self.fmt.block, bias,
                              kernel == "dot")

    def describe(self, ops: KernelTable | None = None, dtype: torch.dtype | None = None
                 ) -> str:
        name = f"{self.origin} {self.qtype} kept as {self.fmt.name}"
        if dtype is None:
            return name
        if self.kernel_for(1, ops, dtype) == "torch":
            return f"{name}: dequantized a slice at a time, ATen linear"
        if self.kernel_for(1 << 20, ops, dtype) == "amx":
            return (f"{name}: cpullm BF16 dot products on the bytes up to {FP8_AMX_MIN_ROWS} "
                    "rows, bf16 panels dequantized 32 rows at a time on AMX tiles above")
        return (f"{name}: cpullm BF16 dot products on the bytes up to {FP8_DOT_MAX_ROWS} "
                "rows, bf16 GEMM on panels dequantized 32 rows at a time above (AVX-512 BF16)")
