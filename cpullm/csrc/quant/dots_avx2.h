// The int8 dot products of quant_gemm (dots.cpp) on AVX2, without VNNI.
//
// A lane's four u8 x s8 products are summed by VPMADDUBSW (pairs into int16) and VPMADDWD
// (pairs of pairs into int32): what one VNNI instruction does. A pair of 4-bit u by x is at
// most 2 * 15 * 127 and fits int16, but 8-bit u could saturate it, so those multiply as
// q = u - 128 instead (|q| by x with q's sign: at most 2 * 128 * 127), and the 128 dx
// sum(q_x) that this leaves out joins each block's min term. A step's 64 bytes are two
// 256-bit halves, of 8 lanes each. A thread runs a row at a time over 4 tokens at a time,
// so that each step's u is unpacked once for the 4.
#pragma once

#include "dots.h"

namespace cpullm {
namespace quant {
namespace {

// Scales and mins of 8 blocks as float32.
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Lanes [0, count) set; and the scales or mins of count blocks (a last group's: 1, 2, 4 or
// 8), zero past them, read with no byte past them (nor through a store, which would stall
// the load behind it).
inline __m256i first_lanes(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load_first(const at::Half* p, int count) {
  if (count == 1) return _mm256_setr_ps(static_cast<float>(p[0]), 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
  const __m128i pairs = _mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                           _mm256_castsi256_si128(first_lanes(count / 2)));
  return _mm256_cvtph_ps(pairs);
}
inline __m256 load_first(const float* p, int count) {
  return _mm256_maskload_ps(p, first_lanes(count));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// acc + the sums of a lane's four products of u (unsigned, or signed q where SIGNED) by x
template <bool SIGNED>
inline __m256i dot4(__m256i acc, __m256i u, const int8_t* x) {
  const __m256i xv = load32(x);
  const __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(xv, u))
                               : _mm256_maddubs_epi16(u, xv);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The 64 u of step j of group g of a row (as q = u - 128 for 8 bits), in two halves.
template <int BITS>
inline void step_u(const uint8_t* row, const Group& g, int j, __m256i& lo, __m256i& hi) {
  const int lanes = g.blocks * g.lanes_per_block;
  const uint8_t* p = row + g.weight_offset;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  // 4 bytes a lane from src; a group of fewer than 16 lanes by masked loads, zero past it
  auto load_lanes = [&](const uint8_t* src) {
    if (lanes == 16) {
      lo = load32(src);
      hi = load32(src + 32);
      return;
    }
    const int* words = reinterpret_cast<const int*>(src);
    lo = _mm256_maskload_epi32(words, first_lanes(std::min(lanes, 8)));
    hi = _mm256_maskload_epi32(words + 8, first_lanes(std::max(lanes - 8, 0)));
  };
  if (BITS == 8) {
    load_lanes(p + j * 4 * lanes);
    lo = _mm256_xor_si256(lo, _mm256_set1_epi8(static_cast<char>(0x80)));
    hi = _mm256_xor_si256(hi, _mm256_set1_epi8(static_cast<char>(0x80)));
  } else if (g.steps >= 2) {  // steps 2i and 2i + 1 share bytes, 2i in the low halves
    load_lanes(p + (j / 2) * 4 * lanes);
    lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(lo, 4) : lo, nibble);
    hi = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(hi, 4) : hi, nibble);
  } else if (lanes == 16) {  // one step: bytes i and i + 32 share byte i
    const __m256i raw = load32(p);
    lo = _mm256_and_si256(raw, nibble);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  } else {  // one u a byte
    load_lanes(p);
  }
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// res[t] = row `row` of W by token t0 + t of x, for T tokens.
template <int BITS, int BLOCK, typename S, bool MIN, int T>
void row_dots(const Weight& w, const std::vector<Group>& groups, int64_t row,
              const QuantizedX& x, int64_t t0, float* res) {
  constexpr bool kSigned = BITS == 8;
  const uint8_t* wrow = w.data + row * w.row_bytes;
  const S* scales = static_cast<const S*>(w.scales) + row * w.blocks;
  const S* mins = static_cast<const S*>(w.mins) + (MIN ? row * w.blocks : 0);
  // A block's min term from its scales s and its stored mins: m, or -zero s; with 8 bits,
  // + 128 s for the q = u - 128 products.
  const __m256 offset = _mm256_set1_ps(kSigned ? 128.f : 0.f);
  const __m256 minus_zero = _mm256_set1_ps(kSigned ? 128.f - w.zero : -w.zero);
  auto min_term = [&](__m256 s, __m256 stored) {
    return MIN ? _mm256_fmadd_ps(s, offset, stored) : _mm256_mul_ps(s, minus_zero);
  };
  const int8_t* xq[T];
  const float *xs[T], *xsum[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = x.q.data() + (t0 + t) * x.q_stride;
    xs[t] = x.scale.data() + (t0 + t) * x.block_stride;
    xsum[t] = x.sum.data() + (t0 + t) * x.block_stride;
  }
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (const Group& g : groups) {
    __m256i dot[T][2];
    for (int t = 0; t < T; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
    const int64_t b0 = g.first_block;
    if (g.blocks == 16) {  // one block a lane, BLOCK / 4 steps: nearly all of a row
      const uint8_t* p = wrow + g.weight_offset;
      if constexpr (BITS == 4) {
        // A step's pairs of 4-bit products (at most 2 * 15 * 127) add up in int16 over up
        // to 8 steps (at most 30480) before one VPMADDWD widens them: half the multiplies.
        for (int j0 = 0; j0 < BLOCK / 4; j0 += 8) {
          __m256i pairs[T][2];
          for (int t = 0; t < T; ++t) pairs[t][0] = pairs[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int j = j0; j < j0 + std::min(8, BLOCK / 4); ++j) {
            const uint8_t* pair = p + (j / 2) * 64;
            const __m256i lo = _mm256_and_si256(
                j % 2 ? _mm256_srli_epi16(load32(pair), 4) : load32(pair), _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(
                j % 2 ? _mm256_srli_epi16(load32(pair + 32), 4) : load32(pair + 32),
                _mm256_set1_epi8(0x0F));
            for (int t = 0; t < T; ++t) {
              const int8_t* xj = xq[t] + g.x_offset + j * 64;
              pairs[t][0] = _mm256_add_epi16(pairs[t][0], _mm256_maddubs_epi16(lo, load32(xj)));
              pairs[t][1] = _mm256_add_epi16(pairs[t][1], _mm256_maddubs_epi16(hi, load32(xj + 32)));
            }
          }
          for (int t = 0; t < T; ++t)
            for (int h = 0; h < 2; ++h)
              dot[t][h] = _mm256_add_epi32(dot[t][h], _mm256_madd_epi16(pairs[t][h], _mm256_set1_epi16(1)));
        }
      } else {
#pragma GCC unroll 8
        for (int j = 0; j < BLOCK / 4; ++j) {
          const __m256i lo = _mm256_xor_si256(load32(p + j * 64), _mm256_set1_epi8(static_cast<char>(0x80)));
          const __m256i hi = _mm256_xor_si256(load32(p + j * 64 + 32), _mm256_set1_epi8(static_cast<char>(0x80)));
          for (int t = 0; t < T; ++t) {
            const int8_t* xj = xq[t] + g.x_offset + j * 64;
            dot[t][0] = dot4<true>(dot[t][0], lo, xj);
            dot[t][1] = dot4<true>(dot[t][1], hi, xj + 32);
          }
        }
      }
      // s dx dot + (m or -zero s) dx sum(q), 8 blocks a half
      for (int h = 0; h < 2; ++h) {
        const __m256 s = load8(scales + b0 + 8 * h);
        const __m256 m = min_term(s, MIN ? load8(mins + b0 + 8 * h) : s);
        for (int t = 0; t < T; ++t) {
          const __m256 scale = _mm256_mul_ps(s, _mm256_loadu_ps(xs[t] + b0 + 8 * h));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]), scale,
                                   _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum[t] + b0 + 8 * h), acc[t]));
        }
      }
      continue;
    }
    // One of a row's last groups (at most 8 blocks, over 2 to 16 lanes each): each lane's
    // sum meets its block's scale, spread to its lanes.
    for (int j = 0; j < g.steps; ++j) {
      __m256i lo, hi;
      step_u<BITS>(wrow, g, j, lo, hi);
      for (int t = 0; t < T; ++t) {
        const int8_t* xj = xq[t] + g.x_offset + j * 64;
        dot[t][0] = dot4<kSigned>(dot[t][0], lo, xj);
        dot[t][1] = dot4<kSigned>(dot[t][1], hi, xj + 32);
      }
    }
    const int shift = __builtin_ctz(static_cast<unsigned>(g.lanes_per_block));
    const __m256i spread[2] = {
        _mm256_srli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), shift),
        _mm256_srli_epi32(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15), shift)};
    const __m256i in_group = first_lanes(g.blocks);
    const __m256 s = load_first(scales + b0, g.blocks);
    const __m256 m = min_term(s, MIN ? load_first(mins + b0, g.blocks) : s);
    for (int t = 0; t < T; ++t) {
      const __m256 scale = _mm256_mul_ps(s, _mm256_maskload_ps(xs[t] + b0, in_group));
      for (int h = 0; h < 2; ++h)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]),
                                 _mm256_permutevar8x32_ps(scale, spread[h]), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_maskload_ps(xsum[t] + b0, in_group), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) res[t] = hsum8(acc[t]);
}

