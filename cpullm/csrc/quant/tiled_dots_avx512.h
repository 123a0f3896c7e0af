// The int8 dot products of the 16-row tiles (tiled_dots.cpp) on AVX-512 VNNI: a tile's 16
// rows are one vector, a lane per row.
#pragma once

#include "tiled.h"

namespace cpullm {
namespace quant {
namespace {

using Sums = __m512;  // 16 rows' float32 sums
// silu(gate) * up rounded as silu_and_mul_bf16 rounds it, where the library has that kernel
#if defined(__AVX512BF16__)
constexpr bool kStoresSiluMul = true;
#else
constexpr bool kStoresSiluMul = false;
#endif

// A chunk's steps of u of 5 or 6 bits as 8 steps of one u a byte (the 8-bit layout).
template <int BITS>
inline void widen_chunk(const uint8_t* chunk, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int q = 0; q < 4; ++q) {
    const __m512i packed = _mm512_loadu_si512(chunk + q * 64);
    for (int h = 0; h < 2; ++h) {
      const __m512i u = _mm512_and_si512(h ? _mm512_srli_epi16(packed, 4) : packed, low);
      _mm512_storeu_si512(out + (4 * h + q) * 64, with_high_bits<BITS>(u, chunk, 4 * h + q));
    }
  }
}

// Tokens [t0, t0 + T) by G tiles g0, g0 + apart, ... (16 G rows of W), as float32 [T][G][16]
// in acc: per block, the integer sums of u q (4 k per lane per instruction, x's 4 broadcast)
// meet the block's scales once: s dx sum(u q) + m dx sum(q). PREFETCH: each step's bytes
// kTiledAhead on are brought into L1 (where W streams from memory past a few rows of x: the
// hardware's prefetch does not cross the 4 KiB pages of a tile's bytes).
template <int BITS, int BLOCK, typename S, bool MIN, int T, int G, bool PREFETCH>
void tiled_dots(const TiledWeight& w, int64_t g0, int64_t apart, const BlockQuantizedX& xq,
                int64_t t0, Sums* acc) {
  constexpr int kSteps = BITS;  // 64-byte steps a chunk of 32 k
  const int64_t k = w.k;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // chains of integer sums per token and tile: at least 8 in all where there are fewer
  // tokens and tiles than that, so that VPDPBUSD's latency is covered
  constexpr int C = T * G >= 8 ? 1 : T * G >= 4 ? 2 : 4;
  __m512i sums[T][G][C];
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      acc[t * G + g] = _mm512_setzero_ps();
      for (int i = 0; i < C; ++i) sums[t][g][i] = _mm512_setzero_si512();
    }
  for (int64_t c = 0; c < k / 32; ++c)
    for (int h = 0; h < 2; ++h) {  // k 32c + 16h .. + 15
      for (int q = 0; q < 4; ++q) {
        __m512i u[G];
        for (int g = 0; g < G; ++g) {
          const uint8_t* steps = w.data + (g0 + g * apart) * w.tile_bytes + c * kSteps * 64;
          if (PREFETCH && (h == 0 || BITS == 8)) {  // the tile's bytes kTiledAhead on
            _mm_prefetch(reinterpret_cast<const char*>(steps + kTiledAhead +
                                                       (BITS == 8 ? 4 * h + q : q) * 64),
                         _MM_HINT_T0);
            if (BITS > 4 && BITS < 8 && q < BITS - 4)  // the high bits' steps
              _mm_prefetch(reinterpret_cast<const char*>(steps + kTiledAhead + (4 + q) * 64),
                           _MM_HINT_T0);
          }
          if (BITS == 8) {
            u[g] = _mm512_loadu_si512(steps + (4 * h + q) * 64);
          } else {
            const __m512i packed = _mm512_loadu_si512(steps + q * 64);
            u[g] = _mm512_and_si512(h ? _mm512_srli_epi16(packed, 4) : packed, low);
            if constexpr (BITS > 4 && BITS < 8)
              u[g] = with_high_bits<BITS>(u[g], steps, 4 * h + q);
          }
        }
        for (int t = 0; t < T; ++t) {
          int32_t quad;
          std::memcpy(&quad, xq.q.data() + (t0 + t) * k + 32 * c + 16 * h + 4 * q, 4);
          const __m512i xs = _mm512_set1_epi32(quad);
          for (int g = 0; g < G; ++g)
            sums[t][g][q % C] = _mm512_dpbusd_epi32(sums[t][g][q % C], u[g], xs);
        }
      }
      const int64_t kk = 32 * c + 16 * h + 16;  // k done
      if (kk % BLOCK == 0) {
        const int64_t b = kk / BLOCK - 1;
        for (int g = 0; g < G; ++g) {
          __m512 s, m;
          tile_scales<S, MIN, BLOCK>(w, g0 + g * apart, b, s, m);
          for (int t = 0; t < T; ++t) {
            const int64_t at = (t0 + t) * w.blocks + b;
            __m512& a = acc[t * G + g];
            for (int i = 1; i < C; ++i)
              sums[t][g][0] = _mm512_add_epi32(sums[t][g][0], sums[t][g][i]);
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][g][0]),
                                _mm512_mul_ps(s, _mm512_set1_ps(xq.scale[at])), a);
            a = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.sum[at]), a);
            for (int i = 0; i < C; ++i) sums[t][g][i] = _mm512_setzero_si512();
          }
        }
      }
    }
}

// The sums of tiled_dots (acc [tokens][gs][16]: rows t0.. of the quantized x by tiles g0,
// g0 + apart, ...) into out's rows, the bias (bp, or null) added. silu_set >= 0: the two
// tiles are 16 rows of gate and their 16 of up, stored as silu(gate) * up in columns
// 16 silu_set ...
inline void store_sums(const Sums* acc, int tokens, int gs, int64_t t0, int64_t g0,
                       int64_t apart, int64_t silu_set, const c10::BFloat16* bp,
                       const TiledOut& out) {
  auto biased = [&](__m512 sum, int64_t r) {
    return bp ? _mm512_add_ps(sum, bf16x16_load(bp + r)) : sum;
  };
  if (out.logits != nullptr) {
    for (int t = 0; t < tokens; t += 2) {
      float* row = out.logits + (t0 + t) / 2 * out.ldo;
      for (int g = 0; g < gs; ++g) {
        const int64_t r = 16 * (g0 + g * apart);
        _mm512_storeu_ps(row + r, biased(_mm512_add_ps(acc[t * gs + g], acc[(t + 1) * gs + g]), r));
      }
    }
    return;
  }
  for (int t = 0; t < tokens; ++t) {
    const Sums* sums = acc + t * gs;
    c10::BFloat16* row = out.rows + (t0 + t) * out.ldo;
#if defined(__AVX512BF16__)
    if (silu_set >= 0) {
      bf16x16_store(row + 16 * silu_set,
                    silu_mul16(biased(sums[0], 16 * g0), biased(sums[1], 16 * (g0 + apart))));
      continue;
    }
#endif
    for (int g = 0; g < gs; ++g) {
      const int64_t r = 16 * (g0 + g * apart);
      bf16x16_store(row + r, biased(sums[g], r));
    }
  }
}

}  // namespace
}  // namespace quant
}  // namespace cpullm
