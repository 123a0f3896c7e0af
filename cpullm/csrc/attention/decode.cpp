// Paged decode attention: one query per sequence, keys and values read in place from the
// KV cache blocks; bfloat16 caches on the BF16 dot products (decode_bf16.h) or with the
// scores on AMX tiles (decode_amx.h), every other dtype and shape on the generic loop.
#if defined(__AVX512BF16__)
#include "decode_amx.h"
#else
#include "common.h"
#endif

namespace cpullm {
namespace attn {
namespace {

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
      const int64_t len = lens[s], first = window_first(len, window), n = len - first;
      // (the group's query heads are contiguous)
      load_row(query.data(), qp + s * q_stride + kvh * group * head_dim, group * head_dim);
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
      const int64_t first = window_first(len, window);
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
                     window_first(len2, window), len2, block_size,
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

}  // namespace attn

using namespace attn;

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

}  // namespace cpullm
