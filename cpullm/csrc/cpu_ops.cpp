// Hot CPU kernels of cpullm: paged decode attention, the causal softmax of prompt
// attention, rotary embedding, bfloat16 RMSNorm, SiLU-mul and a GEMM, and the
// sampler's inverse-CDF draw.
//
// Built on first use by torch.utils.cpp_extension (cpullm/model_executor/layers/ops.py);
// the Python side falls back to plain torch ops when no compiler is available. All math
// is in float32 whatever the storage type (float, bfloat16, half); bfloat16 products go
// through the BF16 dot-product instruction, which sums them in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <sched.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

// row[0:n] = softmax(row[0:n]) in place.
inline void softmax(float* row, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
  float mx = _mm512_reduce_max_ps(vmax);
  for (; i < n; ++i) mx = std::max(mx, row[i]);
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), vm));
    _mm512_storeu_ps(row + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; i < n; ++i) { row[i] = std::exp(row[i] - mx); sum += row[i]; }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), inv));
  for (; i < n; ++i) row[i] *= 1.f / sum;
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

inline void softmax(float* row, int64_t n) {
  const float mx = *std::max_element(row, row + n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) { row[i] = std::exp(row[i] - mx); sum += row[i]; }
  for (int64_t i = 0; i < n; ++i) row[i] *= 1.f / sum;
}
#endif

// Scores of one query group against every key of one KV head of one sequence:
// scores[g * n + (t - first)] = q_g . k_t * scale.
template <typename T>
inline void group_scores(float* scores, const float* query, float scale, const T* kp,
                         const int64_t* bt,
                         int64_t first, int64_t len, int64_t group, int64_t head_dim,
                         int64_t block_size, int64_t block_stride, int64_t token_stride,
                         float* key) {
  const int64_t n = len - first;
  for (int64_t t = first; t < len; ++t) {
    const T* k = kp + bt[t / block_size] * block_stride + (t % block_size) * token_stride;
    load_row(key, k, head_dim);
    for (int64_t g = 0; g < group; ++g)
      scores[g * n + (t - first)] = dot(query + g * head_dim, key, head_dim) * scale;
  }
}

#if defined(__AVX512BF16__)
// bfloat16 keys: dot products straight from the cache with the BF16 dot-product instruction
// (pairs of bfloat16 products summed into float32), no conversion of the keys.
template <>
inline void group_scores<c10::BFloat16>(float* scores, const float* query, float scale,
                                        const c10::BFloat16* kp, const int64_t* bt,
                                        int64_t first, int64_t len, int64_t group,
                                        int64_t head_dim, int64_t block_size,
                                        int64_t block_stride, int64_t token_stride, float* key) {
  if (head_dim % 32 != 0 || head_dim > 256) {
    const int64_t n = len - first;
    for (int64_t t = first; t < len; ++t) {
      const c10::BFloat16* k = kp + bt[t / block_size] * block_stride +
                               (t % block_size) * token_stride;
      load_row(key, k, head_dim);
      for (int64_t g = 0; g < group; ++g)
        scores[g * n + (t - first)] = dot(query + g * head_dim, key, head_dim) * scale;
    }
    return;
  }
  const int64_t n = len - first, chunks = head_dim / 32;
  // The query holds bfloat16 values widened to float: narrowing them back is exact.
  std::vector<__m512bh> q(group * chunks);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c) {
      const float* src = query + g * head_dim + c * 32;
      q[g * chunks + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    }
  for (int64_t t = first; t < len; ++t) {
    const c10::BFloat16* k = kp + bt[t / block_size] * block_stride +
                             (t % block_size) * token_stride;
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        acc = _mm512_dpbf16_ps(acc, q[g * chunks + c], (__m512bh)_mm512_loadu_si512(k + c * 32));
      scores[g * n + (t - first)] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}
#endif

// acc[g, :] = sum over t of probs[g * n + (t - first)] * v_t, for one KV head of a sequence.
// (bfloat16 caches take decode_attention_bf16 below for every shape it covers.)
template <typename T>
inline void weighted_values(float* acc, const float* probs, const T* vp, const int64_t* bt,
                            int64_t first, int64_t len, int64_t group, int64_t head_dim,
                            int64_t block_size, int64_t block_stride, int64_t token_stride,
                            float* value) {
  const int64_t n = len - first;
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t = first; t < len; ++t) {
    const T* v = vp + bt[t / block_size] * block_stride + (t % block_size) * token_stride;
    load_row(value, v, head_dim);
    for (int64_t g = 0; g < group; ++g)
      axpy(acc + g * head_dim, probs[g * n + (t - first)], value, head_dim);
  }
}

