"""The packed GEMMs of dense bfloat16 and float16 weights: cpullm's own (AVX-512 BF16's
register tiles, or AMX tiles where they run) on the weight laid out in panels, oneDNN's
matmul on its blocked copy, or both split by rows (``PackedGemm``). The dense linear method
(quantization/dense.py), the kept-quantized weights' float fallbacks, tied embeddings and
the loader hold their weights in them."""

from __future__ import annotations

import enum
import sys

import torch

from cpullm.logger import init_logger
from cpullm.model_executor.layers.activation import SiluAndMul
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.platform.cpu import cpu_info

logger = init_logger(__name__)


# Where the CPU has AMX tiles, the own GEMM runs on them (``gemm_bf16_amx``, on the same
# panels). Measured on 2 cores of an Intel Xeon with AMX-BF16, the GEMMs of one SmolLM2
# decoder layer and its LM head: AMX as fast as the AVX-512 GEMM at 1 row and 1.3-1.9x
# faster at 2-8 rows; against oneDNN's matmul on its own blocked copy of the weight 1.3-1.6x
# faster at 1-64 rows and within 10% at 128-2048 rows; the 1B model's layer the same. A
# weight whose input size is not a multiple of 32 (the tile depth) keeps the older split:
# the AVX-512 GEMM up to 8 rows, oneDNN's matmul (AMX) above.
_OWN_GEMM_ROWS_WITH_AMX = 8


def _has_amx() -> bool:
    """Whether oneDNN's matmul runs on AMX here (the CPU has the tiles, whatever cpullm's
    kernel library)."""
    return "amx_bf16" in cpu_info().flags


class GemmPath(enum.Enum):
    """Which GEMM runs a packed weight, by the number of rows of x."""

    OWN = "cpullm bf16 GEMM"
    AMX = "cpullm bf16 GEMM on AMX tiles"
    ONEDNN = "oneDNN matmul, prepacked weight"
    OWN_THEN_ONEDNN = (f"cpullm bf16 GEMM up to {_OWN_GEMM_ROWS_WITH_AMX} rows, "
                       "oneDNN matmul (AMX) above")

    @property
    def own_rows(self) -> int:
        """Up to how many rows the AVX-512 GEMM runs (above: AMX or oneDNN)."""
        return {GemmPath.OWN: sys.maxsize, GemmPath.AMX: 0, GemmPath.ONEDNN: 0,
                GemmPath.OWN_THEN_ONEDNN: _OWN_GEMM_ROWS_WITH_AMX}[self]


_logged_paths: set[GemmPath] = set()

def panels_of(weight: torch.Tensor) -> torch.Tensor:
    """A weight [n, k] (n a multiple of 32, k even) in the own GEMM's layout: panels of 32
    output columns, [n / 32, k / 2, 32, 2], each 128-byte row the (k, k + 1) pairs of its 32
    columns (csrc/gemm.cpp: gemm_bf16)."""
    n, k = weight.shape
    return weight.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


# From how many rows the own GEMM reads rows of x that lie a multiple of 4 KiB apart from a
# copy with their rows further apart (csrc/gemm_tiles.h: rows_apart).
_ROWS_APART_FROM = 16


def empty_rows(rows: int, width: int, like: torch.Tensor, longest_run: int) -> torch.Tensor:
    """An empty [rows, width] tensor of ``like``'s dtype for rows of x that the own GEMM
    will read in runs of up to ``longest_run`` rows (a mixture's experts): where its rows
    would lie a multiple of 4 KiB apart (a hidden size of 2048, 4096, ...) and a run is long
    enough, a view of rows 64 bytes longer, so that the GEMM's 12-row register tiles do not
    fall in one set of L1. gemm_bf16 copies the x of a single weight so; the grouped GEMM
    reads the rows as they lie, so they are made so from the start."""
    pad = 64 // like.element_size()
    if longest_run < _ROWS_APART_FROM or width * like.element_size() % 4096:
        return like.new_empty(rows, width)
    return like.new_empty(rows, width + pad)[:, :width]


