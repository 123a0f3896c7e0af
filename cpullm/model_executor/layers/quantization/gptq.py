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
    """Each layer's bits and group size are read from its tensors (``qweight`` holds
    32 / bits values a word, ``scales`` a row per group), so that GPTQModel's per-module
    overrides (``dynamic``) need no name matching; ``act_order``: whether any layer was
    quantized in act order (its ``g_idx`` then sorts the columns)."""

    origin = "GPTQ"
    tensors = {"qweight": True, "qzeros": True, "scales": False, "g_idx": True}

    def __init__(self, act_order: bool, zero_offset: int) -> None:
        self.act_order = act_order
        self.zero_offset = zero_offset  # added to each stored zero point

    def is_quantized(self, tensors: dict[str, torch.Tensor]) -> bool:
        return "qweight" in tensors

    def unpack(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> IntGroups:
        missing = {"qweight", "qzeros", "scales"} - set(tensors)
        if missing:
            raise ValueError(f"GPTQ tensors missing: {sorted(missing)}")
        qweight, scales = tensors["qweight"], tensors["scales"].T  # scales [n, groups]
        bits = qweight.shape[0] * 32 // k
        if bits not in (4, 8) or qweight.shape[0] * 32 != bits * k:
            raise ValueError(f"qweight {tuple(qweight.shape)} does not hold 4- or 8-bit "
                             f"values of a row of {k}")
        if k % scales.shape[1]:
            raise ValueError(f"{scales.shape[1]} scale groups do not divide a row of {k}")
        q = unpack_int32(qweight, bits, dim=0).T  # [n, k]
        zeros = unpack_int32(tensors["qzeros"], bits, dim=1).T.to(torch.int32) + self.zero_offset
        g_idx = tensors.get("g_idx") if self.act_order else None
        return IntGroups.with_group_index(q.contiguous(), scales.contiguous(),
                                          zeros[:rows].contiguous(), bits,
                                          k // scales.shape[1], g_idx)


def _check_bits(bits: object, where: str) -> None:
    if bits not in (4, 8):
        raise ValueError(f"quantization: GPTQ with {bits}-bit weights{where} is not supported "
                         "(4 or 8 bits)")


class GPTQConfig(GroupQuantConfig):
    """``dynamic`` (GPTQModel): per-module overrides, regular expressions of module names
    ("-:" for modules left in floats, else "+:" or none) to ``bits``, ``group_size``,
    ``sym`` and ``desc_act``; each layer's tensors say which applied to it."""

    name = "gptq"

    def __init__(self, config: dict[str, Any]) -> None:
        _check_bits(config.get("bits", 4), "")
        act_order = bool(config.get("desc_act", False))
        for pattern, override in (config.get("dynamic") or {}).items():
            if str(pattern).startswith("-:"):
                continue
            if not isinstance(override, dict):
                raise ValueError(f"quantization: GPTQ dynamic override {pattern!r}: a dict of "
                                 f"fields expected, not {override!r}")
            if "bits" in override:
                _check_bits(override["bits"], f" (dynamic override {pattern!r})")
            act_order = act_order or bool(override.get("desc_act", False))
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization: GPTQ checkpoint format {fmt!r} is not supported "
                             "(gptq or gptq_v2)")
        self.scheme = GPTQScheme(act_order, 1 if fmt == "gptq" else 0)
        if config.get("lm_head"):  # the LM head quantized too (layers/embedding.py)
            self.lm_head_scheme = self.scheme