// out[s, h, :] = softmax(q[s, h, :] . K[s, :, kvh, :]^T * scale) @ V[s, :, kvh, :]
// where K/V of sequence s are read in place from its blocks:
//   token t lives at key_cache[block_tables[s, t / block_size], t % block_size, kvh, :]
template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);  // q may be a view into the fused QKV output
  const T* kp = key_cache.data_ptr<T>();
  const T* vp = value_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t token_stride = num_kv_heads * head_dim;   // between slots of a block
  const int64_t block_stride = block_size * token_stride;  // between blocks
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores;
    std::vector<float> key(head_dim), value(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + s * q_stride + (kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = to_f(src[d]);
      }
      scores.assign(group * n, 0.f);
      group_scores(scores.data(), query.data(), fscale, kp + kvh * head_dim, bt + s * max_blocks,
                   first, len, group, head_dim, block_size, block_stride, token_stride,
                   key.data());
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
      weighted_values(acc.data(), scores.data(), vp + kvh * head_dim, bt + s * max_blocks,
                      first, len, group, head_dim, block_size, block_stride, token_stride,
                      value.data());
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (s * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// 16 bfloat16 <-> 16 float32; the narrowing rounds to nearest even, as torch does.
inline __m512 bf16x16_load(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void bf16x16_store(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 bf16_round(__m512 v) {  // float32 -> nearest bfloat16 -> float32
  __m256i raw = (__m256i)_mm512_cvtneps_pbh(v);
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

// How far ahead (in tokens) the paged loops prefetch: the loads of one token depend on
// nothing, but without hints too few of them are in flight to use the memory bandwidth.
constexpr int64_t kPrefetchTokens = 16;

inline void prefetch_row_l2(const c10::BFloat16* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T1);
}

inline void prefetch_row(const c10::BFloat16* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

// Walks the keys and values of the item a thread takes next, a few rows per call, into
// L2: spread over the current item's work, it runs a whole item ahead of use.
struct NextItemPrefetch {
  const c10::BFloat16* kp = nullptr;  // at the item's KV head
  const c10::BFloat16* vp = nullptr;
  const int64_t* bt = nullptr;
  int64_t t = 0, len = 0, block_size = 1, block_stride = 0, token_stride = 0, bytes = 0;

  void step(int64_t rows) {
    for (const int64_t stop = std::min(len, t + rows); t < stop; ++t) {
      const int64_t at = bt[t / block_size] * block_stride + (t % block_size) * token_stride;
      prefetch_row_l2(kp + at, bytes);
      prefetch_row_l2(vp + at, bytes);
    }
  }
};

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
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc[16];
        for (int64_t j = 0; j < m; ++j) {
          const c10::BFloat16* kr = k + (i + j) * token_stride;
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < CH; ++c)
            a = _mm512_dpbf16_ps(a, q[g * CH + c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
          acc[j] = a;
        }
        if (m == 16) {
          _mm512_storeu_ps(row + g * n + i, _mm512_mul_ps(reduce16(acc), vscale));
        } else {
          for (int64_t j = 0; j < m; ++j) row[g * n + i + j] = _mm512_reduce_add_ps(acc[j]) * scale;
        }
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

using PagedScoresFn = void (*)(float*, const __m512bh*, int64_t, float, const c10::BFloat16*,
                               const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, NextItemPrefetch&);
using PagedValuesFn = void (*)(float*, int64_t, const float*, const c10::BFloat16*,
                               const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t);

// bfloat16 decode attention for head_dim a multiple of 32 up to 256 and up to 8 query heads
// per KV head; returns false (nothing written) for other shapes.
bool decode_attention_bf16(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, chunks = head_dim / 32;
  if (head_dim % 32 != 0 || chunks > 8 || group > 8) return false;
  static constexpr PagedScoresFn kScores[] = {
      nullptr, paged_scores_bf16<1>, paged_scores_bf16<2>, paged_scores_bf16<3>,
      paged_scores_bf16<4>, paged_scores_bf16<5>, paged_scores_bf16<6>, paged_scores_bf16<7>,
      paged_scores_bf16<8>};
  // Four vectors (64 dims) per pass where the registers allow, else two (32 dims).
  static constexpr PagedValuesFn kValues4[] = {
      nullptr, paged_values_bf16<1, 4>, paged_values_bf16<2, 4>, paged_values_bf16<3, 4>,
      paged_values_bf16<4, 4>, paged_values_bf16<5, 4>, paged_values_bf16<6, 4>};
  static constexpr PagedValuesFn kValues2[] = {
      nullptr, paged_values_bf16<1, 2>, paged_values_bf16<2, 2>, paged_values_bf16<3, 2>,
      paged_values_bf16<4, 2>, paged_values_bf16<5, 2>, paged_values_bf16<6, 2>,
      paged_values_bf16<7, 2>, paged_values_bf16<8, 2>};
  const PagedScoresFn scores_fn = kScores[chunks];
  const PagedValuesFn values_fn =
      (head_dim % 64 == 0 && group <= 6) ? kValues4[group] : kValues2[group];

  const int64_t max_blocks = block_tables.size(1), q_stride = q.stride(0);
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = key_cache.data_ptr<c10::BFloat16>();
  const auto* vp = value_cache.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * head_dim);
    __m512bh query[64];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const c10::BFloat16* qs = qp + s * q_stride + kvh * group * head_dim;
      for (int64_t i = 0; i < group * chunks; ++i)
        query[i] = (__m512bh)_mm512_loadu_si512(qs + i * 32);
      scores.resize(group * n);
      NextItemPrefetch next_item;
      if (item + 1 < end) {
        const int64_t s2 = (item + 1) / num_kv_heads, kvh2 = (item + 1) % num_kv_heads;
        const int64_t len2 = lens[s2];
        next_item = {kp + kvh2 * head_dim, vp + kvh2 * head_dim, bt + s2 * max_blocks,
                     window > 0 ? std::max<int64_t>(0, len2 - window) : 0, len2, block_size,
                     block_stride, token_stride, head_dim * 2};
      }
      scores_fn(scores.data(), query, group, fscale, kp + kvh * head_dim, vp + kvh * head_dim,
                bt + s * max_blocks, first, len, block_size, block_stride, token_stride,
                next_item);
      next_item.step(next_item.len);  // what the scores did not reach (a longer next item)
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
      values_fn(acc.data(), head_dim, scores.data(), vp + kvh * head_dim, bt + s * max_blocks,
                first, len, block_size, block_stride, token_stride);
      c10::BFloat16* dst = op + (s * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; i += 16)
        bf16x16_store(dst + i, _mm512_loadu_ps(acc.data() + i));
    }
  });
  return true;
}
#endif

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                      at::Tensor block_tables, at::Tensor seq_lens, double scale,
                      int64_t window) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "decode_attention: bad q layout");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous(), "decode_attention: contiguous tensors expected");
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 &&
      decode_attention_bf16(out, q, key_cache, value_cache, block_tables, seq_lens, scale, window))
    return;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, q, key_cache, value_cache, block_tables, seq_lens,
                                    scale, window);
  });
}

