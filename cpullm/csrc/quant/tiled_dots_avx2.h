// The int8 dot products of the 16-row tiles (tiled_dots.cpp) on AVX2, without VNNI: a tile's
// 16 rows are two vectors of 8 lanes, a lane per row.
//
// A lane's four u8 x s8 products are summed by VPMADDUBSW (pairs into int16) and VPMADDWD
// (pairs of pairs into int32), what one VNNI instruction does. A pair of u of up to 6 bits
// by x is at most 2 * 63 * 127 and fits int16, but 8-bit u could saturate it, so those multiply as
// q = u - 128 (|q| by x with q's sign: at most 2 * 128 * 127), and the 128 s dx sum(x's q)
// this leaves out joins each block's min term. A set of tiles runs one tile at a time
// over its tokens, whose int8 x stays in L1.
#pragma once

#include "tiled.h"

namespace cpullm {
namespace quant {
namespace {

struct Sums {  // 16 rows' float32 sums, rows 0-7 and 8-15
  __m256 half[2];
};
constexpr bool kStoresSiluMul = false;  // (no silu_and_mul_bf16 to round as)

inline __m256 rows8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 rows8(const float* p) { return _mm256_loadu_ps(p); }

// Rows 8 r .. 8 r + 7 of block b of a tile's values (scales or mins) as float32, two-level
// ones multiplied out as on AVX-512 (tiled.h: block_values).
template <typename S, int BLOCK>
inline __m256 block_rows8(const void* values, const TiledWeight& w, int64_t tile, int64_t b,
                          int r) {
  const S* p = block_at<S, BLOCK>(values, w, tile, b) + 8 * r;
  if constexpr (std::is_same_v<S, int8_t>) {
    const __m256 v = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return _mm256_mul_ps(rows8(factors_at<BLOCK>(p - 8 * r, b) + 8 * r), v);
  } else {
    return rows8(p);
  }
}

// u of a chunk's step i (of 8) with 5 or 6 bits, its half r (rows 8 r ..): low, the low 4
// bits, with the high ones from the chunk's steps (tiled.h: high_step).
template <int BITS>
inline __m256i with_high_bits(__m256i low, const uint8_t* chunk, int i, int r) {
  const uint8_t* bytes = chunk + high_step<BITS>(i) * 64 + 32 * r;
  const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const int shift = high_shift<BITS>(i);
  const __m256i moved = shift >= 4 ? _mm256_srl_epi16(plane, _mm_cvtsi32_si128(shift - 4))
                                   : _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - shift));
  return _mm256_or_si256(
      low, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(high_mask<BITS>()))));
}

// A chunk's steps of u of 5 or 6 bits as 8 steps of one u a byte (the 8-bit layout).
template <int BITS>
inline void widen_chunk(const uint8_t* chunk, uint8_t* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int q = 0; q < 4; ++q)
    for (int r = 0; r < 2; ++r) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          chunk + q * 64 + 32 * r));
      for (int h = 0; h < 2; ++h) {
        const __m256i u = _mm256_and_si256(h ? _mm256_srli_epi16(packed, 4) : packed, low);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (4 * h + q) * 64 + 32 * r),
                            with_high_bits<BITS>(u, chunk, 4 * h + q, r));
      }
    }
}

