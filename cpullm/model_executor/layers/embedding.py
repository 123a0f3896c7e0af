from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.linear import pack_linear_weight, packed_linear


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

    packed: torch.Tensor | None = None

    def process_weights_after_loading(self, ops: ModuleType | None) -> None:
        """A oneDNN-packed copy for bfloat16/float16 (the weight itself may be shared with
        the embedding table, which needs the plain layout)."""
        if ops is not None and self.weight.dtype in (torch.bfloat16, torch.float16):
            self.packed = pack_linear_weight(self.weight.data)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(hidden, self.packed, None)
        return F.linear(hidden, self.weight)