// In place, rotate-half layout: x = x * cos + rotate_half(x) * sin, per head.
// cos/sin: [max_position, head_dim] float32; x: [num_tokens, num_heads, head_dim].
template <typename T>
void rotary_one(T* x, int64_t token_stride, const int64_t* positions, const float* cos,
                const float* sin, int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, grain_for(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * token_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
          // Products rounded as the unfused ops round them, then added.
          const T a = static_cast<T>(x1 * to_f(static_cast<T>(c[i])));
          const T b = static_cast<T>(-x2 * to_f(static_cast<T>(s[i])));
          const T e = static_cast<T>(x2 * to_f(static_cast<T>(c[i + half])));
          const T f = static_cast<T>(x1 * to_f(static_cast<T>(s[i + half])));
          v[i] = static_cast<T>(to_f(a) + to_f(b));
          v[i + half] = static_cast<T>(to_f(e) + to_f(f));
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin) {
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2),
                "rotary_embedding: heads must be contiguous within a token");
  TORCH_CHECK(positions.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: contiguous tables expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotary_one<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), positions.data_ptr<int64_t>(),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), q.size(0), q.size(1),
                         q.size(2));
    rotary_one<scalar_t>(k.data_ptr<scalar_t>(), k.stride(0), positions.data_ptr<int64_t>(),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), k.size(0), k.size(1),
                         k.size(2));
  });
}


