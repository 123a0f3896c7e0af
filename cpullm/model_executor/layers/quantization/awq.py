"""AWQ checkpoints (AutoAWQ, llm-awq; its GEMM layout): ``quant_method: awq``.

Per linear layer: ``qweight`` int32 [k, n / 8], eight 4-bit q of a row of W.T to a word
in AWQ's interleaved order (value j of a word at bits 4 j is column 8 c + ORDER[j] of its
group of eight), ``qzeros`` int32 [groups, n / 8] packed the same way, and ``scales``
float16 [groups, n]; w = s (q - z).
"""

from __future__ import annotations

from typing import Any

import torch

from cpullm.model_executor.layers.quantization.int_groups import (
    CheckpointScheme,
    GroupQuantConfig,
    IntGroups,
    unpack_int32,
)

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of its eight that value j of a word holds
# where column o of eight sits in a word: the inverse of ORDER
_POSITION_INDEX = torch.tensor([ORDER.index(o) for o in range(8)])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 in AWQ's order -> [rows, cols] uint8."""
    values = unpack_int32(packed, 4, dim=1)  # [rows, cols], in stored order
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, _POSITION_INDEX].reshape(rows, cols)


class AWQScheme(CheckpointScheme):
    origin = "AWQ"
    tensors = {"qweight": True, "qzeros": True, "scales": False}

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def is_quantized(self, tensors: dict[str, torch.Tensor]) -> bool:
        return "qweight" in tensors

    def unpack(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> IntGroups:
        missing = {"qweight", "qzeros", "scales"} - set(tensors)
        if missing:
            raise ValueError(f"AWQ tensors missing: {sorted(missing)}")
        q = unpack_awq(tensors["qweight"]).T  # [n, k]
        zeros = unpack_awq(tensors["qzeros"]).T  # [n, groups]
        group_size = k if self.group_size == -1 else self.group_size
        return IntGroups(q.contiguous(), tensors["scales"].T.contiguous(), zeros.contiguous(),
                         4, group_size)


class AWQConfig(GroupQuantConfig):
    name = "awq"

    def __init__(self, config: dict[str, Any]) -> None:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"quantization: AWQ with {bits}-bit weights is not supported "
                             "(4 bits)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization: AWQ version {version!r} is not supported (gemm)")
        if not config.get("zero_point", True):
            raise ValueError("quantization: AWQ without zero points is not supported")
        # modules_to_not_convert: those layers' checkpoints hold float weights, which load
        # as dense shards
        self.scheme = AWQScheme(int(config.get("group_size", config.get("q_group_size", 128))))