using RowDots = void (*)(const Weight&, const std::vector<Group>&, int64_t, const QuantizedX&,
                         int64_t, float*);

// [tokens == 4]
template <int BITS, int BLOCK, typename S, bool MIN>
struct RowDotsOf {
  static constexpr RowDots entry[2] = {&row_dots<BITS, BLOCK, S, MIN, 1>,
                                       &row_dots<BITS, BLOCK, S, MIN, kTokens>};
};

using Kernels = const RowDots*;

Kernels pick(int64_t bits, int64_t block, bool half, bool min) {
  return pick_kept<RowDotsOf>(bits, block, half, min);
}

// Rows [16 item, 16 item + 16) of W (n rows) with tokens [tb, te) of x, stored into out
// (leading dimension ldo) with the bias bp (or none).
inline void run_item(const Weight& w, const std::vector<Group>& groups, Kernels dots,
                     const QuantizedX& xq, int64_t n, int64_t item, int64_t tb, int64_t te,
                     const c10::BFloat16* bp, const OutRows& out) {
  const int64_t r0 = item * kItemRows, r1 = std::min<int64_t>(n, r0 + kItemRows);
  for (int64_t t0 = tb; t0 < te; t0 += kTokens) {
    const int tokens = static_cast<int>(std::min<int64_t>(kTokens, te - t0));
    for (int64_t r = r0; r < r1; ++r) {
      float res[kTokens];
      if (tokens == kTokens) {
        dots[1](w, groups, r, xq, t0, res);
      } else {
        for (int t = 0; t < tokens; ++t) dots[0](w, groups, r, xq, t0 + t, res + t);
      }
      const float b = bp != nullptr ? static_cast<float>(bp[r]) : 0.f;
      if (out.logits) {  // (t0 even: tokens come in pairs)
        for (int t = 0; t < tokens; t += 2)
          static_cast<float*>(out.data)[(t0 + t) / 2 * out.ldo + r] = res[t] + res[t + 1] + b;
      } else {
        for (int t = 0; t < tokens; ++t)
          static_cast<c10::BFloat16*>(out.data)[(t0 + t) * out.ldo + r] =
              c10::BFloat16(res[t] + b);
      }
    }
  }
}

}  // namespace
}  // namespace quant
}  // namespace cpullm