class PackedGemm:
    """A bfloat16/float16 weight [out, in] and its bias, reordered once for the GEMMs that
    run them.

    bfloat16 weights whose output size is a multiple of 32 go to cpullm's own GEMM
    (``gemm_bf16``: 32-column panels of column pairs for the BF16 dot-product instruction,
    the next panel prefetched while one is used). Against oneDNN's matmul on a prepacked
    weight, on two Zen 5 cores (AVX-512 BF16, no AMX), the 30 decoder layers of a 135M
    model take 20% less time at 128 rows with the weights coming from memory, as in a
    decode step (28 vs 35 ms); the LM head 25% less; 1 to 8 rows 40% less; 4096 rows the
    same. With AMX the same panels feed AMX tiles (``gemm_bf16_amx``) for every number of
    rows, when the input size is a multiple of 32; otherwise oneDNN's matmul takes
    everything above 8 rows, on a copy of the weight in its blocked layout; so do other
    shapes and float16, all rows.

    ``silu_mul`` (a merged gate-up weight): the call returns silu(gate) * up. For the own
    GEMM the gate and up halves are interleaved 16 rows at a time, so that each panel holds
    matching gate and up columns, and the activation is applied as the product is stored;
    after oneDNN's matmul ``silu_mul`` runs on the product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: KernelTable,
                 silu_mul: SiluAndMul | None) -> None:
        n, k = weight.shape
        kernel = ops.gemm_bf16
        own = weight.dtype == torch.bfloat16 and kernel is not None and n % 32 == 0 \
            and k % 2 == 0
        amx = own and k % 32 == 0 and ops.gemm_bf16_amx is not None
        self.kernel = kernel if own else None
        self.amx = ops.gemm_bf16_amx if amx else None
        self.act = silu_mul
        self.output_size = n // 2 if silu_mul is not None else n
        self.bias = bias
        self.onednn: torch.Tensor | None = None
        if not own or (_has_amx() and not amx):
            if not torch.backends.mkldnn.is_available():
                raise RuntimeError("oneDNN is not available")
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 128)
        self.path = (GemmPath.ONEDNN if not own else GemmPath.AMX if amx
                     else GemmPath.OWN if self.onednn is None else GemmPath.OWN_THEN_ONEDNN)
        self.own_rows = self.path.own_rows  # read on every call
        if self.path not in _logged_paths:
            _logged_paths.add(self.path)
            logger.debug("bf16 GEMM path: %s (first weight %d x %d)", self.path.value, n, k)
        self.panels = self.panel_bias = None
        if own:
            if silu_mul is not None:  # rows: gate 0-15, up 0-15, gate 16-31, up 16-31, ...
                weight = weight.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)
                if bias is not None:
                    bias = bias.view(2, n // 32, 16).transpose(0, 1).reshape(n)
            self.panels = panels_of(weight)
            self.panel_bias = None if bias is None else bias.contiguous()

    @property
    def grouped_rows(self) -> int:
        """Up to how many rows per weight a grouped call of the AVX-512 GEMM (a mixture's
        experts) runs these panels: its single call beats one AMX call per expert there."""
        if self.kernel is None:
            return 0
        return _OWN_GEMM_ROWS_WITH_AMX if self.path is GemmPath.AMX else self.own_rows

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops: KernelTable | None,
               silu_mul: SiluAndMul | None = None) -> PackedGemm | None:
        """The packed weight, or None where neither GEMM applies (float32, no kernels, no
        oneDNN): the plain ATen GEMM then runs it."""
        if ops is None or weight.dtype not in (torch.bfloat16, torch.float16):
            return None
        try:
            return cls(weight, bias, ops, silu_mul)
        except RuntimeError:  # no oneDNN
            return None

    def tensors(self) -> list[torch.Tensor | None]:
        """What the packed weight holds, for counting its memory."""
        return [self.panels, self.panel_bias, self.onednn, self.bias]

    @property
    def silu_mul(self) -> bool:
        return self.act is not None

    def describe(self) -> str:
        return self.path.value + (", with SiLU-mul" if self.silu_mul else "")

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), in x's dtype or ``out_dtype`` (float32 for logits: the own
        GEMMs store their float32 sums unrounded; oneDNN's product is widened)."""
        rows = x.reshape(-1, x.shape[-1])
        kernel = self.kernel if rows.shape[0] <= self.own_rows else self.amx
        if kernel is not None:
            if rows.stride(-1) != 1 or rows.stride(0) % 2:
                rows = rows.contiguous()
            out = rows.new_empty(rows.shape[0], self.output_size, dtype=out_dtype or x.dtype)
            kernel(out, rows, self.panels, self.panel_bias, self.silu_mul)
            return out.view(*x.shape[:-1], self.output_size)
        out = torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        out = self.act(out) if self.act is not None else out
        return out if out_dtype is None else out.to(out_dtype)
