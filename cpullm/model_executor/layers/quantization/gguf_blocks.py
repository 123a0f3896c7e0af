"""GGUF's block types taken apart into one layout the kernels read.

Every GGUF block type stores a weight w as small unsigned integers u with a scale per
block of 16 or 32 weights, and either a zero point or a min:

    symmetric:   w = s * (u - zero)   Q4_0 (zero 8), Q5_0 (16), Q8_0 (128, as u = q + 128),
                                      Q3_K (4), Q6_K (32)
    asymmetric:  w = s * u + m        Q4_1, Q5_1, Q4_K, Q5_K, Q2_K

``split_blocks`` turns a tensor's raw blocks into u, s and m; ``BlockFormat`` names the
layout they are kept in, at the file's size: u of 4, 5, 6 or 8 bits (Q2_K's 2 and Q3_K's
3 bits in 4); the legacy types' scales and mins in float16, as stored; the K-quants' as
they are stored too, two levels: an 8-bit integer per block (sub-scale, sub-min) and a
float16 per super-block of 256 weights (d, and -dmin), whose float32 product is the
block's scale (min). The values are exactly what gguf's own dequantizer computes from the
same blocks, with the same float32 operations.

``pack`` lays u out as a weight is kept until it loads (the blocks of a row in groups of
16, one block per 32-bit lane, the rest in groups of 8, 4, 2 and 1 blocks spread over the 16
lanes; a group as steps of 64 bytes, in which each lane holds 4 consecutive u of its
block; with 4 bits two steps share bytes, with 5 to 8 one u a byte); ``unpack`` reads it
back, and the kernels' own layout, 16-row tiles, is made from that after loading
(quantization/kept.py, ``TiledWeight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# Types read as plain floats (kept as a dense weight in the compute dtype).
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}


@dataclass(frozen=True)
class BlockFormat:
    """How one kept-quantized weight is laid out: ``bits`` per u (4, 5, 6 or 8), weights
    per ``block`` (16 to 128), the dtype of its scales and mins, and ``zero``
    (w = s * (u - zero)) or None (w = s * u + m, with a min per block). ``scale_dtype``
    "int8": two levels, an int8 per block times a float16 per ``super_block`` weights."""

    bits: int
    block: int
    scale_dtype: str  # "float16", "float32" or "int8"
    zero: int | None
    super_block: int = 0

    def bytes_per_weight(self) -> float:
        """Memory per weight, scales and mins included."""
        fields = 1 if self.zero is not None else 2  # scale (and min)
        if self.super_block:
            return self.bits / 8 + fields / self.block + 2 * fields / self.super_block
        scale = 2 if self.scale_dtype == "float16" else 4
        return self.bits / 8 + scale * fields / self.block

    @property
    def per_super(self) -> int:
        """Blocks per super-block (two-level scales), else 0."""
        return self.super_block // self.block

    @property
    def name(self) -> str:
        kind = f"zero {self.zero}" if self.zero is not None else "min"
        if self.super_block:
            return f"u{self.bits}/{self.block} 8-bit scales of 16-bit ones per " \
                   f"{self.super_block}, {kind}"
        return f"u{self.bits}/{self.block} {self.scale_dtype.removeprefix('float')}-bit " \
               f"scales, {kind}"


# How each type is kept: u at the type's bits (Q2_K's 2 and Q3_K's 3 in 4); the legacy
# types' float16 scales as stored, the K-quants' two levels as stored.
QK_K = 256
FORMATS = {
    T.Q4_0: BlockFormat(4, 32, "float16", 8),
    T.Q4_1: BlockFormat(4, 32, "float16", None),
    T.Q5_0: BlockFormat(5, 32, "float16", 16),
    T.Q5_1: BlockFormat(5, 32, "float16", None),
    T.Q8_0: BlockFormat(8, 32, "float16", 128),
    T.Q2_K: BlockFormat(4, 16, "int8", None, QK_K),
    T.Q3_K: BlockFormat(4, 16, "int8", 4, QK_K),
    T.Q4_K: BlockFormat(4, 32, "int8", None, QK_K),
    T.Q5_K: BlockFormat(5, 32, "int8", None, QK_K),
    T.Q6_K: BlockFormat(6, 16, "int8", 32, QK_K),
}
KEPT_TYPES = tuple(FORMATS)


@dataclass
class SplitBlocks:
    """A [rows, k] weight as u (uint8, one per weight, not yet packed), scales and mins
    ([rows, k / block]) of ``fmt``; ``mins`` is None for a symmetric type. Two-level
    scales: ``scales`` and ``mins`` int8, ``supers`` and ``min_supers`` their float16
    factors [rows, k / super_block]."""

    u: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    fmt: BlockFormat
    supers: np.ndarray | None = None
    min_supers: np.ndarray | None = None

    def packed(self) -> np.ndarray:
        """u in the kernels' layout: [rows, bytes per row]."""
        return pack(self.u, self.fmt.bits, self.fmt.block)


