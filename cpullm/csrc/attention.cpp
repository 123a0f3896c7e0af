// Paged decode attention (one query per sequence, keys and values read in place from the
// KV cache blocks) and the causal softmax of prompt-chunk attention.
#include "amx.h"
#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace cpullm {

namespace {

constexpr float kNoSink = -std::numeric_limits<float>::infinity();

// Runs body(begin, end) over contiguous ranges of items [0, n), one range per thread, of
// about equal cost, where at::parallel_for would split by count: a decode item's cost is its
// sequence's context, and a thread holding the long ones keeps the others waiting.
// cost(i) >= 0 is item i's.
template <typename Cost, typename Body>
void parallel_by_cost(int64_t n, Cost&& cost, Body&& body) {
  std::vector<int64_t> prefix(n + 1, 0);  // prefix[i]: the cost of items [0, i)
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  auto start = [&](int64_t t) {  // the first item of thread t's range
    if (t == 0 || t == threads) return t == 0 ? int64_t{0} : n;
    return static_cast<int64_t>(
        std::lower_bound(prefix.begin(), prefix.end(), prefix[n] * t / threads) -
        prefix.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = start(t), end = start(t + 1);
      if (begin < end) body(begin, end);
    }
  });
}

// A decode item's (a sequence's KV head) cost: the tokens it reads, plus about 16 tokens'
// worth of setup.
inline int64_t decode_cost(const int64_t* lens, int64_t item, int64_t num_kv_heads,
                           int64_t window) {
  const int64_t len = lens[item / num_kv_heads];
  return (window > 0 ? std::min(len, window) : len) + 16;
}

// The sink logits of attention sinks, one float32 per query head, or nullptr.
const float* sink_logits(const c10::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
              sinks->numel() == num_heads, "attention sinks: ", num_heads,
              " contiguous float32 logits expected");
  return sinks->data_ptr<float>();
}

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

