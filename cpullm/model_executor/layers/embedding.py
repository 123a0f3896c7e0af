from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.dense import PackedGemm


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; also the LM head when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits."""

    gemm: PackedGemm | None = None

    def process_weights_after_loading(self, ops: KernelTable | None) -> None:
        """A packed copy for the bfloat16/float16 GEMMs (the weight itself may be shared
        with the embedding table, which needs the plain layout)."""
        self.gemm = PackedGemm.create(self.weight.data, None, ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(hidden)
        return F.linear(hidden, self.weight)