#if defined(__AVX512BF16__)

// bfloat16 RMSNorm: with a residual, residual = x + residual and x = norm(residual) * w,
// in place; without, out = norm(x) * w. Rounds where the unfused torch ops round.
void rms_norm_bf16(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual,
                   at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && out.is_contiguous() &&
              weight.is_contiguous(), "rms_norm_bf16: contiguous bfloat16 tensors expected");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(dim % 16 == 0, "rms_norm_bf16: hidden size must be a multiple of 16");
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  c10::BFloat16* rp = residual.has_value() ? residual->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      __m512 sq = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        __m512 v = bf16x16_load(xp + r * dim + d);
        if (rp != nullptr) {
          v = bf16_round(_mm512_add_ps(v, bf16x16_load(rp + r * dim + d)));
          bf16x16_store(rp + r * dim + d, v);
        }
        _mm512_storeu_ps(buf.data() + d, v);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(dim) +
                                        static_cast<float>(eps));
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 normed = bf16_round(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + d), vinv));
        bf16x16_store(op + r * dim + d, _mm512_mul_ps(bf16x16_load(wp + d), normed));
      }
    }
  });
}

// bfloat16 out[r, :d] = silu(x[r, :d]) * x[r, d:], rounding like silu() then mul.
void silu_and_mul_bf16(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && out.is_contiguous(),
              "silu_and_mul_bf16: contiguous bfloat16 tensors expected");
  const int64_t d = out.size(-1), rows = out.numel() / d;
  TORCH_CHECK(d % 16 == 0, "silu_and_mul_bf16: width must be a multiple of 16");
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, grain_for(3 * d), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 g = bf16x16_load(xp + r * 2 * d + i);
        const __m512 u = bf16x16_load(xp + r * 2 * d + d + i);
        const __m512 act = bf16_round(
            _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        bf16x16_store(op + r * d + i, _mm512_mul_ps(act, u));
      }
    }
  });
}
// bfloat16 x @ W.T for any number of rows, with W packed once into panels of 32 output
// columns: panels[p][kk][c][j] = W[32p + c][2kk + j]. One 128-byte row of a panel holds the
// (k, k+1) pairs of 32 columns, what two dpbf16 instructions multiply with a broadcast pair
// of x. Each thread takes a contiguous run of panels; for each it walks the rows of x in
// tiles of up to 12 (24 accumulators), and while it computes the first tile it prefetches
// its next panel into L2, so weights that come from memory (every decode step reads them
// all once) stream in behind the arithmetic instead of stalling it.
//
// With silu_mul, each panel holds 16 gate columns then the 16 matching up columns (the
// caller interleaves a merged gate-up weight so), and the store writes
// silu(gate) * up, rounded where silu_and_mul_bf16 rounds, into an output half as wide.
constexpr int kGemmRows = 12;
constexpr int64_t kGemmBlockRows = 264;  // rows of x a thread keeps in L2 across its panels

