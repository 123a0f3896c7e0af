// The int8 dot products of quant_gemm (dots.cpp) on AVX-512 VNNI.
#pragma once

#include "dots.h"

namespace cpullm {
namespace quant {
namespace {

constexpr int kRows = 4;  // rows of W per tile (or 1, at the end of W); 4 tiles an item

// The steps of one of a row's last groups (fewer than 16 blocks: masked loads, one to
// eight steps) into the integer sums dot[r][t][chain]; odd steps go to the last chain.
template <int BITS, int R, int T, int CHAINS, bool PREFETCH>
inline void group_dots(const uint8_t* const* wrow, const int8_t* const* xq, const Group& g,
                       int64_t ahead, __m512i (&dot)[R][T][CHAINS]) {
  const int lanes = g.blocks * g.lanes_per_block;
  const __mmask64 bytes = lanes == 16 ? ~__mmask64{0} : (__mmask64{1} << (4 * lanes)) - 1;
  if (g.steps >= 2) {
    // two steps at a time: from one load of 4-bit u, or two loads of 8-bit u
    for (int j = 0; j < g.steps; j += 2) {
      __m512i xv[T][2];
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h) xv[t][h] = _mm512_loadu_si512(xq[t] + g.x_offset + (j + h) * 64);
      for (int r = 0; r < R; ++r) {
        __m512i u[2];
        if constexpr (BITS == 4) {
          const uint8_t* p = wrow[r] + g.weight_offset + j * 2 * lanes;
          if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
          const __m512i packed = _mm512_maskz_loadu_epi8(bytes, p);
          u[0] = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
          u[1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
        } else {
          const uint8_t* p = wrow[r] + g.weight_offset + j * 4 * lanes;
          if (PREFETCH) {
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T1);
          }
          u[0] = _mm512_maskz_loadu_epi8(bytes, p);
          u[1] = _mm512_maskz_loadu_epi8(bytes, p + 4 * lanes);
        }
        for (int t = 0; t < T; ++t) {
          dot[r][t][0] = _mm512_dpbusd_epi32(dot[r][t][0], u[0], xv[t][0]);
          dot[r][t][CHAINS - 1] = _mm512_dpbusd_epi32(dot[r][t][CHAINS - 1], u[1], xv[t][1]);
        }
      }
    }
    return;
  }
  __m512i xv[T];  // one step
  for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(xq[t] + g.x_offset);
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = wrow[r] + g.weight_offset;
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
    const __m512i u = BITS == 4 && lanes == 16 ? load_step<true>(p, bytes) : load_step<false>(p, bytes);
    for (int t = 0; t < T; ++t) dot[r][t][0] = _mm512_dpbusd_epi32(dot[r][t][0], u, xv[t]);
  }
}

// A group of 16 blocks (one per lane, STEPS = block / 4 steps): group_dots with the trip
// count known and no masks, so that the compiler keeps everything in registers. Nearly all
// of a row is such groups.
template <int BITS, int STEPS, int R, int T, int CHAINS, bool PREFETCH>
inline void full_group_dots(const uint8_t* const* wrow, const int8_t* const* xq,
                            int64_t weight_offset, int64_t x_offset, int64_t ahead,
                            __m512i (&dot)[R][T][CHAINS]) {
  if constexpr (T == 1) {
    // A step pair at a time (one load of 4-bit u), the steps taking turns over the chains.
#pragma GCC unroll 8
    for (int j = 0; j < STEPS; j += 2) {
      const __m512i x0 = _mm512_loadu_si512(xq[0] + x_offset + j * 64);
      const __m512i x1 = _mm512_loadu_si512(xq[0] + x_offset + j * 64 + 64);
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = wrow[r] + weight_offset + j * 32 * BITS / 4;
        if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
        if (PREFETCH && BITS == 8) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T1);
        __m512i u0, u1;
        if constexpr (BITS == 4) {
          const __m512i packed = _mm512_loadu_si512(p);
          u0 = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
          u1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
        } else {
          u0 = _mm512_loadu_si512(p);
          u1 = _mm512_loadu_si512(p + 64);
        }
        dot[r][0][j % CHAINS] = _mm512_dpbusd_epi32(dot[r][0][j % CHAINS], u0, x0);
        dot[r][0][(j + 1) % CHAINS] = _mm512_dpbusd_epi32(dot[r][0][(j + 1) % CHAINS], u1, x1);
      }
    }
    return;
  }
  // Several tokens: one step at a time, each row's u reloaded (from L1) for the second
  // step of a 4-bit pair: with 4 x 4 sums, one step's x and one row's u are all the
  // registers left.
