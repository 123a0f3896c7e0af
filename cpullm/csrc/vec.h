// Vector helpers shared by cpullm's CPU kernels: float conversion and loads, dot products,
// exp and softmax on 16 floats, bfloat16 <-> float32 on 16 lanes, reductions and prefetches.
// All math is in float32 whatever the storage type (float, bfloat16, half); bfloat16
// products go through the BF16 dot-product instruction, which sums them in float32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cpullm {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Items per thread for an elementwise kernel whose items have `width` elements: below
// about 32K elements a second thread costs more (a wake-up, and a wait on a thread that
// may be descheduled) than it saves.
inline int64_t grain_for(int64_t width) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(width, 1));
}

// dst[0:n] = float(src[0:n]); n is a multiple of 16 on the vector path.
template <typename T>
inline void load_row(float* dst, const T* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d]);
}

#if defined(__AVX512F__)
template <>
inline void load_row<c10::BFloat16>(float* dst, const c10::BFloat16* src, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    // bfloat16 is the upper half of a float32: widen and shift.
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(wide));
  }
  for (; d < n; ++d) dst[d] = to_f(src[d]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  int64_t d = 0;
  const __m512 va = _mm512_set1_ps(alpha);
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(y + d, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
  for (; d < n; ++d) y[d] += alpha * x[d];
}

// e^x for 16 floats: 2^(x log2 e) split into 2^n * 2^f, |f| <= 1/2, with 2^f from its
// Taylor series to degree 6 (relative error about 1e-7).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// row[0:n] = exp(row[0:n] - max) in place; returns 1 / the sum of them, a finite ``sink``
// one more logit of the denominator, attached to no value (attention sinks).
inline float softmax_exp(float* row, int64_t n, float sink) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
  float mx = std::max(_mm512_reduce_max_ps(vmax), sink);
  for (; i < n; ++i) mx = std::max(mx, row[i]);
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), vm));
    _mm512_storeu_ps(row + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum) + std::exp(sink - mx);
  for (; i < n; ++i) { row[i] = std::exp(row[i] - mx); sum += row[i]; }
  return 1.f / sum;
}

// softmax of row[0:n] in place (``sink``: as softmax_exp).
inline void softmax(float* row, int64_t n,
                    float sink = -std::numeric_limits<float>::infinity()) {
  const float inv = softmax_exp(row, n, sink);
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), vinv));
  for (; i < n; ++i) row[i] *= inv;
}

#if defined(__AVX512BF16__)
// out[0:n] = softmax(row[0:n]) rounded to bfloat16 (row is left holding the exponentials).
inline void softmax_to_bf16(c10::BFloat16* out, float* row, int64_t n, float sink) {
  const float inv = softmax_exp(row, n, sink);
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + i), vinv)));
  for (; i < n; ++i) out[i] = c10::BFloat16(row[i] * inv);
}
#endif

// 16 bfloat16 -> 16 float32 (bfloat16 is the upper half of a float32).
inline __m512 bf16x16_load(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// lane i of the result = the sum of the 16 lanes of v[i]: 45 shuffles and adds for 16
// dot products instead of a full horizontal reduction each.
inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], partial over 4 lanes
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                 _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                 _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z, w, 0x88), _mm512_shuffle_f32x4(z, w, 0xDD));
}

#else
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

inline void softmax(float* row, int64_t n,
                    float sink = -std::numeric_limits<float>::infinity()) {
  const float mx = std::max(*std::max_element(row, row + n), sink);
  float sum = std::exp(sink - mx);
  for (int64_t i = 0; i < n; ++i) { row[i] = std::exp(row[i] - mx); sum += row[i]; }
  for (int64_t i = 0; i < n; ++i) row[i] *= 1.f / sum;
}
#endif

#if defined(__AVX512F__)
// In place: v[i] lane j <- v[j] lane i (a 16 x 16 transpose of 32-bit values).
inline void transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // now v[4a + b] holds, per 128-bit lane q, element (row 4q' + ...) -- finish across lanes
  for (int i = 0; i < 16; i += 8)
    for (int b = 0; b < 4; ++b) {
      t[i + b] = _mm512_shuffle_i32x4(v[i + b], v[i + 4 + b], 0x88);
      t[i + 4 + b] = _mm512_shuffle_i32x4(v[i + b], v[i + 4 + b], 0xDD);
    }
  for (int b = 0; b < 8; ++b) {
    v[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);
    v[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xDD);
  }
}
#endif

#if defined(__AVX512BF16__)
// 16 float32 -> 16 bfloat16, rounded to nearest even, as torch does.
inline void bf16x16_store(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
// A GEMM's 16 float32 sums stored as its output's type: bfloat16 (rounded as above), or
// float32 as they are (the LM head's logits, whose bfloat16 rounding ties close tokens).
inline void store16(c10::BFloat16* p, __m512 v) { bf16x16_store(p, v); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 bf16_round(__m512 v) {  // float32 -> nearest bfloat16 -> float32
  __m256i raw = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// How far ahead (in tokens) the paged loops prefetch: the loads of one token depend on
// nothing, but without hints too few of them are in flight to use the memory bandwidth.
constexpr int64_t kPrefetchTokens = 16;
// ... and where several KV heads of each token's row are read at once
constexpr int64_t kSeveralHeadsPrefetchTokens = 8;

inline void prefetch_row_l2(const c10::BFloat16* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T1);
}

inline void prefetch_row(const c10::BFloat16* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}
#elif defined(__AVX512F__)
// Without AVX-512 BF16: the same rounding to nearest even in integer steps (NaN as torch
// writes it).
inline void bf16x16_store(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan,
                                                                  _mm512_set1_epi32(0x7FC0))));
}
#endif

}  // namespace cpullm
