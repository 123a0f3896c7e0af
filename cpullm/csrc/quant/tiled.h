// A kept weight is laid out again after loading (quantization/kept.py, TiledWeight) with 16
// rows of W side by side, one per 32-bit lane: per 16 rows
// ("a tile") and 32 k ("a chunk"), steps of 64 bytes whose lane r holds 4 consecutive k of
// row r. With 8 bits, 8 steps, step q the k 4q .. 4q + 3; with 4 bits, 4 steps, step q
// those k in its low halves and 16 + 4q .. 16 + 4q + 3 in its high ones; with 5 or 6 bits,
// those 4 steps of the low 4 bits, then e = bits - 4 steps of the high ones (high_bits).
// The scales (and mins) are [tiles][blocks][16] (float16 or float32), or two-level (int8:
// GGUF's K-quants) records [tiles][super-blocks of 256][32 + 16 blocks] of 16 float16
// factors and each block's 16 int8 values, multiplied out as they are read. So:
// - dequantized, a step is rows of the B operand of TDPBF16PS as they lie (pairs of k by 16
//   columns of W), and half of a row of the dense GEMM's panels: a tile's 16 rows need no
//   transpose, and the dense GEMMs run on the panels they make (gemm_on_panels_amx, x the A
//   operand where it lies, the products stored as they come: no tiles of x to lay out, no
//   products to transpose; gemm_on_panels on AVX-512 BF16);
// - for a few rows of x, a step is the operand of VNNI's dot products of 4 u by 4 q per
//   lane, x quantized to int8 per block and broadcast 4 k at a time. On CPUs whose BF16 dot
//   products are no faster than their VNNI ones (Zen 4: a VNNI instruction does twice the
//   multiply-adds at the same rate) these win at every number of rows.
// quantization/kept.py (TiledWeight.kernel_for) picks between them by rows and CPU.
//
// Files: tiled.h (the layout and x's int8 blocks, shared), tiled_dots.cpp over
// tiled_dots_avx512.h (the int8 dot products), tiled_panels.cpp (the dequantized panels).
#pragma once

#include "kept.h"

namespace cpullm {
namespace quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct TiledWeight {
  const uint8_t* data;  // [tiles][k / 32][steps][64]
  const void* scales;   // [tiles][blocks][16], or two-level records
  const void* mins;     // the same, or null
  int64_t k, blocks, tile_bytes;
  float zero;
};

constexpr int64_t kSuperBlock = 256;  // weights per two-level record's float16 factors

// The bytes of a chunk's step i (of 8: k 4i .. 4i + 3 of each lane) with 5 or 6 bits: the
// high bits of u, e = BITS - 4 of them for each k, lie at bits e i % 8 of the chunk's step
// 4 + e i / 8. Returns them at bits 4 .. 3 + e of each byte (the rest zero).
template <int BITS>
constexpr int high_step(int i) { return 4 + (BITS - 4) * i / 8; }
template <int BITS>
constexpr int high_shift(int i) { return (BITS - 4) * i % 8; }
template <int BITS>
constexpr uint8_t high_mask() { return static_cast<uint8_t>(((1 << (BITS - 4)) - 1) << 4); }

// x quantized to int8 per block, in order: q [m][k], dx and dx sum(q) [m][blocks].
struct BlockQuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

// two_levels: x and its remainder_row as rows 2t and 2t + 1 for token t (logits).
inline BlockQuantizedX quantize_blocks(const at::Tensor& x, int64_t block, bool two_levels) {
  const int64_t k = x.size(1), blocks = k / block, per_token = two_levels ? 2 : 1;
  const int64_t m = x.size(0) * per_token;
  BlockQuantizedX out{std::vector<int8_t>(m * k), std::vector<float>(m * blocks),
                      std::vector<float>(m * blocks)};
  auto quantize = [&](const auto* row, int64_t t) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t total = 0;
      const float d = quantize_span(row + b * block, block, out.q.data() + t * k + b * block,
                                    total);
      out.scale[t * blocks + b] = d;
      out.sum[t * blocks + b] = d * static_cast<float>(total);
    }
  };
  quantize_levels(x, block, two_levels, 4, quantize);
  return out;
}