// Attention logit soft-capping (Gemma 2): each score s becomes cap * tanh(s / cap).
inline void soft_cap(float* scores, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

// out[s, h, :] = softmax(q[s, h, :] . K[s, :, kvh, :]^T * scale) @ V[s, :, kvh, :]
// where K/V of sequence s are read in place from its blocks:
//   token t lives at key_cache[block_tables[s, t / block_size], t % block_size, kvh, :]
template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, const float* sinks) {
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

  auto cost = [&](int64_t item) { return decode_cost(lens, item, num_kv_heads, window); };
  parallel_by_cost(num_seqs * num_kv_heads, cost, [&](int64_t begin, int64_t end) {
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
      if (softcap > 0) soft_cap(scores.data(), group * n, static_cast<float>(softcap));
      for (int64_t g = 0; g < group; ++g)
        softmax(scores.data() + g * n, n, sinks ? sinks[kvh * group + g] : kNoSink);
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

// The query groups of kv consecutive KV heads as the B operands of TDPBF16PS, one set of
// chunks per KV head: for KV head h's 32 dimensions c, 16 rows (dimension pairs) of 16
// columns (query heads, zero but for h's group) of 32-bit pairs:
// words[h chunks + c][r][h group + g] = (q_hg[32c + 2r], q_hg[32c + 2r + 1]). Chunk after
// chunk, they meet a token's keys of those KV heads as they lie side by side in its row.
inline void query_tiles(int32_t* words, const c10::BFloat16* q, int64_t group, int64_t kv,
                        int64_t head_dim) {
  const int64_t chunks = head_dim / 32;
  std::fill(words, words + kv * chunks * 256, 0);
  for (int64_t col = 0; col < kv * group; ++col) {
    const auto* qg = reinterpret_cast<const int32_t*>(q + col * head_dim);
    int32_t* head = words + (col / group) * chunks * 256;
    for (int64_t w = 0; w < chunks * 16; ++w) head[(w / 16) * 256 + (w % 16) * 16 + col] = qg[w];
  }
}

// (the tile of an AMX instruction is part of its text: a constant C picks a case)
template <int C>
__attribute__((target("amx-tile,amx-bf16"))) inline void load_query_tile(const int32_t* words) {
  const int32_t* w = words + 256 * C;
  switch (C) {
    case 0: _tile_loadd(2, w, 64); break;
    case 1: _tile_loadd(3, w, 64); break;
    case 2: _tile_loadd(4, w, 64); break;
    case 3: _tile_loadd(5, w, 64); break;
    case 4: _tile_loadd(6, w, 64); break;
    case 5: _tile_loadd(7, w, 64); break;
  }
}

// tmm0 += a's 32-dimension chunk C (into tmm1; rows `stride` bytes apart) times the query's
// (kept in tmm2 + C for up to 6 chunks; past that, loaded into tmm2 for each).
template <int CH, int C>
__attribute__((target("amx-tile,amx-bf16"))) inline void chunk_scores(
    const c10::BFloat16* a, int64_t stride, const int32_t* words) {
  _tile_loadd(1, a + 32 * C, stride);
  if constexpr (CH > 6) {
    _tile_loadd(2, words + 256 * C, 64);
    _tile_dpbf16ps(0, 1, 2);
    return;
  }
  switch (C) {
    case 0: _tile_dpbf16ps(0, 1, 2); break;
    case 1: _tile_dpbf16ps(0, 1, 3); break;
    case 2: _tile_dpbf16ps(0, 1, 4); break;
    case 3: _tile_dpbf16ps(0, 1, 5); break;
    case 4: _tile_dpbf16ps(0, 1, 6); break;
    case 5: _tile_dpbf16ps(0, 1, 7); break;
  }
}

// tmm0 = the scores of 16 tokens (rows of a) against the query: 16 x 16 (tokens x query
// heads) float32.
template <int CH, int... C>
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_scores(
    const c10::BFloat16* a, int64_t stride, const int32_t* words,
    std::integer_sequence<int, C...>) {
  _tile_zero(0);
  (chunk_scores<CH, C>(a, stride, words), ...);
}

template <int... C>
__attribute__((target("amx-tile,amx-bf16"))) inline void load_query_tiles(
    const int32_t* words, std::integer_sequence<int, C...>) {
  (load_query_tile<C>(words), ...);
}

// paged_scores_bf16 on AMX tiles: a tile of 16 tokens' keys, read where they lie in their
// block, times the query tiles gives 16 x 16 scores (tokens x query heads) at once, with no
// reduction across lanes. A tile that would run past its block's end (a short block, a
// window's start) is copied first. The tile configuration must be loaded.
template <int CH>
__attribute__((target("amx-tile,amx-bf16"))) void paged_scores_amx(
    float* scores, const int32_t* words, int64_t group, float scale, const c10::BFloat16* kp,
    const c10::BFloat16* vp, const int64_t* bt, int64_t first, int64_t len, int64_t block_size,
    int64_t block_stride, int64_t token_stride, int64_t ahead, NextItemPrefetch& next_item) {
  using Chunks = std::make_integer_sequence<int, CH>;
  if constexpr (CH <= 6) load_query_tiles(words, Chunks{});
  alignas(64) float product[16 * 16];
  alignas(64) c10::BFloat16 staging[16 * CH * 32];
  const int64_t n = len - first;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                           192, 208, 224, 240);
  for (int64_t t = first; t < len;) {
    const int64_t off = t % block_size, run = std::min(len - t, block_size - off);
    const int64_t base = bt[t / block_size] * block_stride + off * token_stride;
    const c10::BFloat16* k = kp + base;
    const c10::BFloat16* v = vp + base;
    // the keys `ahead` tokens ahead on their way, as in paged_scores_bf16: a tile load from
    // memory waits for its 16 lines
    for (int64_t j = 0; j < std::min(run, ahead); ++j) prefetch_row(k + j * token_stride, CH * 64);
    for (int64_t i = 0; i < run; i += 16) {
      const int64_t m = std::min<int64_t>(16, run - i);
      next_item.step(m);
      for (int64_t j = i + ahead; j < std::min(run, i + m + ahead); ++j)
        prefetch_row(k + j * token_stride, CH * 64);
      for (int64_t j = i; j < i + m; ++j) prefetch_row(v + j * token_stride, CH * 64);
      const c10::BFloat16* a = k + i * token_stride;
      int64_t stride = token_stride * 2;
      if (off + i + 16 > block_size) {  // rows past m are read but their scores dropped
        for (int64_t j = 0; j < m; ++j)
          std::memcpy(staging + j * CH * 32, a + j * token_stride, CH * 64);
        a = staging;
        stride = CH * 64;
      }
      tile_scores<CH>(a, stride, words, Chunks{});
      _tile_stored(0, product, 64);
      const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
      float* row = scores + (t - first) + i;
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(row + g * n, valid,
                              _mm512_mul_ps(_mm512_i32gather_ps(column, product + g, 4), vscale));
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

// Two accumulators of BF16 dot products on rows interleaved by unpacklo/hi of 16-bit words
// (each 128-bit lane's dimensions 0-3 in lo, 4-7 in hi) -> dimensions 0-15 and 16-31.
inline void interleaved_in_order(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i first_order =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_order =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  first = _mm512_permutex2var_ps(lo, first_order, hi);
  second = _mm512_permutex2var_ps(lo, second_order, hi);
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

using PagedScoresFn = void (*)(float*, const __m512bh*, int64_t, float, const c10::BFloat16*,
                               const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t,
                               int64_t, int64_t, NextItemPrefetch&);
using AmxScoresFn = void (*)(float*, const int32_t*, int64_t, float, const c10::BFloat16*,
                             const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, NextItemPrefetch&);
using PagedValuesFn = void (*)(float*, int64_t, const float*, const c10::BFloat16*,
                               const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t);
using PairValuesFn = void (*)(float*, int64_t, const c10::BFloat16*, int64_t,
                              const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t,
                              int64_t, int64_t);

// bfloat16 decode attention for head_dim a multiple of 32 up to 256 and up to 8 query heads
// per KV head, the scores on AMX tiles or not; returns false (nothing written) for other
// shapes.
bool decode_attention_bf16(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, const float* sinks, bool amx) {
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
  static constexpr AmxScoresFn kScoresAmx[] = {
      nullptr, paged_scores_amx<1>, paged_scores_amx<2>, paged_scores_amx<3>,
      paged_scores_amx<4>, paged_scores_amx<5>, paged_scores_amx<6>, paged_scores_amx<7>,
      paged_scores_amx<8>};
  const PagedScoresFn scores_fn = kScores[chunks];
  const PagedValuesFn values_fn =
      (head_dim % 64 == 0 && group <= 6) ? kValues4[group] : kValues2[group];
  // [KV - 2][G - 1]: 2 or 3 KV heads of up to 4 query heads (at most 24 accumulators)
  static constexpr PagedValuesFn kValuesHeads[2][4] = {
      {paged_values_heads<2, 1>, paged_values_heads<2, 2>, paged_values_heads<2, 3>,
       paged_values_heads<2, 4>},
      {paged_values_heads<3, 1>, paged_values_heads<3, 2>, paged_values_heads<3, 3>,
       paged_values_heads<3, 4>}};

  // Without AMX the values are summed two tokens a BF16 dot product, with the
  // probabilities rounded to bfloat16 as the prompt path's batched matmul rounds them.
  static constexpr PairValuesFn kPairs2[] = {
      nullptr, paged_values_pairs<1, 2>, paged_values_pairs<2, 2>, paged_values_pairs<3, 2>,
      paged_values_pairs<4, 2>, paged_values_pairs<5, 2>};
  static constexpr PairValuesFn kPairs1[] = {
      nullptr, paged_values_pairs<1, 1>, paged_values_pairs<2, 1>, paged_values_pairs<3, 1>,
      paged_values_pairs<4, 1>, paged_values_pairs<5, 1>, paged_values_pairs<6, 1>,
      paged_values_pairs<7, 1>, paged_values_pairs<8, 1>};
  const PairValuesFn pairs_fn =
      amx ? nullptr : (head_dim % 64 == 0 && group <= 5) ? kPairs2[group] : kPairs1[group];
  const int64_t max_blocks = block_tables.size(1), q_stride = q.stride(0);
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = key_cache.data_ptr<c10::BFloat16>();
  const auto* vp = value_cache.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const float fscale = static_cast<float>(scale);

  // An item is kv KV heads of one sequence. On AMX it is as many as keep their query heads
  // within one tile's 16 columns and their keys' chunks within the 6 query tiles kept
  // (SmolLM2: all 3 KV heads of 64, 9 query heads; a 1B Llama: 2 of its 8, 8 of its 32
  // query heads): the scores read those KV heads' keys of a token at once (SmolLM2: its
  // whole row), prefetched a few rows ahead, and the values of 2-3 KV heads are summed in
  // one pass over the rows per 32 dimensions, where one KV head at a time reads each row's
  // slice in as many passes. The next item is not prefetched then: its lines would compete
  // with the current rows'.
  int64_t kv = 1;
  if (amx)
    for (int64_t d = 2; d <= num_kv_heads; ++d)
      if (num_kv_heads % d == 0 && d * group <= 16 && d * chunks <= 6) kv = d;
  const bool several = kv > 1;
  const int64_t items_per_seq = num_kv_heads / kv, heads = kv * group;
  const int64_t ahead = several ? kSeveralHeadsPrefetchTokens : kPrefetchTokens;
  const AmxScoresFn amx_scores_fn = kScoresAmx[kv * chunks];
  const PagedValuesFn heads_values =
      several && kv <= 3 && group <= 4 ? kValuesHeads[kv - 2][group - 1] : nullptr;
  auto cost = [&](int64_t item) { return decode_cost(lens, item, items_per_seq, window); };
  parallel_by_cost(num_seqs * items_per_seq, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(heads * head_dim);
    std::vector<c10::BFloat16> probs;  // rows of pstride, the pairs' words read past n
    __m512bh query[64];
    alignas(64) int32_t words[8 * 256];
    if (amx) load_tile_config();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / items_per_seq, kvh = item % items_per_seq * kv;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const c10::BFloat16* qs = qp + s * q_stride + kvh * group * head_dim;
      if (amx) {
        query_tiles(words, qs, group, kv, head_dim);
      } else {
        for (int64_t i = 0; i < group * chunks; ++i)
          query[i] = (__m512bh)_mm512_loadu_si512(qs + i * 32);
      }
      scores.resize(heads * n);
      NextItemPrefetch next_item;
      if (item + 1 < end && !several) {
        const int64_t s2 = (item + 1) / items_per_seq, kvh2 = (item + 1) % items_per_seq * kv;
        const int64_t len2 = lens[s2];
        next_item = {kp + kvh2 * head_dim, vp + kvh2 * head_dim, bt + s2 * max_blocks,
                     window > 0 ? std::max<int64_t>(0, len2 - window) : 0, len2, block_size,
                     block_stride, token_stride, head_dim * 2};
      }
      if (amx) {
        amx_scores_fn(scores.data(), words, heads, fscale, kp + kvh * head_dim,
                      vp + kvh * head_dim, bt + s * max_blocks, first, len, block_size,
                      block_stride, token_stride, ahead, next_item);
      } else {
        scores_fn(scores.data(), query, group, fscale, kp + kvh * head_dim, vp + kvh * head_dim,
                  bt + s * max_blocks, first, len, block_size, block_stride, token_stride,
                  next_item);
      }
      next_item.step(next_item.len);  // what the scores did not reach (a longer next item)
      if (softcap > 0) soft_cap(scores.data(), heads * n, static_cast<float>(softcap));
      const float* sink = sinks ? sinks + kvh * group : nullptr;
      if (pairs_fn != nullptr) {
        const int64_t pstride = (n + 16) & ~int64_t{15};
        probs.resize(heads * pstride);
        for (int64_t h = 0; h < heads; ++h)
          softmax_to_bf16(probs.data() + h * pstride, scores.data() + h * n, n,
                          sink ? sink[h] : kNoSink);
        for (int64_t h = 0; h < kv; ++h)
          pairs_fn(acc.data() + h * group * head_dim, head_dim, probs.data() + h * group * pstride,
                   pstride, vp + (kvh + h) * head_dim, bt + s * max_blocks, first, len,
                   block_size, block_stride, token_stride);
      } else {
        for (int64_t h = 0; h < heads; ++h)
          softmax(scores.data() + h * n, n, sink ? sink[h] : kNoSink);
        if (heads_values != nullptr) {
          heads_values(acc.data(), head_dim, scores.data(), vp + kvh * head_dim,
                       bt + s * max_blocks, first, len, block_size, block_stride, token_stride);
        } else {
          for (int64_t h = 0; h < kv; ++h)
            values_fn(acc.data() + h * group * head_dim, head_dim, scores.data() + h * group * n,
                      vp + (kvh + h) * head_dim, bt + s * max_blocks, first, len, block_size,
                      block_stride, token_stride);
        }
      }
      c10::BFloat16* dst = op + (s * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < heads * head_dim; i += 16)
        bf16x16_store(dst + i, _mm512_loadu_ps(acc.data() + i));
    }
    if (amx) release_tiles();
  });
  return true;
}
#endif

}  // namespace

namespace {

void decode_attention_any(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale, int64_t window,
                          double softcap, const c10::optional<at::Tensor>& sinks, bool amx) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "decode_attention: bad q layout");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous(), "decode_attention: contiguous tensors expected");
  const float* sp = sink_logits(sinks, q.size(1));
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 &&
      decode_attention_bf16(out, q, key_cache, value_cache, block_tables, seq_lens, scale, window,
                            softcap, sp, amx))
    return;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, q, key_cache, value_cache, block_tables, seq_lens,
                                    scale, window, softcap, sp);
  });
}

}  // namespace

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                      at::Tensor block_tables, at::Tensor seq_lens, double scale,
                      int64_t window, double softcap, c10::optional<at::Tensor> sinks) {
  decode_attention_any(out, q, key_cache, value_cache, block_tables, seq_lens, scale, window,
                       softcap, sinks, false);
}

