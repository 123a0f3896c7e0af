// The decode kernel's bfloat16 parts (decode.cpp): the next item's prefetch, the scores as
// BF16 dot products, the values two keys per dot product.
#pragma once

#include "common.h"

namespace cpullm {
namespace attn {
namespace {

// Walks the keys and values of the item a thread takes next, a few rows per call, into
// L2: spread over the current item's work, it runs a whole item ahead of use.
struct NextItemPrefetch {
  const c10::BFloat16* kp = nullptr;  // at the item's KV head
  const c10::BFloat16* vp = nullptr;
  const int64_t* bt = nullptr;
  int64_t t = 0, len = 0, block_size = 1, block_stride = 0, token_stride = 0, bytes = 0;

  void step(int64_t rows) {
    const int64_t stop = std::min(len, t + rows);
    while (t < stop) {  // a division per block's run of rows, not per row
      const int64_t off = t % block_size, run = std::min(stop - t, block_size - off);
      const int64_t base = bt[t / block_size] * block_stride + off * token_stride;
      for (int64_t j = 0; j < run; ++j) {
        prefetch_row_l2(kp + base + j * token_stride, bytes);
        prefetch_row_l2(vp + base + j * token_stride, bytes);
      }
      t += run;
    }
  }
};

// The 16 dot products of q (CH chunks of 32) with 16 keys `token_stride` apart, one per
// lane. The loops have constant bounds, so the 16 sums stay in registers until reduced
// (with a variable count they went through memory: 6% of the kernel's time from L3).
template <int CH>
inline __m512 dots16(const __m512bh* q, const c10::BFloat16* k, int64_t token_stride) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c)
      a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(k + j * token_stride + c * 32));
    acc[j] = a;
  }
  return reduce16(acc);
}

// scores[g * n + (t - first)] = q_g . k_t * scale for the G query heads of one KV head;
// the block table is walked a block at a time, 16 tokens per reduction.
template <int CH>
void paged_scores_bf16(float* scores, const __m512bh* q, int64_t group, float scale,
                       const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* bt,
                       int64_t first, int64_t len, int64_t block_size, int64_t block_stride,
                       int64_t token_stride, NextItemPrefetch& next_item) {
  const int64_t n = len - first;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = first; t < len;) {
    const int64_t off = t % block_size, run = std::min(len - t, block_size - off);
    const int64_t base = bt[t / block_size] * block_stride + off * token_stride;
    const c10::BFloat16* k = kp + base;
    const c10::BFloat16* v = vp + base;
    float* row = scores + (t - first);
    for (int64_t j = 0; j < std::min(run, kPrefetchTokens); ++j)
      prefetch_row(k + j * token_stride, CH * 64);
    for (int64_t i = 0; i < run; i += 16) {
      const int64_t m = std::min<int64_t>(16, run - i);
      next_item.step(m);
      for (int64_t j = i + kPrefetchTokens; j < std::min(run, i + m + kPrefetchTokens); ++j)
        prefetch_row(k + j * token_stride, CH * 64);
      for (int64_t j = i; j < i + m; ++j) prefetch_row(v + j * token_stride, CH * 64);
      if (m == 16) {
        for (int64_t g = 0; g < group; ++g)
          _mm512_storeu_ps(row + g * n + i, _mm512_mul_ps(
              dots16<CH>(q + g * CH, k + i * token_stride, token_stride), vscale));
        continue;
      }
      for (int64_t g = 0; g < group; ++g)  // a block's last few tokens
        for (int64_t j = 0; j < m; ++j) {
          const c10::BFloat16* kr = k + (i + j) * token_stride;
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < CH; ++c)
            a = _mm512_dpbf16_ps(a, q[g * CH + c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
          row[g * n + i + j] = _mm512_reduce_add_ps(a) * scale;
        }
    }
    t += run;
  }
}

// acc[g, d0:d0 + 16W] = sum over t of probs[g * n + (t - first)] * v_t[d0:d0 + 16W], the
// G x W accumulators in registers for the whole sequence.
template <int G, int W>
void paged_values_bf16(float* acc, int64_t head_dim, const float* probs,
                       const c10::BFloat16* vp, const int64_t* bt, int64_t first, int64_t len,
                       int64_t block_size, int64_t block_stride, int64_t token_stride) {
  const int64_t n = len - first;
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * W) {
    __m512 a[G][W];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) a[g][c] = _mm512_setzero_ps();
    for (int64_t t = first; t < len;) {
      const int64_t off = t % block_size, run = std::min(len - t, block_size - off);
      const c10::BFloat16* v = vp + bt[t / block_size] * block_stride + off * token_stride + d0;
      const float* p = probs + (t - first);
      for (int64_t j = 0; j < run; ++j) {
        if (j + kPrefetchTokens < run) prefetch_row(v + (j + kPrefetchTokens) * token_stride, W * 32);
        __m512 x[W];
        for (int c = 0; c < W; ++c) x[c] = bf16x16_load(v + j * token_stride + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 pg = _mm512_set1_ps(p[g * n + j]);
          for (int c = 0; c < W; ++c) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
        }
      }
      t += run;
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) _mm512_storeu_ps(acc + g * head_dim + d0 + 16 * c, a[g][c]);
  }
}