#pragma GCC unroll 8
  for (int j = 0; j < STEPS; ++j) {
    __m512i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(xq[t] + x_offset + j * 64);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = wrow[r] + weight_offset + (BITS == 4 ? (j / 2) * 64 : j * 64);
      if (PREFETCH && (BITS == 8 || j % 2 == 0))
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
      __m512i u = _mm512_loadu_si512(p);
      if constexpr (BITS == 4)
        u = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(u, 4) : u, _mm512_set1_epi8(0x0F));
      for (int t = 0; t < T; ++t) dot[r][t][0] = _mm512_dpbusd_epi32(dot[r][t][0], u, xv[t]);
    }
  }
}

// The lane sums of rows [r0, r0 + R) of W with tokens [t0, t0 + T) of x, added into
// sums[t * kItemRows + slot + r]: one vector per dot product, its lanes still to be added.
// The integer sums of a group live in registers (R x T of them: with 4 x 4, enough
// independent VNNI chains to cover the instruction's latency); the float sums in ``sums``
// (L1), which they meet once per group.
template <int BITS, int BLOCK, typename S, bool MIN, int R, int T, bool PREFETCH>
void tile(const Weight& w, const std::vector<Group>& groups, int64_t r0, const QuantizedX& x,
          int64_t t0, __m512* sums, int slot) {
  // With one token, four chains of sums per row (steps take turns), for more VNNI
  // instructions in flight.
  constexpr int kChains = T == 1 ? 4 : 1;
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  const uint8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = w.data + (r0 + r) * w.row_bytes;
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) xq[t] = x.q.data() + (t0 + t) * x.q_stride;
  for (const Group& g : groups) {
    __m512i dot[R][T][kChains];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < kChains; ++c) dot[r][t][c] = _mm512_setzero_si512();
    if (g.blocks == 16)
      full_group_dots<BITS, BLOCK / 4, R, T, kChains, PREFETCH>(
          wrow, xq, g.weight_offset, g.x_offset, kItemRows * w.row_bytes, dot);
    else
      group_dots<BITS, R, T, kChains, PREFETCH>(wrow, xq, g, kItemRows * w.row_bytes, dot);
    // The integer sums meet their scales: s dx dot + (m or -zero s) dx sum(q). A block
    // over several lanes takes its scale into each (lane i: block i / lanes_per_block).
    const __mmask16 mask = static_cast<__mmask16>((1u << g.blocks) - 1);
    const __m512i spread = _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        __builtin_ctz(static_cast<unsigned>(g.lanes_per_block)));
    const int64_t b0 = g.first_block;
    __m512 xs[T], xsum[T];
    for (int t = 0; t < T; ++t) {
      xs[t] = _mm512_maskz_loadu_ps(mask, x.scale.data() + (t0 + t) * x.block_stride + b0);
      xsum[t] = _mm512_maskz_loadu_ps(mask, x.sum.data() + (t0 + t) * x.block_stride + b0);
    }
    for (int r = 0; r < R; ++r) {
      if (PREFETCH) {
        _mm_prefetch(reinterpret_cast<const char*>(scales + (r0 + r + kItemRows) * w.blocks + b0), _MM_HINT_T1);
        if (MIN) _mm_prefetch(reinterpret_cast<const char*>(mins + (r0 + r + kItemRows) * w.blocks + b0), _MM_HINT_T1);
      }
      const __m512 s = load16(scales + (r0 + r) * w.blocks + b0, mask);
      const __m512 m = MIN ? load16(mins + (r0 + r) * w.blocks + b0, mask)
                           : _mm512_mul_ps(s, _mm512_set1_ps(-w.zero));
      for (int t = 0; t < T; ++t) {
        __m512i d = dot[r][t][0];
        for (int c = 1; c < kChains; ++c) d = _mm512_add_epi32(d, dot[r][t][c]);
        __m512 scale = _mm512_mul_ps(s, xs[t]);
        if (g.lanes_per_block > 1) scale = _mm512_permutexvar_ps(spread, scale);
        __m512& acc = sums[t * kItemRows + slot + r];
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale,
                              _mm512_fmadd_ps(m, xsum[t], acc));  // m: once per block, unspread
      }
    }
  }
}