#if defined(__AVX512BF16__)
// decode_attention with the scores of bfloat16 caches on AMX tiles (other dtypes and shapes
// as decode_attention).
void decode_attention_amx(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                          at::Tensor value_cache, at::Tensor block_tables, at::Tensor seq_lens,
                          double scale, int64_t window, double softcap,
                          c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(amx_permitted(), "decode_attention_amx: the OS gives this process no AMX tiles");
  decode_attention_any(out, q, key_cache, value_cache, block_tables, seq_lens, scale, window,
                       softcap, sinks, true);
}
#endif

#if defined(__AVX512BF16__)
namespace {

constexpr int kPrefillKeys = 12;  // keys per register tile of the prompt scores
constexpr int kPrefillRows = 12;  // query rows per register tile of the values

// Scores of MR keys (rows ldk dwords apart from k, this KV head's part) against the 32
// query lanes of qpk ([k2][32] dword pairs), two vectors of 16 lanes: scores[(j * 2 + h) *
// 16 + lane] = scale * q . k_{t + j} where key t + j is in [lo, pos] of the lane, -inf
// elsewhere; vmax takes their maxima. Each broadcast key pair feeds two BF16 dot products.
template <int MR>
void prefill_scores_tile(float* scores, int64_t t, const int32_t* k, int64_t ldk,
                         const __m512bh* qpk, int64_t k2, __m512 scale, const __m512i* pos,
                         const __m512i* lo, __m512* vmax) {
  __m512 acc[MR][2];
  for (int j = 0; j < MR; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < k2; ++dp) {
    const __m512bh q0 = qpk[2 * dp], q1 = qpk[2 * dp + 1];
    for (int j = 0; j < MR; ++j) {
      const __m512bh key = (__m512bh)_mm512_set1_epi32(k[j * ldk + dp]);
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], key, q0);
      acc[j][1] = _mm512_dpbf16_ps(acc[j][1], key, q1);
    }
  }
  const __m512 masked = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < MR; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t + j));
    for (int h = 0; h < 2; ++h) {
      const __mmask16 seen =
          _mm512_cmple_epi32_mask(key, pos[h]) & _mm512_cmpge_epi32_mask(key, lo[h]);
      const __m512 s = _mm512_mask_mul_ps(masked, seen, acc[j][h], scale);
      vmax[h] = _mm512_max_ps(vmax[h], s);
      _mm512_storeu_ps(scores + (j * 2 + h) * 16, s);
    }
  }
}

