"""Linear layers behind one small interface.

Every linear layer owns its parameters and a ``weight_loader(param, loaded, shard_id)``
that copies a checkpoint tensor into the right slice. Merged layers (QKV, gate-up) take
several checkpoint tensors as shards of one weight, so the forward pass runs one GEMM
instead of three or two. Quantized and tensor-parallel variants implement the same
interface: ``forward(x)`` and ``weight_loader``.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.activation import SiluAndMul
from cpullm.platform.cpu import cpu_info


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with W of shape [output_size, input_size]."""

    gemm: PackedGemm | None = None  # the weight in a GEMM kernel's layout, set after loading

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
        """With the compiled kernels, a bfloat16/float16 weight moves into the layout of
        the GEMM that runs it; the plain copy is dropped."""
        self._pack(ops, silu_mul=None)

    def _pack(self, ops: ModuleType | None, silu_mul: SiluAndMul | None) -> None:
        bias = None if self.bias is None else self.bias.data
        self.gemm = PackedGemm.create(self.weight.data, bias, ops, silu_mul)
        if self.gemm is not None:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype),
                                       requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(torch.empty(0, dtype=self.bias.dtype),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(x)
        return F.linear(x, self.weight, self.bias)


# Where the CPU has AMX tiles, oneDNN's matmul runs bfloat16 GEMMs on them; the own GEMM
# (BF16 dot products on AVX-512) then keeps only what is a stream of weights more than
# arithmetic. Measured on a 16-core Intel Xeon with AMX-BF16, 30 decoder layers of a 135M
# model: the own GEMM 25-40% faster at 1-8 rows, oneDNN 3-15x faster from 32 rows.
_OWN_GEMM_ROWS_WITH_AMX = 8


def _has_amx() -> bool:
    return "amx_bf16" in cpu_info().flags


class PackedGemm:
    """A bfloat16/float16 weight [out, in] and its bias, reordered once for the GEMMs that
    run them.

    bfloat16 weights whose output size is a multiple of 32 go to cpullm's own GEMM
    (``gemm_bf16``: 32-column panels of column pairs for the BF16 dot-product instruction,
    the next panel prefetched while one is used). Against oneDNN's matmul on a prepacked
    weight, on two Zen 5 cores (AVX-512 BF16, no AMX), the 30 decoder layers of a 135M
    model take 20% less time at 128 rows with the weights coming from memory, as in a
    decode step (28 vs 35 ms); the LM head 25% less; 1 to 8 rows 40% less; 4096 rows the
    same. With AMX, oneDNN's matmul takes everything above 8 rows, and keeps a copy of the
    weight in its blocked layout; so do other shapes and float16, all rows.

    ``silu_mul`` (a merged gate-up weight): the call returns silu(gate) * up. For the own
    GEMM the gate and up halves are interleaved 16 rows at a time, so that each panel holds
    matching gate and up columns, and the activation is applied as the product is stored;
    after oneDNN's matmul ``silu_mul`` runs on the product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: ModuleType,
                 silu_mul: SiluAndMul | None) -> None:
        n, k = weight.shape
        kernel = getattr(ops, "gemm_bf16", None)
        own = weight.dtype == torch.bfloat16 and kernel is not None and n % 32 == 0 \
            and k % 2 == 0
        self.kernel = kernel if own else None
        self.act = silu_mul
        self.output_size = n // 2 if silu_mul is not None else n
        self.bias = bias
        self.onednn: torch.Tensor | None = None
        if not own or _has_amx():
            if not torch.backends.mkldnn.is_available():
                raise RuntimeError("oneDNN is not available")
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 128)
        self.own_rows = 0 if not own else (
            _OWN_GEMM_ROWS_WITH_AMX if self.onednn is not None else sys.maxsize)
        self.panels = self.panel_bias = None
        if own:
            if silu_mul is not None:  # rows: gate 0-15, up 0-15, gate 16-31, up 16-31, ...
                weight = weight.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)
                if bias is not None:
                    bias = bias.view(2, n // 32, 16).transpose(0, 1).reshape(n)
            self.panels = weight.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()
            self.panel_bias = None if bias is None else bias.contiguous()

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops: ModuleType | None,
               silu_mul: SiluAndMul | None = None) -> PackedGemm | None:
        """The packed weight, or None where neither GEMM applies (float32, no kernels, no
        oneDNN): the plain ATen GEMM then runs it."""
        if ops is None or weight.dtype not in (torch.bfloat16, torch.float16):
            return None
        try:
            return cls(weight, bias, ops, silu_mul)
        except (RuntimeError, AttributeError):
            return None

    @property
    def silu_mul(self) -> bool:
        return self.act is not None

    def describe(self) -> str:
        if self.onednn is None:
            path = "cpullm bf16 GEMM"
        elif self.kernel is None:
            path = "oneDNN matmul, prepacked weight"
        else:
            path = f"cpullm bf16 GEMM up to {self.own_rows} rows, oneDNN matmul (AMX) above"
        return path + (", with SiLU-mul" if self.silu_mul else "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self.own_rows:
            assert self.kernel is not None
            if rows.stride(-1) != 1 or rows.stride(0) % 2:
                rows = rows.contiguous()
            out = rows.new_empty(rows.shape[0], self.output_size)
            self.kernel(out, rows, self.panels, self.panel_bias, self.silu_mul)
            return out.view(*x.shape[:-1], self.output_size)
        out = torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        return self.act(out) if self.act is not None else out


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


class GateUpSiluLinear(MergedColumnLinear):
    """gate_proj and up_proj as one layer that returns silu(gate) * up [..., intermediate].
    With the own bf16 GEMM the activation is applied as the product is stored: a prompt
    step never writes the product, twice the intermediate size wide, to read it back
    (SiLU-mul alone had taken 40 ms of a 4096-token step of a 135M model)."""

    def __init__(self, input_size: int, intermediate_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None, ops: ModuleType | None = None) -> None:
        super().__init__(input_size, [intermediate_size] * 2, bias, dtype)
        self.act = SiluAndMul(ops)

    def process_weights_after_loading(self, ops: ModuleType | None) -> None:
        self._pack(ops, silu_mul=self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(x)
        return self.act(super().forward(x))


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
