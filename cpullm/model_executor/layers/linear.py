"""Linear layers behind one small interface.

Every linear layer owns its parameters and a ``weight_loader(param, loaded, shard_id)``
that copies a checkpoint tensor into the right slice. Merged layers (QKV, gate-up) take
several checkpoint tensors as shards of one weight, so the forward pass runs one GEMM
instead of three or two. What the parameters are and how the matmul runs is the layer's
``LinearMethod`` (layers/quantization): dense unless the model's quantization config says
otherwise. Tensor-parallel variants will implement the same interface.
"""

from __future__ import annotations

import torch
from torch import nn

from cpullm.model_executor.layers.activation import SiluAndMul
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization import QuantizationConfig
from cpullm.model_executor.layers.quantization.dense import DenseLinearMethod, PackedGemm


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with W of shape [output_size, input_size]."""

    gemm: PackedGemm | None = None  # the dense method's packed weight, set after loading
    shard_ids: tuple[str | int | None, ...] = (None,)  # the checkpoint tensors it takes

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        """Copy a checkpoint tensor into the output rows of its shard."""
        start, end = self.shard_range(shard_id)
        target = param.data[start:end]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint "
                             f"{tuple(loaded.shape)}, model {tuple(target.shape)}")
        target.copy_(loaded)

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        self.method.process_weights_after_loading(self, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class ReplicatedLinear(LinearBase):
    """A plain linear layer, whole on every rank."""


class MergedColumnLinear(LinearBase):
    """Several linear layers with the same input, stacked along the output
    (gate_proj and up_proj -> gate_up_proj). Shard ids are the positions 0, 1, ...; None:
    all of them at once."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias, dtype, quant_config)

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
    at once."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype, quant_config)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id is None:  # a checkpoint that stores the layer fused (Phi-3)
            return 0, self.output_size
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[str(shard_id)]
        return start, start + (self.q_size if shard_id == "q" else self.kv_size)