using PrefillScoresTile = void (*)(float*, int64_t, const int32_t*, int64_t, const __m512bh*,
                                   int64_t, __m512, const __m512i*, const __m512i*, __m512*);
template <int... MR>
constexpr std::array<PrefillScoresTile, sizeof...(MR)> prefill_scores_tiles(
    std::integer_sequence<int, MR...>) {
  return {&prefill_scores_tile<MR + 1>...};
}

// 32 dimensions (from d0) of R output rows (out_rows[r]) = sum over key pairs tp of
// pairs[tp * 32 + r] . (v_{2tp}, v_{2tp+1}) * inv[r]: each dword of pairs holds a row's two
// unnormalized probabilities; unpacklo/hi of two keys' rows interleave their values, each
// 128-bit lane's dimensions 0-3 and 4-7 apart (the store puts them back in order).
template <int R>
void prefill_values_tile(c10::BFloat16* const* out_rows, const int32_t* pairs,
                         int64_t num_pairs, const c10::BFloat16* const* rows, int64_t num_rows,
                         int64_t d0, const float* inv) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t tp = 0; tp < num_pairs; ++tp) {
    const __m512i a = _mm512_loadu_si512(rows[2 * tp] + d0);
    // an odd last key pairs with itself, at probability zero
    const c10::BFloat16* second = 2 * tp + 1 < num_rows ? rows[2 * tp + 1] : rows[2 * tp];
    const __m512i b = _mm512_loadu_si512(second + d0);
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int r = 0; r < R; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pairs[tp * 32 + r]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pr, lo);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pr, hi);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(inv[r]);
    __m512 first, second;
    interleaved_in_order(acc[r][0], acc[r][1], first, second);
    bf16x16_store(out_rows[r] + d0, _mm512_mul_ps(first, scale));
    bf16x16_store(out_rows[r] + d0 + 16, _mm512_mul_ps(second, scale));
  }
}