def _groups(k: int, block: int) -> list[tuple[int, int, int, int, int]]:
    """(first block, groups, blocks per group, lanes per block, steps) of a row's groups:
    the run of full groups of 16, then one each of 8, 4, 2 and 1 blocks as needed."""
    blocks, first, out = k // block, 0, []
    while first < blocks:
        size = 16
        while size > blocks - first:
            size //= 2
        count = (blocks - first) // 16 if size == 16 else 1
        per_block = min(16 // size, block // 4)
        out.append((first, count, size, per_block, block // (4 * per_block)))
        first += count * size
    return out


def pack(u: np.ndarray, bits: int, block: int) -> np.ndarray:
    """u [rows, k] (one per byte) -> [rows, bytes] in the kernels' step layout."""
    rows, k = u.shape
    out = []
    for first, count, size, per_block, steps in _groups(k, block):
        part = u[:, first * block:(first + count * size) * block]
        # [rows, count, size, steps, per_block, 4] -> steps of (size, per_block, 4) bytes
        part = part.reshape(rows, count, size, steps, per_block, 4).transpose(0, 1, 3, 2, 4, 5)
        lanes = size * per_block
        part = part.reshape(rows, count, steps, lanes * 4)
        if bits == 4 and steps >= 2:  # step 2i in the low halves, 2i + 1 in the high
            part = part.reshape(rows, count, steps // 2, 2, lanes * 4)
            part = part[:, :, :, 0] | (part[:, :, :, 1] << 4)
        elif bits == 4 and lanes == 16:  # one step: bytes i and i + 32 share byte i
            part = part[..., :32] | (part[..., 32:] << 4)
        out.append(part.reshape(rows, -1))
    return np.ascontiguousarray(np.concatenate(out, axis=1))


def unpack(data: np.ndarray, bits: int, block: int, k: int) -> np.ndarray:
    """The inverse of ``pack``: [rows, bytes] -> u [rows, k]."""
    rows = data.shape[0]
    out, offset = [], 0
    for _first, count, size, per_block, steps in _groups(k, block):
        lanes = size * per_block
        packed = bits == 4 and (steps >= 2 or lanes == 16)
        nbytes = count * steps * lanes * 4 // (2 if packed else 1)
        part = data[:, offset:offset + nbytes]
        offset += nbytes
        if bits == 4 and steps >= 2:
            part = part.reshape(rows, count, steps // 2, 1, lanes * 4)
            part = np.concatenate([part & 0x0F, part >> 4], axis=3)
        elif packed:
            part = part.reshape(rows, count, 1, 32)
            part = np.concatenate([part & 0x0F, part >> 4], axis=3)
        part = part.reshape(rows, count, steps, size, per_block, 4).transpose(0, 1, 3, 2, 4, 5)
        out.append(part.reshape(rows, -1))
    return np.concatenate(out, axis=1)


def block_bytes(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type."""
    return GGML_QUANT_SIZES[qtype]


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).reshape(raw.shape[0], -1)


def block_values(sub: np.ndarray, supers: np.ndarray, per_super: int) -> np.ndarray:
    """Two-level scales as gguf's dequantizer multiplies them: float32 d * float32 sc."""
    return np.repeat(supers.astype(np.float32), per_super, axis=-1) * sub.astype(np.float32)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """Legacy 32-weight blocks: 16 bytes, weights 0-15 in the low halves, 16-31 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Bit i of a block's little-endian 32-bit qh is the fifth bit of weight i."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [blocks, 32]
    return bits << 4


def _split_legacy(qtype: GGMLQuantizationType, blocks: np.ndarray) -> tuple:
    """[n, bytes] blocks of 32 -> (u [n, 32], d [n, 1] fp16, m [n, 1] fp16 | None, zero)."""
    d = _f16(blocks[:, 0:2])
    if qtype == T.Q4_0:
        return _nibbles16(blocks[:, 2:18]), d, None, 8, 15
    if qtype == T.Q4_1:
        return _nibbles16(blocks[:, 4:20]), d, _f16(blocks[:, 2:4]), None, 15
    if qtype == T.Q5_0:
        return _nibbles16(blocks[:, 6:22]) | _high_bits32(blocks[:, 2:6]), d, None, 16, 31
    if qtype == T.Q5_1:
        u = _nibbles16(blocks[:, 8:24]) | _high_bits32(blocks[:, 4:8])
        return u, d, _f16(blocks[:, 2:4]), None, 31
    assert qtype == T.Q8_0
    return (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, None, \
        128, 255


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins in 12 bytes."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K: 64 bytes of 2-bit values; weight 128h + 32j + l is bits 2j of byte
    32h + l. -> [n, 256]"""
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(n, 256)


def _split_k(qtype: GGMLQuantizationType, blocks: np.ndarray) -> tuple:
    """[n, bytes] super-blocks of 256 -> (u [n, 256], sub-scales [n, 256 / sub] (int8),
    d [n, 1], sub-mins | None, -dmin | None, zero, max u), d and -dmin float16."""
    n = blocks.shape[0]
    if qtype == T.Q2_K:  # scales[16], qs[64], d, dmin; 16 sub-blocks of 16
        sc = blocks[:, 0:16]
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        return (_two_bit_planes(blocks[:, 16:80]), sc & 0x0F, d, sc >> 4, -dmin, None, 3)
    if qtype == T.Q3_K:  # hmask[32], qs[64], scales[12], d; 16 sub-blocks of 16
        hmask, raw = blocks[:, 0:32], blocks[:, 96:108]
        low = (raw[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1))
        high = raw[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 4, 1)
        sc = (low.reshape(n, 16) & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)
        # weight 32j + l has its third bit in bit j of hmask[l]
        hbit = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        return (_two_bit_planes(blocks[:, 32:96]) | (hbit.reshape(n, 256) << 2),
                sc.astype(np.int8) - np.int8(32), _f16(blocks[:, 108:110]), None, None, 4, 7)
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin, scales[12], (qh[32],) qs[128]; 8 of 32
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:144] if qtype == T.Q4_K else blocks[:, 48:176]
        # weight 64c + l is the low half of byte 32c + l, weight 64c + 32 + l its high half
        q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        u = (q & 0x0F).reshape(n, 256)
        if qtype == T.Q5_K:  # weight 32j + l has its fifth bit in bit j of qh[l]
            qh = blocks[:, 16:48]
            hbit = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            u = u | (hbit.reshape(n, 256) << 4)
        return u, sc, d, mn, -dmin, None, 15 if qtype == T.Q4_K else 31
    assert qtype == T.Q6_K  # ql[128], qh[64], scales[16] (int8), d; 16 sub-blocks of 16
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    # weight 128h + 64i + l: half i of ql[64h + l], bits 2j of qh[32h + l'] (l = 32j' + l')
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1))
    low = (low & 0x0F).reshape(n, 256)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1))
    high = (high & 0x03).reshape(n, 256)
    return (low | (high << 4), blocks[:, 192:208].view(np.int8), _f16(blocks[:, 208:210]),
            None, None, 32, 63)


def split_blocks(qtype: GGMLQuantizationType, raw: np.ndarray, k: int) -> SplitBlocks:
    """A tensor's raw blocks [rows, bytes per row] as u, scales and mins."""
    if qtype not in FORMATS:
        raise ValueError(f"GGUF type {qtype.name} is not supported")
    fmt = FORMATS[qtype]
    per_block, nbytes = block_bytes(qtype)
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, nbytes)

    def per_row(values: np.ndarray | None, dtype: type) -> np.ndarray | None:
        return None if values is None else \
            np.ascontiguousarray(values.astype(dtype, copy=False).reshape(rows, -1))

    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        u, s, m, zero, max_u = _split_legacy(qtype, blocks)
        supers = min_supers = None
    else:
        u, s, supers, m, min_supers, zero, max_u = _split_k(qtype, blocks)
    assert u.shape[1] == per_block and zero == fmt.zero and max_u < 1 << fmt.bits
    assert str(s.dtype) == fmt.scale_dtype or fmt.super_block
    scale_dtype = np.int8 if fmt.super_block else np.float16
    return SplitBlocks(u.reshape(rows, k).astype(np.uint8, copy=False), per_row(s, scale_dtype),
                       per_row(m, scale_dtype), fmt, per_row(supers, np.float16),
                       per_row(min_supers, np.float16))


def block_scales(split: SplitBlocks) -> tuple[np.ndarray, np.ndarray | None]:
    """The scales and mins [rows, blocks] as the dequantizer multiplies by them (float32
    products for two-level ones)."""
    if not split.fmt.super_block:
        return split.scales, split.mins
    assert split.supers is not None
    per = split.fmt.per_super
    mins = None if split.mins is None else block_values(split.mins, split.min_supers, per)
    return block_values(split.scales, split.supers, per), mins


def dequantize_split(split: SplitBlocks) -> np.ndarray:
    """float32 weights from u, s and m, with gguf's own float32 operations."""
    rows, k = split.u.shape
    u = split.u.reshape(rows, k // split.fmt.block, split.fmt.block)
    scales, mins = block_scales(split)
    s = scales.astype(np.float32)[..., None]
    if split.fmt.zero is not None:
        w = (u.astype(np.float32) - np.float32(split.fmt.zero)) * s
    else:
        assert mins is not None
        w = s * u.astype(np.float32) + mins.astype(np.float32)[..., None]
    return w.reshape(rows, k)