template <int MR, bool PREFETCH, bool SILU_MUL>
void gemm_tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t k2,
               const c10::BFloat16* bias, c10::BFloat16* out, int64_t ldo, const char* next) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // (k, k+1) pairs
  const int64_t ldx2 = ldx / 2;
  for (int64_t kk = 0; kk < k2; ++kk) {
    if (PREFETCH) {
      _mm_prefetch(next + kk * 128, _MM_HINT_T1);
      _mm_prefetch(next + kk * 128 + 64, _MM_HINT_T1);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + kk * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + kk * 64 + 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[r * ldx2 + kk]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias0 = bf16x16_load(bias);
    bias1 = bf16x16_load(bias + 16);
  }
  for (int r = 0; r < MR; ++r) {
    if (SILU_MUL) {
      const __m512 gate = bf16_round(_mm512_add_ps(acc[r][0], bias0));
      const __m512 up = bf16_round(_mm512_add_ps(acc[r][1], bias1));
      const __m512 act = bf16_round(_mm512_div_ps(
          gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
      bf16x16_store(out + r * ldo, _mm512_mul_ps(act, up));
    } else {
      bf16x16_store(out + r * ldo, _mm512_add_ps(acc[r][0], bias0));
      bf16x16_store(out + r * ldo + 16, _mm512_add_ps(acc[r][1], bias1));
    }
  }
}

using GemmTile = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                          const c10::BFloat16*, c10::BFloat16*, int64_t, const char*);
using GemmTiles = std::array<GemmTile, kGemmRows>;

// tiles<PREFETCH, SILU_MUL>[rows - 1] computes a tile of that many rows.
template <bool PREFETCH, bool SILU_MUL, int... MR>
constexpr GemmTiles gemm_tiles(std::integer_sequence<int, MR...>) {
  return GemmTiles{&gemm_tile<MR + 1, PREFETCH, SILU_MUL>...};
}

void gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias,
               bool silu_mul) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "gemm_bf16: bfloat16 tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 2 == 0 && out.is_contiguous() &&
              panels.is_contiguous() && panels.dim() == 4 && panels.size(2) == 32 &&
              panels.size(3) == 2, "gemm_bf16: rows of x, packed panels [N/32, K/2, 32, 2]");
  const int64_t m = x.size(0), k2 = panels.size(1), n = panels.size(0) * 32;
  const int64_t width = silu_mul ? n / 2 : n, panel_width = silu_mul ? 16 : 32;
  TORCH_CHECK(x.size(1) == 2 * k2 && out.size(0) == m && out.size(1) == width,
              "gemm_bf16: shapes do not match");
  using Rows = std::make_integer_sequence<int, kGemmRows>;
  static const GemmTiles tables[2][2] = {
      {gemm_tiles<false, false>(Rows{}), gemm_tiles<false, true>(Rows{})},
      {gemm_tiles<true, false>(Rows{}), gemm_tiles<true, true>(Rows{})}};
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = panels.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), panel_size = k2 * 64;
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kGemmBlockRows) {
      const int64_t r1 = std::min(m, r0 + kGemmBlockRows);
      for (int64_t p = begin; p < end; ++p) {
        const c10::BFloat16* panel = wp + p * panel_size;
        const char* next = reinterpret_cast<const char*>(panel + panel_size);
        const c10::BFloat16* pb = bp != nullptr ? bp + p * 32 : nullptr;
        for (int64_t r = r0; r < r1; r += kGemmRows) {
          const int64_t rows = std::min<int64_t>(kGemmRows, r1 - r);
          const GemmTiles& table = tables[r == 0 && p + 1 < end][silu_mul];
          table[rows - 1](xp + r * ldx, ldx, panel, k2, pb, op + r * width + p * panel_width,
                          width, next);
        }
      }
    }
  });
}
#endif