using PrefillValuesTile = void (*)(c10::BFloat16* const*, const int32_t*, int64_t,
                                   const c10::BFloat16* const*, int64_t, int64_t, const float*);
template <int... R>
constexpr std::array<PrefillValuesTile, sizeof...(R)> prefill_values_tiles(
    std::integer_sequence<int, R...>) {
  return {&prefill_values_tile<R + 1>...};
}

}  // namespace

// Causal attention of prompt chunks on bfloat16 caches, read in place through the block
// tables (this step's keys and values already stored). q, out: [tokens, heads, dim], the
// chunks' tokens one after the other (query_lens[p] of chunk p, at positions starts[p]...).
// An item is up to 32 query rows of one chunk and KV head (32 / group positions, each with
// its group of query heads), one lane each: the scores of 12 keys at a time against the 32
// lanes (the keys' dimension pairs broadcast, the queries packed in pairs), keys past the
// last row's position skipped; then exp against each lane's maximum, the probabilities
// paired per two keys in bfloat16, and the values summed for 12 rows and 32 dimensions at a
// time, two keys per BF16 dot product. head_dim a multiple of 32 up to 256, at most 16
// query heads per KV head, no soft-cap or sinks (prefill_softmax_bf16's path has them).
void prefill_attention_bf16(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables, at::Tensor starts,
                            at::Tensor query_lens, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              key_cache.scalar_type() == at::kBFloat16 &&
              value_cache.scalar_type() == at::kBFloat16,
              "prefill_attention_bf16: bfloat16 tensors expected");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 &&
              out.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(1) == out.size(2),
              "prefill_attention_bf16: q and out [tokens, heads, dim], each token's heads "
              "contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
              key_cache.size(3) == q.size(2),
              "prefill_attention_bf16: contiguous caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
              starts.scalar_type() == at::kLong && starts.is_contiguous() &&
              query_lens.scalar_type() == at::kLong && query_lens.is_contiguous() &&
              block_tables.dim() == 2 && starts.numel() == block_tables.size(0) &&
              query_lens.numel() == block_tables.size(0),
              "prefill_attention_bf16: int64 block tables [chunks, blocks], starts and "
              "query_lens [chunks]");
  const int64_t tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t chunks = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 256 && num_heads % num_kv_heads == 0 &&
              num_heads / num_kv_heads <= 16,
              "prefill_attention_bf16: head_dim a multiple of 32 up to 256, at most 16 query "
              "heads per KV head");
  const int64_t group = num_heads / num_kv_heads, positions = 32 / group;
  const int64_t k2 = head_dim / 2;
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ql = query_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  // chunk p: its first token in q, its first item, its keys' offsets in the caches
  std::vector<int64_t> first_token(chunks + 1, 0), first_item(chunks + 1, 0);
  int64_t max_len = 0;
  for (int64_t p = 0; p < chunks; ++p) {
    TORCH_CHECK(ql[p] >= 0 && st[p] >= 0 && st[p] + ql[p] <= max_blocks * block_size,
                "prefill_attention_bf16: chunk ", p, " runs past its block table");
    first_token[p + 1] = first_token[p] + ql[p];
    first_item[p + 1] = first_item[p] + num_kv_heads * ((ql[p] + positions - 1) / positions);
    max_len = std::max(max_len, st[p] + ql[p]);
  }
  TORCH_CHECK(first_token[chunks] == tokens,
              "prefill_attention_bf16: the chunks' lengths do not add up to q's tokens");
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  std::vector<int64_t> offsets(chunks * max_len);  // [p][t]: key t's row in the caches
  for (int64_t p = 0; p < chunks; ++p)
    for (int64_t t = 0; t < st[p] + ql[p]; ++t)
      offsets[p * max_len + t] = bt[p * max_blocks + t / block_size] * block_stride +
                                 (t % block_size) * token_stride;

  static const auto score_tiles =
      prefill_scores_tiles(std::make_integer_sequence<int, kPrefillKeys>{});
  static const auto value_tiles =
      prefill_values_tiles(std::make_integer_sequence<int, kPrefillRows>{});
  const c10::BFloat16* qp = q.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const c10::BFloat16* kp = key_cache.data_ptr<c10::BFloat16>();
  const c10::BFloat16* vp = value_cache.data_ptr<c10::BFloat16>();
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  // item -> (chunk, KV head, first position)
  auto locate = [&](int64_t item, int64_t& p, int64_t& kvh, int64_t& i0) {
    p = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t per_head = (ql[p] + positions - 1) / positions, at = item - first_item[p];
    kvh = at / per_head;
    i0 = at % per_head * positions;
  };
  auto first_key = [&](int64_t pos) {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0};
  };
  auto cost = [&](int64_t item) {
    int64_t p, kvh, i0;
    locate(item, p, kvh, i0);
    const int64_t last = st[p] + std::min(ql[p], i0 + positions) - 1;
    return last + 1 - first_key(st[p] + i0) + 16;
  };
  parallel_by_cost(first_item[chunks], cost, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int32_t> pairs;
    std::vector<const c10::BFloat16*> rows;
    alignas(64) int32_t qpk[128 * 32];
    alignas(64) int32_t pos_lanes[32], lo_lanes[32];
    alignas(64) float sums[32], inv[32];
    c10::BFloat16* out_rows[32];
    for (int64_t item = begin; item < end; ++item) {
      int64_t p, kvh, i0;
      locate(item, p, kvh, i0);
      const int64_t count = std::min(positions, ql[p] - i0) * group;  // rows in use
      for (int64_t r = 0; r < 32; ++r) {  // lanes past count repeat the last row's mask
        const int64_t pos = st[p] + i0 + std::min(r, count - 1) / group;
        pos_lanes[r] = static_cast<int32_t>(pos);
        lo_lanes[r] = static_cast<int32_t>(first_key(pos));
      }
      // qpk[dp][r]: row r's pair dp (0 past count), 16 rows by 16 pairs a transpose
      for (int64_t r0 = 0; r0 < 32; r0 += 16)
        for (int64_t d0 = 0; d0 < k2; d0 += 16) {
          __m512i block[16];
          for (int64_t r = 0; r < 16; ++r)
            block[r] = r0 + r < count
                ? _mm512_loadu_si512(qp + (first_token[p] + i0 + (r0 + r) / group) * q_stride +
                                     (kvh * group + (r0 + r) % group) * head_dim + 2 * d0)
                : _mm512_setzero_si512();
          transpose16(block);
          for (int64_t d = 0; d < 16; ++d) _mm512_store_si512(qpk + (d0 + d) * 32 + r0, block[d]);
        }
      const int64_t t0 = lo_lanes[0], t1 = pos_lanes[count - 1] + 1, n = t1 - t0;
      const __m512i pos[2] = {_mm512_load_si512(pos_lanes), _mm512_load_si512(pos_lanes + 16)};
      const __m512i lo[2] = {_mm512_load_si512(lo_lanes), _mm512_load_si512(lo_lanes + 16)};
      const int64_t* off = offsets.data() + p * max_len;
      // the scores, 12 keys a tile, a block's run at a time
      scores.resize(n * 32);
      __m512 vmax[2] = {_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                        _mm512_set1_ps(-std::numeric_limits<float>::infinity())};
      for (int64_t t = t0; t < t1;) {
        const int64_t run = std::min(t1 - t, block_size - t % block_size);
        const int32_t* k = reinterpret_cast<const int32_t*>(kp + off[t] + kvh * head_dim);
        for (int64_t j = 0; j < run; j += kPrefillKeys) {
          const int64_t m = std::min<int64_t>(kPrefillKeys, run - j);
          score_tiles[m - 1](scores.data() + (t - t0 + j) * 32, t + j, k + j * token_stride / 2,
                             token_stride / 2, reinterpret_cast<const __m512bh*>(qpk), k2,
                             vscale, pos, lo, vmax);
        }
        t += run;
      }
      // exp against each lane's maximum (masked keys exactly 0), paired per two keys
      const int64_t num_pairs = (n + 1) / 2;
      pairs.resize(num_pairs * 32);
      const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                             25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                             18, 2, 17, 1, 16, 0);
      const __m512 masked = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      auto probability = [&](int64_t j, int h) {
        if (j >= n) return _mm512_setzero_ps();
        const __m512 s = _mm512_loadu_ps(scores.data() + (j * 2 + h) * 16);
        return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, masked, _CMP_NEQ_OQ),
                                   exp16(_mm512_sub_ps(s, vmax[h])));
      };
      __m512 vsum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t tp = 0; tp < num_pairs; ++tp)
        for (int h = 0; h < 2; ++h) {
          const __m512 e0 = probability(2 * tp, h), e1 = probability(2 * tp + 1, h);
          vsum[h] = _mm512_add_ps(vsum[h], _mm512_add_ps(e0, e1));
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0 low, e1 high
          _mm512_storeu_si512(pairs.data() + tp * 32 + h * 16,
                              _mm512_permutexvar_epi16(order, both));
        }
      _mm512_storeu_ps(sums, vsum[0]);
      _mm512_storeu_ps(sums + 16, vsum[1]);
      for (int64_t r = 0; r < count; ++r) inv[r] = 1.f / sums[r];
      // the values: 12 rows by 32 dimensions a pass
      rows.resize(n);
      for (int64_t j = 0; j < n; ++j) rows[j] = vp + off[t0 + j] + kvh * head_dim;
      for (int64_t r = 0; r < count; ++r)
        out_rows[r] = op + (first_token[p] + i0 + r / group) * out_stride +
                      (kvh * group + r % group) * head_dim;
      for (int64_t r0 = 0; r0 < count; r0 += kPrefillRows) {
        const int64_t r = std::min<int64_t>(kPrefillRows, count - r0);
        for (int64_t d0 = 0; d0 < head_dim; d0 += 32)
          value_tiles[r - 1](out_rows + r0, pairs.data() + r0, num_pairs, rows.data(), n, d0,
                             inv + r0);
      }
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// Causal softmax of prompt-chunk attention scores, in place, bfloat16 in and out:
// scores [num_prefills * num_kv_heads, group * max_q, max_len] hold q . k (unscaled) for
// query i of a chunk (position starts[seq] + i) against the keys at positions 0..max_len-1.
// Each row becomes softmax(scale * scores) over the keys the query may see (positions up to
// its own, and within the sliding window if any) and 0 elsewhere; padding rows (i at or past
// the chunk's length) become 0. softcap > 0: the scaled scores are soft-capped first.
void prefill_softmax_bf16(at::Tensor scores, at::Tensor starts, at::Tensor query_lens,
                          int64_t num_kv_heads, int64_t max_q, double scale, int64_t window,
                          double softcap, c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(scores.scalar_type() == at::kBFloat16 && scores.is_contiguous() &&
              starts.is_contiguous() && query_lens.is_contiguous(),
              "prefill_softmax_bf16: contiguous bfloat16 scores expected");
  const int64_t batches = scores.size(0), rows = scores.size(1), max_len = scores.size(2);
  const int64_t group = rows / max_q;
  const float* sink_of = sink_logits(sinks, num_kv_heads * group);
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
      float row_max = _mm512_reduce_max_ps(vmax);
      if (softcap > 0) {  // lanes outside [lo, hi) hold 0 and stay 0
        const float cap = static_cast<float>(softcap);
        soft_cap(buf.data(), hi - first, cap);
        row_max = cap * std::tanh(row_max / cap);  // tanh is increasing
      }
      // this row's head: (its KV head) * group + (its place in the group)
      const float sink = sink_of ? sink_of[item / rows % num_kv_heads * group +
                                           item % rows / max_q] : kNoSink;
      row_max = std::max(row_max, sink);
      const __m512 vm = _mm512_set1_ps(row_max);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = first; t < hi; t += 16) {
        const __m512 e = _mm512_maskz_mov_ps(
            lanes(t), exp16(_mm512_sub_ps(_mm512_loadu_ps(buf.data() + t - first), vm)));
        _mm512_storeu_ps(buf.data() + t - first, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      const __m512 inv = _mm512_set1_ps(
          1.f / (_mm512_reduce_add_ps(vsum) + std::exp(sink - row_max)));
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

}  // namespace cpullm