// Tokens [t0, t0 + T) by G tiles g0, g0 + apart, ... (16 G rows of W), as float32 sums
// acc [T][G]: per block, the integer sums of u q (4 k per lane, x's 4 broadcast) meet the
// block's scales once: s dx sum(u q) + m dx sum(q). PREFETCH: each step's bytes
// kTiledAhead on are brought into L1, as on AVX-512.
template <int BITS, int BLOCK, typename S, bool MIN, int T, int G, bool PREFETCH>
void tiled_dots(const TiledWeight& w, int64_t g0, int64_t apart, const BlockQuantizedX& xq,
                int64_t t0, Sums* acc) {
  constexpr int kSteps = BITS;  // 64-byte steps a chunk of 32 k
  constexpr bool kSigned = BITS == 8;
  const int64_t k = w.k;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  // a block's min term: m, or -zero s; with 8 bits + 128 s for the q = u - 128 products
  const __m256 offset = _mm256_set1_ps(kSigned ? 128.f : 0.f);
  const __m256 minus_zero = _mm256_set1_ps(kSigned ? 128.f - w.zero : -w.zero);
  for (int g = 0; g < G; ++g) {
    const int64_t tile = g0 + g * apart;
    const uint8_t* data = w.data + tile * w.tile_bytes;
    __m256i sums[T][2];
    for (int t = 0; t < T; ++t) {
      acc[t * G + g].half[0] = acc[t * G + g].half[1] = _mm256_setzero_ps();
      sums[t][0] = sums[t][1] = _mm256_setzero_si256();
    }
    for (int64_t c = 0; c < k / 32; ++c)
      for (int h = 0; h < 2; ++h) {  // k 32c + 16h .. + 15
        for (int q = 0; q < 4; ++q) {
          const uint8_t* chunk = data + c * kSteps * 64;
          const uint8_t* step = chunk + (BITS == 8 ? 4 * h + q : q) * 64;
          if (PREFETCH && (h == 0 || BITS == 8)) {
            _mm_prefetch(reinterpret_cast<const char*>(step + kTiledAhead), _MM_HINT_T0);
            if (BITS > 4 && BITS < 8 && q < BITS - 4)  // the high bits' steps
              _mm_prefetch(reinterpret_cast<const char*>(chunk + kTiledAhead + (4 + q) * 64),
                           _MM_HINT_T0);
          }
          __m256i u[2];
          for (int r = 0; r < 2; ++r) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * r));
            u[r] = BITS == 8 ? _mm256_xor_si256(v, flip)
                             : _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
            if constexpr (BITS > 4 && BITS < 8)
              u[r] = with_high_bits<BITS>(u[r], chunk, 4 * h + q, r);
          }
          const __m256i magnitude[2] = {kSigned ? _mm256_abs_epi8(u[0]) : u[0],
                                        kSigned ? _mm256_abs_epi8(u[1]) : u[1]};
          for (int t = 0; t < T; ++t) {
            int32_t quad;
            std::memcpy(&quad, xq.q.data() + (t0 + t) * k + 32 * c + 16 * h + 4 * q, 4);
            const __m256i xs = _mm256_set1_epi32(quad);
            for (int r = 0; r < 2; ++r) {
              const __m256i pairs = _mm256_maddubs_epi16(
                  magnitude[r], kSigned ? _mm256_sign_epi8(xs, u[r]) : xs);
              sums[t][r] = _mm256_add_epi32(sums[t][r], _mm256_madd_epi16(pairs, ones));
            }
          }
        }
        const int64_t kk = 32 * c + 16 * h + 16;  // k done
        if (kk % BLOCK == 0) {
          const int64_t b = kk / BLOCK - 1;
          for (int r = 0; r < 2; ++r) {
            const __m256 s = block_rows8<S, BLOCK>(w.scales, w, tile, b, r);
            const __m256 m = MIN ? _mm256_fmadd_ps(s, offset,
                                                   block_rows8<S, BLOCK>(w.mins, w, tile, b, r))
                                 : _mm256_mul_ps(s, minus_zero);
            for (int t = 0; t < T; ++t) {
              const int64_t x_at = (t0 + t) * w.blocks + b;
              __m256& a = acc[t * G + g].half[r];
              a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t][r]),
                                  _mm256_mul_ps(s, _mm256_set1_ps(xq.scale[x_at])), a);
              a = _mm256_fmadd_ps(m, _mm256_set1_ps(xq.sum[x_at]), a);
              sums[t][r] = _mm256_setzero_si256();
            }
          }
        }
      }
  }
}

// 8 bfloat16 values (rounded to nearest even, as c10::BFloat16; vec.h's bf16x16_store
// without AVX512-BF16 rounds 16 alike) at p, or to float32 ones.
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline __m256 bias8(const c10::BFloat16* p) {
  const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

// The sums of tiled_dots (acc [tokens][gs]: rows t0.. of the quantized x by tiles g0,
// g0 + apart, ...) into out's rows, the bias (bp, or null) added. No SiLU-mul here
// (silu_set < 0): the AVX2 library stores products.
inline void store_sums(const Sums* acc, int tokens, int gs, int64_t t0, int64_t g0,
                       int64_t apart, int64_t silu_set, const c10::BFloat16* bp,
                       const TiledOut& out) {
  (void)silu_set;
  auto biased = [&](__m256 sum, int64_t r) {
    return bp ? _mm256_add_ps(sum, bias8(bp + r)) : sum;
  };
  for (int t = 0; t < tokens; t += out.logits != nullptr ? 2 : 1)
    for (int g = 0; g < gs; ++g)
      for (int r = 0; r < 2; ++r) {
        const int64_t row = 16 * (g0 + g * apart) + 8 * r;
        const __m256 sum = acc[t * gs + g].half[r];
        if (out.logits != nullptr)
          store8(out.logits + (t0 + t) / 2 * out.ldo + row,
                 biased(_mm256_add_ps(sum, acc[(t + 1) * gs + g].half[r]), row));
        else
          store8(out.rows + (t0 + t) * out.ldo + row, biased(sum, row));
      }
}

}  // namespace
}  // namespace quant
}  // namespace cpullm