#if defined(__AVX512F__)
// One draw per row from softmax(logits[r] / temperature[r]): the first token whose
// cumulative weight exceeds uniform[r] times the total (inverse-CDF sampling, as
// searchsorted over a cumulative sum does it, without materializing either).
// logits: [rows, vocab] float32; temperature, uniform: [rows] float32; returns [rows] int64.
at::Tensor sample_from_logits(at::Tensor logits, at::Tensor temperature, at::Tensor uniform) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && temperature.scalar_type() == at::kFloat &&
              uniform.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
              temperature.is_contiguous() && uniform.is_contiguous(),
              "sample_from_logits: float32 rows expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, at::kLong);
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const float* up = uniform.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t chunks = vocab / 16;  // full 16-wide chunks; the tail is scalar
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab), chunk_sums(chunks + 1);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * stride;
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < chunks; ++c) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + 16 * c));
      float mx = _mm512_reduce_max_ps(vmax);
      for (int64_t i = chunks * 16; i < vocab; ++i) mx = std::max(mx, x[i]);
      const float inv_t = 1.f / tp[r];
      const __m512 vm = _mm512_set1_ps(mx), vinv = _mm512_set1_ps(inv_t);
      const __m512 vninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      // weights and per-chunk sums; the total is the sum of the chunk sums, in order, so
      // the scan below reaches it exactly.
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 xv = _mm512_loadu_ps(x + 16 * c);
        // exp16 clamps its input, so masked tokens (-inf) are zeroed explicitly.
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(xv, vninf, _CMP_NEQ_UQ),
                                             exp16(_mm512_mul_ps(_mm512_sub_ps(xv, vm), vinv)));
        _mm512_storeu_ps(weights.data() + 16 * c, e);
        chunk_sums[c] = _mm512_reduce_add_ps(e);
        total += chunk_sums[c];
      }
      float tail = 0.f;
      for (int64_t i = chunks * 16; i < vocab; ++i) {
        weights[i] = std::exp((x[i] - mx) * inv_t);
        tail += weights[i];
      }
      chunk_sums[chunks] = tail;
      total += tail;
      const float target = up[r] * total;
      int64_t token = -1, last_nonzero = 0;
      float running = 0.f;
      for (int64_t c = 0; c <= chunks && token < 0; ++c) {
        if (chunk_sums[c] <= 0.f) continue;
        const int64_t lo = 16 * c, hi = std::min(vocab, lo + 16);
        if (running + chunk_sums[c] <= target && c < chunks) {
          running += chunk_sums[c];
          for (int64_t i = hi - 1; i >= lo; --i)
            if (weights[i] > 0.f) { last_nonzero = i; break; }
          continue;
        }
        for (int64_t i = lo; i < hi; ++i) {
          if (weights[i] <= 0.f) continue;
          last_nonzero = i;
          running += weights[i];
          if (running > target) { token = i; break; }
        }
      }
      // Rounding inside the last chunk can leave the scan just short: the last token with
      // any weight is then the draw.
      out[r] = token >= 0 ? token : last_nonzero;
    }
  });
  return tokens;
}
#endif