using Tile = void (*)(const Weight&, const std::vector<Group>&, int64_t, const QuantizedX&,
                      int64_t, __m512*, int);

// [prefetch][rows == 4][tokens == 4]: full tiles, and single rows or tokens for the edges.
template <int BITS, int BLOCK, typename S, bool MIN>
struct Tiles {
  static constexpr Tile entry[2][2][2] = {
      {{&tile<BITS, BLOCK, S, MIN, 1, 1, false>, &tile<BITS, BLOCK, S, MIN, 1, kTokens, false>},
       {&tile<BITS, BLOCK, S, MIN, kRows, 1, false>, &tile<BITS, BLOCK, S, MIN, kRows, kTokens, false>}},
      {{&tile<BITS, BLOCK, S, MIN, 1, 1, true>, &tile<BITS, BLOCK, S, MIN, 1, kTokens, true>},
       {&tile<BITS, BLOCK, S, MIN, kRows, 1, true>, &tile<BITS, BLOCK, S, MIN, kRows, kTokens, true>}}};
};

using Kernels = const Tile (*)[2][2];

Kernels pick(int64_t bits, int64_t block, bool half, bool min) {
  return pick_kept<Tiles>(bits, block, half, min);
}

// 16 float32 -> 16 bfloat16, rounded to nearest even (no BF16 instructions needed).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Rows [16 item, 16 item + 16) of W (n rows) with tokens [tb, te) of x (at most
// kTokenBlock; the first pass over the item prefetches the next item's weights), stored
// into out (leading dimension ldo) with the bias bp (or none). The 16 rows' sums for a
// token are reduced together and stored as one vector.
inline void run_item(const Weight& w, const std::vector<Group>& groups, Kernels tiles,
                     const QuantizedX& xq, int64_t n, int64_t item, int64_t tb, int64_t te,
                     const c10::BFloat16* bp, const OutRows& out) {
  __m512 sums[kTokens * kItemRows];  // [token][row]
  const int64_t r0 = item * kItemRows, rows = std::min<int64_t>(kItemRows, n - r0);
  const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 b = bp != nullptr ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                       _mm256_maskz_loadu_epi16(row_mask, bp + r0)), 16))
                                 : _mm512_setzero_ps();
  for (int64_t t0 = tb; t0 < te; t0 += kTokens) {
    const int tokens = static_cast<int>(std::min<int64_t>(kTokens, te - t0));
    for (int i = 0; i < kTokens * kItemRows; ++i) sums[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < rows; ++q) {  // q: first row of a tile of 4 rows or 1
      const bool full_rows = rows - q >= kRows;
      const auto& by_tokens = tiles[t0 == tb][full_rows];
      if (tokens == kTokens) {
        by_tokens[1](w, groups, r0 + q, xq, t0, sums, static_cast<int>(q));
      } else {
        for (int t = 0; t < tokens; ++t)
          by_tokens[0](w, groups, r0 + q, xq, t0 + t, sums + t * kItemRows, static_cast<int>(q));
      }
      if (full_rows) q += kRows - 1;
    }
    if (out.logits) {  // (t0 even: tokens come in pairs)
      for (int t = 0; t < tokens; t += 2)
        _mm512_mask_storeu_ps(static_cast<float*>(out.data) + (t0 + t) / 2 * out.ldo + r0,
                              row_mask, _mm512_add_ps(_mm512_add_ps(
                                  reduce16(sums + t * kItemRows),
                                  reduce16(sums + (t + 1) * kItemRows)), b));
      continue;
    }
    for (int t = 0; t < tokens; ++t)
      _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(out.data) + (t0 + t) * out.ldo + r0,
                               row_mask,
                               to_bf16(_mm512_add_ps(reduce16(sums + t * kItemRows), b)));
  }
}

}  // namespace
}  // namespace quant
}  // namespace cpullm
