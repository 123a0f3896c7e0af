"""compressed-tensors checkpoints (LLM Compressor's output, the RedHatAI models):
``quant_method: compressed-tensors``, and FP8 checkpoints (``quant_method: fp8``).

Formats of a layer's weight, all with ``weight_scale`` ([n, groups], [n, 1] per channel, or
one per tensor) and, when asymmetric, ``weight_zero_point``:

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 [n, k * bits / 32], the q of a
  row packed along it (value j of a word at bits j * bits) as unsigned u = q + 2^(bits-1);
  zero points packed the same way along the output dimension; ``weight_shape`` [2];
  ``weight_g_idx`` [k] with ``actorder``.
- ``int-quantized`` / ``naive-quantized`` (INT8 W8A8, W8A16): ``weight`` int8 [n, k]. The
  activations of W8A8 are quantized to int8 by the kernels themselves, per block of x
  (finer than the checkpoint's per-token or per-tensor ``input_scale``, which is read and
  not needed).
- ``float-quantized`` (FP8 weights, e4m3): ``weight`` float8 [n, k], kept as its bytes with
  a float32 scale per row and block (quantization/fp8.py).
"""

from __future__ import annotations

from typing import Any

import torch

from cpullm.model_executor.layers.quantization.fp8 import FLOAT8, Float8Groups
from cpullm.model_executor.layers.quantization.int_groups import (
    CheckpointScheme,
    GroupQuantConfig,
    IntGroups,
    unpack_int32,
)

INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FORMATS = (*INT_FORMATS, "float-quantized", "dense")


def _per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Scales [rows, groups] from [rows, groups], [rows], or one per tensor."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1)
    return scale.reshape(rows, -1)


class CompressedTensorsScheme(CheckpointScheme):
    """``block``: FP8's weight block (rows, columns), where the config gives one;
    ``origin``: the format's name in the logs."""

    origin = "compressed-tensors"
    tensors = {"weight_packed": True, "weight_scale": False, "weight_zero_point": True,
               "weight_shape": True, "weight_g_idx": True, "weight_scale_inv": False,
               "input_scale": False, "input_zero_point": True}

    def __init__(self, block: tuple[int, int] | None = None,
                 origin: str = "compressed-tensors", int8_activations: bool = False) -> None:
        # int8_activations: the checkpoint quantizes the activations to int8 (W8A8)
        self.block, self.origin, self.int8_activations = block, origin, int8_activations

    def is_quantized(self, tensors: dict[str, torch.Tensor]) -> bool:
        weight = tensors.get("weight")
        return "weight_packed" in tensors or (weight is not None and (
            not weight.is_floating_point() or weight.dtype in FLOAT8))

    def unpack(self, tensors: dict[str, torch.Tensor], rows: int, k: int
               ) -> IntGroups | Float8Groups:
        scale = tensors.get("weight_scale", tensors.get("weight_scale_inv"))
        if scale is None:
            raise ValueError("a quantized weight without weight_scale")
        weight = tensors.get("weight")
        if weight is not None and weight.dtype in FLOAT8:
            return Float8Groups.of(weight, scale, self.block)
        scales = _per_row(scale, rows)
        zero = tensors.get("weight_zero_point")
        if "weight_packed" in tensors:
            packed = tensors["weight_packed"]
            bits = packed.shape[1] * 32 // k
            if bits not in (4, 8) or packed.shape[1] * 32 != k * bits:
                raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold 4- or "
                                 f"8-bit values of a row of {k}")
            q = unpack_int32(packed, bits, dim=1)  # [n, k], u = q + 2^(bits - 1)
            if zero is not None and zero.dtype == torch.int32:  # packed like the weight
                zero = unpack_int32(zero, bits, dim=0)[:rows]
            elif zero is not None:
                zero = zero.to(torch.int32) + (1 << (bits - 1))
        else:
            assert weight is not None
            if weight.dtype != torch.int8:
                raise ValueError(f"an int-quantized weight of dtype {weight.dtype} (int8 "
                                 "expected)")
            bits, q = 8, weight.view(torch.uint8) ^ 0x80  # q + 128, as u8
            zero = None if zero is None else zero.to(torch.int32) + 128
        if zero is not None:  # [rows, groups], from one per tensor, per row or per group
            zero = (zero.reshape(1, 1) if zero.numel() == 1 else zero.reshape(rows, -1))
            zero = zero.expand_as(scales).contiguous()
        groups = scales.shape[1]
        if k % groups:
            raise ValueError(f"{groups} scale groups do not divide a row of {k}")
        groups = IntGroups.with_group_index(q.contiguous(), scales.contiguous(), zero, bits,
                                            k // groups, tensors.get("weight_g_idx"))
        groups.per_token = self.int8_activations and "weight_packed" not in tensors
        return groups


def _check_args(name: str, args: dict[str, Any] | None, what: str) -> None:
    """Refuse by name the weight or activation schemes cpullm cannot run."""
    if not args:
        return
    kind, bits, strategy = args.get("type", "int"), args.get("num_bits"), args.get("strategy")
    if what == "weights":
        ok = (kind == "int" and bits in (4, 8) and strategy in ("channel", "group", "tensor")) \
            or (kind == "float" and bits == 8 and strategy in ("channel", "tensor", "block"))
    else:  # activations are quantized by the kernels themselves, or not at all
        ok = bits == 8 and kind in ("int", "float")
    if not ok:
        raise ValueError(f"quantization: compressed-tensors {what} of {name} "
                         f"({kind}, {bits} bits, strategy {strategy}) are not supported")


class CompressedTensorsConfig(GroupQuantConfig):
    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any]) -> None:
        formats = {config.get("format")} | {
            group.get("format") for group in (config.get("config_groups") or {}).values()
            if group.get("format")}
        unsupported = sorted(str(f) for f in formats - set(FORMATS) - {None})
        if unsupported:
            raise ValueError(f"quantization: compressed-tensors format {unsupported[0]!r} is "
                             f"not supported; supported: {', '.join(FORMATS)}")
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(f"quantization: compressed-tensors with {key} is not "
                                 "supported")
        blocks, int8_activations = set(), False
        for name, group in (config.get("config_groups") or {}).items():
            _check_args(name, group.get("weights"), "weights")
            activations = group.get("input_activations")
            _check_args(name, activations, "input activations")
            int8_activations |= bool(activations) and activations.get("type", "int") == "int"
            structure = (group.get("weights") or {}).get("block_structure")
            if structure:
                blocks.add(tuple(structure))
        if len(blocks) > 1:
            raise ValueError("quantization: compressed-tensors groups with different FP8 "
                             f"blocks {sorted(blocks)} are not supported")
        self.scheme = CompressedTensorsScheme(blocks.pop() if blocks else None,
                                              int8_activations=int8_activations)


class FP8Config(GroupQuantConfig):
    """``quant_method: fp8`` (float8 e4m3 weights with a per-tensor scale, or with
    ``weight_block_size`` a ``weight_scale_inv`` per block), kept in FP8."""

    name = "fp8"

    def __init__(self, config: dict[str, Any]) -> None:
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization: FP8 format {fmt!r} is not supported (e4m3)")
        block = config.get("weight_block_size")
        self.scheme = CompressedTensorsScheme(tuple(block) if block else None, origin="FP8")