#if defined(__AVX512BF16__)
// Causal softmax of prompt-chunk attention scores, in place, bfloat16 in and out:
// scores [num_prefills * num_kv_heads, group * max_q, max_len] hold q . k (unscaled) for
// query i of a chunk (position starts[seq] + i) against the keys at positions 0..max_len-1.
// Each row becomes softmax(scale * scores) over the keys the query may see (positions up to
// its own, and within the sliding window if any) and 0 elsewhere; padding rows (i at or past
// the chunk's length) become 0.
void prefill_softmax_bf16(at::Tensor scores, at::Tensor starts, at::Tensor query_lens,
                          int64_t num_kv_heads, int64_t max_q, double scale, int64_t window) {
  TORCH_CHECK(scores.scalar_type() == at::kBFloat16 && scores.is_contiguous() &&
              starts.is_contiguous() && query_lens.is_contiguous(),
              "prefill_softmax_bf16: contiguous bfloat16 scores expected");
  const int64_t batches = scores.size(0), rows = scores.size(1), max_len = scores.size(2);
  c10::BFloat16* sp = scores.data_ptr<c10::BFloat16>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ql = query_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, batches * rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(max_len + 16);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / rows / num_kv_heads, i = item % rows % max_q;
      c10::BFloat16* row = sp + item * max_len;
      const int64_t pos = st[seq] + i;
      const int64_t lo = (i >= ql[seq]) ? max_len : (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
      const int64_t hi = (i >= ql[seq]) ? max_len : std::min(max_len, pos + 1);  // [lo, hi)
      if (lo >= hi) {
        std::memset(static_cast<void*>(row), 0, max_len * sizeof(c10::BFloat16));
        continue;
      }
      // Vectors of 16 from a multiple of 16 below lo; lanes outside [lo, hi) are masked.
      const int64_t first = lo & ~int64_t{15};
      const auto lanes = [&](int64_t t) -> __mmask16 {
        const int64_t a = std::max<int64_t>(lo - t, 0), b = std::min<int64_t>(hi - t, 16);
        return a >= b ? 0 : static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
      };
      const __m512 vscale = _mm512_set1_ps(fscale);
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = first; t < hi; t += 16) {
        const __mmask16 m = lanes(t);
        const __m256i raw = _mm256_maskz_loadu_epi16(m, row + t);
        const __m512 v = _mm512_mul_ps(
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)), vscale);
        _mm512_storeu_ps(buf.data() + t - first, v);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
      }
      const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = first; t < hi; t += 16) {
        const __m512 e = _mm512_maskz_mov_ps(
            lanes(t), exp16(_mm512_sub_ps(_mm512_loadu_ps(buf.data() + t - first), vm)));
        _mm512_storeu_ps(buf.data() + t - first, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
      const __m256i zero = _mm256_setzero_si256();
      for (int64_t t = 0; t < max_len; t += 16) {
        const __mmask16 in_row = static_cast<__mmask16>(
            max_len - t >= 16 ? 0xFFFF : (1u << (max_len - t)) - 1);
        __m256i out = zero;
        if (t >= first && t < hi)  // masked lanes of buf hold 0
          out = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + t - first), inv));
        _mm256_mask_storeu_epi16(row + t, in_row, out);
      }
    }
  });
}
#endif

bool has_bf16_kernels() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Pin torch's intra-op threads one per CPU: thread i of the pool runs on cpus[i]. With as
// many items as threads, at::parallel_for hands item i to thread i.
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  at::set_num_threads(static_cast<int>(n));
  std::vector<int64_t> result(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) result[i] = cpus[i];
    }
  });
  return result;  // the CPU each thread got, -1 where the kernel refused
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged attention, one query per sequence");
  m.def("bind_threads", &bind_threads, "pin intra-op threads, one per CPU");
  m.def("has_bf16_kernels", &has_bf16_kernels, "whether the bfloat16 kernels below exist");
#if defined(__AVX512BF16__)
  m.def("rms_norm_bf16", &rms_norm_bf16, "bfloat16 RMSNorm, optionally fused with the residual add");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "bfloat16 silu(gate) * up");
  m.def("gemm_bf16", &gemm_bf16, "bfloat16 x @ w.T with w packed in 32-column panels, "
        "optionally silu(gate) * up of interleaved gate and up panels");
  m.def("prefill_softmax_bf16", &prefill_softmax_bf16,
        "causal softmax of prompt-chunk attention scores, in place");
#endif
  m.def("rotary_embedding", &rotary_embedding, "rotate-half rotary embedding, in place");
#if defined(__AVX512F__)
  m.def("sample_from_logits", &sample_from_logits, "one inverse-CDF draw per row of logits");
#endif
}
