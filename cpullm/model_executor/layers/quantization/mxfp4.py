"""MXFP4 weights (OCP microscaling FP4, as gpt-oss ships its experts): ``quant_method:
mxfp4``.

Per linear layer: ``weight_blocks`` uint8 [n, k / 32, 16], two e2m1 codes a byte (the low
nibble first), and ``weight_scales`` uint8 [n, k / 32], an e8m0 exponent per 32 weights:
w = 2^(e - 127) * e2m1(code). The other layers of such a checkpoint are dense.

Every e2m1 value doubled is an integer from -12 to 12, so a block keeps exactly as 8-bit
integer groups with the kernels' symmetric zero point:

    q = 128 + 2 e2m1(code),   s = 2^(e - 128),   w = s (q - 128)

That is 8.5 bits a weight with float16 scales (9 with float32 ones, for exponents outside
float16's range) where the checkpoint holds 4.25 and bfloat16 16; where the kernels do not
run, each expert is dequantized once, exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from cpullm.model_executor.layers.quantization.int_groups import (
    CheckpointScheme,
    GroupQuantConfig,
    IntGroups,
)

# the e2m1 value of a 4-bit code (the sign is its top bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_Q = torch.tensor([128 + int(2 * v) for v in E2M1_VALUES], dtype=torch.uint8)
BLOCK = 32


class Mxfp4Scheme(CheckpointScheme):
    origin = "MXFP4"
    tensors = {"weight_blocks": True, "weight_scales": True}

    def is_quantized(self, tensors: dict[str, torch.Tensor]) -> bool:
        return "weight_blocks" in tensors

    def unpack(self, tensors: dict[str, torch.Tensor], rows: int, k: int) -> IntGroups:
        blocks, scales = tensors.get("weight_blocks"), tensors.get("weight_scales")
        if blocks is None or scales is None:
            raise ValueError("MXFP4 blocks or scales missing")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
                or tuple(blocks.shape) != (rows, k // BLOCK, BLOCK // 2) \
                or tuple(scales.shape) != (rows, k // BLOCK) or k % BLOCK:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                             f"{tuple(scales.shape)} {scales.dtype} do not fit a [{rows}, {k}] "
                             "weight")
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(rows, k)
        exponents = scales.to(torch.int32) - 128
        scales = torch.ldexp(torch.ones(exponents.shape), exponents)
        return IntGroups(_Q[codes.long()], scales, None, 8, BLOCK)

    def qtype(self, groups: IntGroups) -> str:
        return "mxfp4 (as 8-bit groups of 32)"


class Mxfp4Config(GroupQuantConfig):
    name = "mxfp4"

    def __init__(self, config: dict[str, Any]) -> None:
        self.scheme = Mxfp4Scheme()