// acc[g, :] = sum over t of probs[g * pstride + (t - first)] * v_t for the G query heads
// of one KV head, with the probabilities in bfloat16: two tokens' values are interleaved
// in registers (unpacklo/hi of 16-bit words), so one BF16 dot product adds two tokens'
// terms for 16 dimensions, where float FMAs add one. A block's odd last token pairs with
// itself at probability zero. The accumulators hold each 128-bit lane's dimensions 0-3 and
// 4-7 apart; the store puts them back in order.
template <int G, int W>
void paged_values_pairs(float* acc, int64_t head_dim, const c10::BFloat16* probs,
                        int64_t pstride, const c10::BFloat16* vp, const int64_t* bt,
                        int64_t first, int64_t len, int64_t block_size, int64_t block_stride,
                        int64_t token_stride) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32 * W) {
    __m512 a[G][W][2];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) a[g][c][0] = a[g][c][1] = _mm512_setzero_ps();
    for (int64_t t = first; t < len;) {
      const int64_t off = t % block_size, run = std::min(len - t, block_size - off);
      const c10::BFloat16* v = vp + bt[t / block_size] * block_stride + off * token_stride + d0;
      const c10::BFloat16* p = probs + (t - first);
      auto step = [&](int64_t j, const c10::BFloat16* next, uint32_t mask) {
        __m512i lo[W], hi[W];
        for (int c = 0; c < W; ++c) {
          const __m512i x0 = _mm512_loadu_si512(v + j * token_stride + 32 * c);
          const __m512i x1 = _mm512_loadu_si512(next + 32 * c);
          lo[c] = _mm512_unpacklo_epi16(x0, x1);
          hi[c] = _mm512_unpackhi_epi16(x0, x1);
        }
        for (int g = 0; g < G; ++g) {
          uint32_t word;
          std::memcpy(&word, p + g * pstride + j, 4);
          const __m512bh pg = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(word & mask));
          for (int c = 0; c < W; ++c) {
            a[g][c][0] = _mm512_dpbf16_ps(a[g][c][0], pg, (__m512bh)lo[c]);
            a[g][c][1] = _mm512_dpbf16_ps(a[g][c][1], pg, (__m512bh)hi[c]);
          }
        }
      };
      int64_t j = 0;
      for (; j + 2 <= run; j += 2) {
        if (j + kPrefetchTokens < run) {
          prefetch_row(v + (j + kPrefetchTokens) * token_stride, W * 64);
          prefetch_row(v + (j + kPrefetchTokens + 1) * token_stride, W * 64);
        }
        step(j, v + (j + 1) * token_stride, 0xffffffffu);
      }
      // an odd last token: its pair is itself, at probability zero
      if (j < run) step(j, v + j * token_stride, 0xffffu);
      t += run;
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) {
        __m512 first, second;
        interleaved_in_order(a[g][c][0], a[g][c][1], first, second);
        _mm512_storeu_ps(acc + g * head_dim + d0 + 32 * c, first);
        _mm512_storeu_ps(acc + g * head_dim + d0 + 32 * c + 16, second);
      }
  }
}

// paged_values_bf16 for the G query heads of each of KV consecutive KV heads at once, 32
// dimensions of every KV head a pass: a token's rows are read in address order, as the
// scores read them (acc, probs: KV G heads, the KV heads' groups one after the other).
template <int KV, int G>
void paged_values_heads(float* acc, int64_t head_dim, const float* probs,
                        const c10::BFloat16* vp, const int64_t* bt, int64_t first, int64_t len,
                        int64_t block_size, int64_t block_stride, int64_t token_stride) {
  const int64_t n = len - first;
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m512 a[KV * G][2];
    for (int h = 0; h < KV * G; ++h) a[h][0] = a[h][1] = _mm512_setzero_ps();
    for (int64_t t = first; t < len;) {
      const int64_t off = t % block_size, run = std::min(len - t, block_size - off);
      const c10::BFloat16* v = vp + bt[t / block_size] * block_stride + off * token_stride + d0;
      const float* p = probs + (t - first);
      for (int64_t j = 0; j < run; ++j) {
        const c10::BFloat16* row = v + j * token_stride;
        for (int kv = 0; kv < KV; ++kv) {
          const __m512 x0 = bf16x16_load(row + kv * head_dim);
          const __m512 x1 = bf16x16_load(row + kv * head_dim + 16);
          for (int g = 0; g < G; ++g) {
            const int h = kv * G + g;
            const __m512 ph = _mm512_set1_ps(p[h * n + j]);
            a[h][0] = _mm512_fmadd_ps(ph, x0, a[h][0]);
            a[h][1] = _mm512_fmadd_ps(ph, x1, a[h][1]);
          }
        }
      }
      t += run;
    }
    for (int h = 0; h < KV * G; ++h) {
      _mm512_storeu_ps(acc + h * head_dim + d0, a[h][0]);
      _mm512_storeu_ps(acc + h * head_dim + d0 + 16, a[h][1]);
    }
  }
}

}  // namespace
}  // namespace attn
}  // namespace cpullm