constexpr int kTiledTokens = 4;  // tokens of x per item of the int8 dot products
// Rows of x whose int8 copy (k bytes each) a thread's sets of tiles run over before the
// next such block: W is read from memory once per block, x's block from L2.
constexpr int64_t kTiledBlockRows = 256;

constexpr int64_t kTiledAhead = 4096;  // bytes of a tile prefetched ahead (tiled_dots)

// Where quant_gemm_tiled_int8's sums go: bfloat16 rows, or float32 logits (a token's two
// levels of x, rows 2t and 2t + 1 of its quantized x, added).
struct TiledOut {
  float* logits;
  c10::BFloat16* rows;
  int64_t ldo;
};

inline TiledOut tiled_out(const at::Tensor& out) {
  const bool logits = out.scalar_type() == at::kFloat;
  return TiledOut{logits ? out.data_ptr<float>() : nullptr,
                  logits ? nullptr : out.data_ptr<c10::BFloat16>(), out.stride(0)};
}

// The arguments' checks of the tiled kernels, and the weight as they read it.
TiledWeight check_tiled(const at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        int64_t bits, int64_t block, int64_t zero,
                        const c10::optional<at::Tensor>& bias, bool silu_mul);
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Where block b of tile g's values (scales or mins) lie: S float16 or float32, 16 of
// them; S int8_t, the two-level record's 16 factors (first) and the block's 16 values.
template <typename S, int BLOCK>
inline const S* block_at(const void* values, const TiledWeight& w, int64_t g, int64_t b) {
  if constexpr (std::is_same_v<S, int8_t>) {
    constexpr int64_t per = kSuperBlock / BLOCK;
    return static_cast<const int8_t*>(values) +
           (g * (w.k / kSuperBlock) + b / per) * (32 + 16 * per) + 32 + 16 * (b % per);
  } else {
    return static_cast<const S*>(values) + (g * w.blocks + b) * 16;
  }
}

// The factors of block_at's block: its record's (16 float16 values at a multiple of
// 32 + 16 per bytes from the records' start, the block's 32 + 16 (b % per) bytes on).
template <int BLOCK>
inline const at::Half* factors_at(const int8_t* block, int64_t b) {
  return reinterpret_cast<const at::Half*>(block - 32 - 16 * (b % (kSuperBlock / BLOCK)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 tile_values(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 tile_values(const float* p) { return _mm512_loadu_ps(p); }

// Block b of tile g's 16 values (scales or mins) as float32; two-level ones as the product
// of float32 factor and float32 value, as gguf's dequantizer computes them.
template <typename S, int BLOCK>
inline __m512 block_values(const void* values, const TiledWeight& w, int64_t g, int64_t b) {
  const S* p = block_at<S, BLOCK>(values, w, g, b);
  if constexpr (std::is_same_v<S, int8_t>) {
    const __m512 v = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return _mm512_mul_ps(tile_values(factors_at<BLOCK>(p, b)), v);
  } else {
    return tile_values(p);
  }
}

// The scale and the min (or -zero s) of block b of tile g's 16 rows.
template <typename S, bool MIN, int BLOCK>
inline void tile_scales(const TiledWeight& w, int64_t g, int64_t b, __m512& s, __m512& m) {
  s = block_values<S, BLOCK>(w.scales, w, g, b);
  m = MIN ? block_values<S, BLOCK>(w.mins, w, g, b) : _mm512_mul_ps(s, _mm512_set1_ps(-w.zero));
}

// u of a chunk's step i (of 8) with 5 or 6 bits: low, its low 4 bits at bits 0-3 of each
// byte, with the high ones from the chunk's steps (high_bits).
template <int BITS>
inline __m512i with_high_bits(__m512i low, const uint8_t* chunk, int i) {
  const __m512i plane = _mm512_loadu_si512(chunk + high_step<BITS>(i) * 64);
  const int shift = high_shift<BITS>(i);
  // to bits 4 .. of each byte: a 16-bit shift moves bits across bytes only outside the mask
  const __m512i moved = shift >= 4 ? _mm512_srl_epi16(plane, _mm_cvtsi32_si128(shift - 4))
                                   : _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - shift));
  const __m512i mask = _mm512_set1_epi8(static_cast<char>(high_mask<BITS>()));
  return _mm512_ternarylogic_epi32(low, moved, mask, 0xF8);  // low | moved & mask
}
#endif

}  // namespace quant
}  // namespace cpullm
