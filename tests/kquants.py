"""Q4_K, Q5_K and Q6_K quantizers for tests (gguf-py dequantizes K-quants but does not make
them): a super-block's sub-blocks get an affine (Q4_K, Q5_K) or symmetric (Q6_K) scale from
their own range, the sub-scales are stored to 6 (8) bits of the super-block's float16 scales,
and the values are rounded against the stored scales. Simpler than llama.cpp's search for
the best scales, and packed in the layouts gguf's dequantizer reads."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


def _halves(values: np.ndarray) -> np.ndarray:
    """float16 [n] as bytes [n, 2]."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _affine(x: np.ndarray, levels: int):
    """Super-blocks x [n, 8, 32] as the unsigned quants [n, 8, 32], the float16 d and dmin [n]
    and the 6-bit scales and mins [n, 8] of y = d sc q - dmin m."""
    low = np.minimum(x.min(axis=2), 0)
    step = (x.max(axis=2) - low) / levels
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = (-low.min(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)),
                0, 63)
    scale = (d32 * sc)[:, :, None]
    q = np.divide(x + (dmin32 * m)[:, :, None], scale, out=np.zeros_like(x), where=scale > 0)
    return (np.clip(np.rint(q), 0, levels).astype(np.uint8), d, dmin,
            sc.astype(np.uint8), m.astype(np.uint8))


def _scales_and_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes holding 8 six-bit scales and mins: sub-blocks 0-3 in the low six bits of
    bytes 0-3 (scales) and 4-7 (mins), sub-blocks 4-7 split into the low and high nibbles of
    bytes 8-11 and, for their top two bits, the free top bits of bytes 0-7."""
    packed = np.empty((sc.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return packed


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Quants [n, 256] as 128 bytes: each 64 values' first 32 in the low nibbles of 32 bytes,
    their last 32 in the high ones."""
    chunks = q.reshape(-1, 4, 2, 32) & 0xF
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, m = _affine(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_halves(d), _halves(dmin), _scales_and_mins(sc, m),
                           _nibbles(q.reshape(-1, QK_K))], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, m = _affine(x.reshape(-1, 8, 32), 31)
    q = q.reshape(-1, 8, 32)
    # bit 4 of sub-block j's value l is bit j of byte l of the 32 high-bit bytes
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1)
    return np.concatenate([_halves(d), _halves(dmin), _scales_and_mins(sc, m),
                           high.astype(np.uint8), _nibbles(q.reshape(-1, QK_K))], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    step = peak / -32  # the sub-block's largest magnitude at -32, the end with room
    d = (np.abs(step).max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)),
                 -128, 127)
    scale = (d32 * sc)[:, :, None]
    q = np.divide(x, scale, out=np.zeros_like(x), where=scale != 0)
    u = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # per half of 128: values 32 j + l (j = 0..3) put their low nibbles in bytes l (j = 0, 2)
    # and 32 + l (j = 1, 3), low then high, and their top two bits at bits 2 j of byte l
    low = np.concatenate([(u[:, :, 0] & 0xF) | ((u[:, :, 2] & 0xF) << 4),
                          (u[:, :, 1] & 0xF) | ((u[:, :, 3] & 0xF) << 4)], axis=2)
    high = sum((u[:, :, j] >> 4) << (2 * j) for j in range(4)).astype(np.uint8)
    return np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _halves(d)], axis=1)


QUANTIZERS = {T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def quantize_k(values: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) as ``qtype``'s blocks, bytes [rows, row bytes]."""
    rows, k = values.shape
    if k % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values, not {k}")
    blocks = QUANTIZERS[qtype](np.asarray(values, dtype=np.float32).reshape(-1, QK_K))
    return blocks.reshape(rows, -1)
