from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization import QuantizationConfig
from cpullm.model_executor.layers.quantization.dense import PackedGemm
from cpullm.model_executor.layers.quantization.gguf import RawBlocks
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; also the LM head when tied.

    With a quantization config, a checkpoint's block-quantized table stays quantized
    (``quantized``): a lookup dequantizes only the rows it reads."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.quantized: QuantizedWeight | None = None
        if quant_config is not None:
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | RawBlocks,
                      shard_id: str | int | None = None) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
        if isinstance(loaded, RawBlocks):
            self.quantized = loaded.to_weight()
            param.data = torch.empty(0, dtype=param.dtype)  # shared with a tied LM head
        else:
            param.data.copy_(loaded)

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        """Where the quantized kernels do not run, the table is dequantized once (as the
        linear layers are); a tied LM head shares the dequantized weight."""
        if self.quantized is not None and not QuantizedWeight.kernels_run(ops, self.weight.dtype):
            self.weight.data = self.quantized.dequantize(self.weight.dtype)
            self.quantized = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.dequantize(self.weight.dtype, input_ids)
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits. ``tied``: the embedding table whose
    weight it shares (quantized or not)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype, quant_config)
        self.gemm: PackedGemm | None = None
        self.tied: VocabEmbedding | None = None  # an instance attribute: a submodule once set
        self.ops: KernelTable | None = None

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = embedding

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        """A packed copy for the bfloat16/float16 GEMMs (the weight itself may be shared
        with the embedding table, which needs the plain layout)."""
        super().process_weights_after_loading(ops)  # an untied head's own blocks
        table = self.tied if self.tied is not None else self
        self.ops = ops
        if table.quantized is not None:
            self.quantized = table.quantized
        else:
            self.gemm = PackedGemm.create(self.weight.data, None, ops)

    def describe(self) -> str:
        """Which kernel computes the logits, for the debug log."""
        if self.quantized is not None:
            return self.quantized.describe(self.ops, self.weight.dtype)
        return self.gemm.describe() if self.gemm is not None else "ATen linear"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.matmul(hidden, None, self.ops)
        if self.gemm is not None:
            return self.gemm(hidden)
        return F.linear(hidden, self.weight)
