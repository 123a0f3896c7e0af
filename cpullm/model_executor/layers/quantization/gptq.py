"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): ``quant_method: gptq``.

Per linear layer: ``qweight`` int32 [k / (32 / bits), n] (the q of a column of W packed
along the input dimension, value j of a word at bits j * bits), ``qzeros`` int32
[groups, n / (32 / bits)] (packed along the output dimension), ``scales`` float16
[groups, n] and ``g_idx`` int32 [k] (each input column's group; with ``desc_act`` the
columns were quantized in another order). The format ``gptq`` stores every zero point
less one (z - 1); ``gptq_v2`` (GPTQModel's ``checkpoint_format``) stores z.
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


class GPTQScheme(CheckpointScheme):
    origin = "GPTQ"
    tensors = {"qweight": True, "qzeros": True, "scales": False, "g_idx": True}

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int) -> None:
        self.bits, self.group_size, self.desc_act = bits, group_size, desc_act
        self.zero_offset = zero_offset  # added to each stored zero point

    def is_quantized(self, tensors: dict[str, torch.Tensor]) -> bool:
        return "qweight" in tensors

    def unpack(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> IntGroups:
        missing = {"qweight", "qzeros", "scales"} - set(tensors)
        if missing:
            raise ValueError(f"GPTQ tensors missing: {sorted(missing)}")
        q = unpack_int32(tensors["qweight"], self.bits, dim=0).T  # [n, k]
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1).T + self.zero_offset
        scales = tensors["scales"].T  # [n, groups]
        group_size = k if self.group_size == -1 else self.group_size
        g_idx = tensors.get("g_idx") if self.desc_act else None
        return IntGroups.with_group_index(q.contiguous(), scales.contiguous(),
                                          zeros.contiguous(), self.bits, group_size, g_idx)


class GPTQConfig(GroupQuantConfig):
    name = "gptq"

    def __init__(self, config: dict[str, Any]) -> None:
        bits = config.get("bits", 4)
        if bits not in (4, 8):
            raise ValueError(f"quantization: GPTQ with {bits}-bit weights is not supported "
                             "(4 or 8 bits)")
        if config.get("lm_head"):
            raise ValueError("quantization: GPTQ with a quantized lm_head is not supported")
        if config.get("dynamic"):
            raise ValueError("quantization: GPTQ with per-module overrides (dynamic) is not "
                             "supported")
        group_size = int(config.get("group_size", 128))
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization: GPTQ checkpoint format {fmt!r} is not supported "
                             "(gptq or gptq_v2)")
        self.scheme = GPTQScheme(bits, group_size, bool(config.get("desc_act", False)),
                                 1 if fmt == "gptq" else 0)
