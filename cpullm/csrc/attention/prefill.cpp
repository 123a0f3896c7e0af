// Prompt-chunk attention: the fused kernel on bfloat16 caches and on quantized ones, and the
// causal softmax of the batched matmuls' scores.
#include "kv_quant.h"

namespace cpullm {

using namespace attn;

#if defined(__AVX512BF16__)
namespace attn {
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
}  // namespace attn

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
namespace attn {
namespace {

// A quantized cache as the fused kernel reads it: each item's keys and values (one KV
// head's rows up to its last query) dequantized into bfloat16 rows of the thread's own, and
// read from there as from a bfloat16 cache.
struct QuantRows {
  // dst[0:n] = bfloat16(the row's values * scale)
  void (*dequant)(c10::BFloat16* dst, const uint8_t* src, int64_t n, float scale, float* buf);
  const c10::Half* key_rows;  // int8: the per-row scales [blocks x block_size, kv_heads]
  const c10::Half* value_rows;
  float k_scale, v_scale;  // the layer's scales times the format's unit()
};

template <KvFormat F>
void dequant_row_bf16(c10::BFloat16* dst, const uint8_t* src, int64_t n, float scale,
                      float* buf) {
  dequant_row<F>(buf, src, n, scale);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) bf16x16_store(dst + d, _mm512_loadu_ps(buf + d));
  for (; d < n; ++d) dst[d] = c10::BFloat16(buf[d]);
}

void prefill_attention_any(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const QuantRows* quant,
                           const at::Tensor& block_tables, const at::Tensor& starts,
                           const at::Tensor& query_lens, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "prefill attention: bfloat16 q and out expected");
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
  // bfloat16 caches: element pointers; quantized ones: their bytes
  const auto* kp = static_cast<const c10::BFloat16*>(key_cache.data_ptr());
  const auto* vp = static_cast<const c10::BFloat16*>(value_cache.data_ptr());
  const auto* kq = static_cast<const uint8_t*>(key_cache.data_ptr());
  const auto* vq = static_cast<const uint8_t*>(value_cache.data_ptr());
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
    std::vector<c10::BFloat16> keys, values;  // a quantized cache's rows, dequantized
    // whose rows keys and values hold: a thread's items run in order, and the next item of
    // a chunk's KV head reads the rows of the one before and more (a window: other rows)
    int64_t held_p = -1, held_kvh = -1, held_t0 = 0, held_n = 0;
    std::vector<float> buf(head_dim);
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
      // a quantized cache: keys and values t0..t1 of this KV head, dequantized, row after row
      // (those the item before left in place kept)
      const int64_t ldk = quant != nullptr ? head_dim / 2 : token_stride / 2;
      if (quant != nullptr) {
        if (p != held_p || kvh != held_kvh || t0 != held_t0) {
          held_p = p, held_kvh = kvh, held_t0 = t0, held_n = 0;
        }
        keys.resize(std::max(n, held_n) * head_dim);
        values.resize(std::max(n, held_n) * head_dim);
        for (int64_t j = held_n; j < n; ++j) {
          const int64_t row = off[t0 + j] / head_dim + kvh;  // its index in the scales
          const float ks = quant->key_rows
              ? quant->k_scale * static_cast<float>(quant->key_rows[row]) : quant->k_scale;
          const float vs = quant->value_rows
              ? quant->v_scale * static_cast<float>(quant->value_rows[row]) : quant->v_scale;
          quant->dequant(keys.data() + j * head_dim, kq + row * head_dim, head_dim, ks,
                         buf.data());
          quant->dequant(values.data() + j * head_dim, vq + row * head_dim, head_dim, vs,
                         buf.data());
        }
        held_n = std::max(n, held_n);
      }
      auto key_row = [&](int64_t t) {
        return quant != nullptr ? keys.data() + (t - t0) * head_dim
                                : kp + off[t] + kvh * head_dim;
      };
      // the scores, 12 keys a tile, a block's run at a time
      scores.resize(n * 32);
      __m512 vmax[2] = {_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                        _mm512_set1_ps(-std::numeric_limits<float>::infinity())};
      for (int64_t t = t0; t < t1;) {
        const int64_t run = std::min(t1 - t, block_size - t % block_size);
        const int32_t* k = reinterpret_cast<const int32_t*>(key_row(t));
        for (int64_t j = 0; j < run; j += kPrefillKeys) {
          const int64_t m = std::min<int64_t>(kPrefillKeys, run - j);
          score_tiles[m - 1](scores.data() + (t - t0 + j) * 32, t + j, k + j * ldk, ldk,
                             reinterpret_cast<const __m512bh*>(qpk), k2, vscale, pos, lo,
                             vmax);
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
      for (int64_t j = 0; j < n; ++j)
        rows[j] = quant != nullptr ? values.data() + j * head_dim : vp + off[t0 + j] + kvh * head_dim;
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

}  // namespace
}  // namespace attn

void prefill_attention_bf16(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables, at::Tensor starts,
                            at::Tensor query_lens, double scale, int64_t window) {
  TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16 &&
              value_cache.scalar_type() == at::kBFloat16,
              "prefill_attention_bf16: bfloat16 caches expected");
  prefill_attention_any(out, q, key_cache, value_cache, nullptr, block_tables, starts,
                        query_lens, scale, window);
}

// The fused kernel on a quantized cache (kv_quant.h: int8 with its row scales, or fp8 with
// the layer's k_scale and v_scale).
void prefill_attention_quant(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                             at::Tensor value_cache, c10::optional<at::Tensor> key_scales,
                             c10::optional<at::Tensor> value_scales, double k_scale,
                             double v_scale, at::Tensor block_tables, at::Tensor starts,
                             at::Tensor query_lens, double scale, int64_t window) {
  QuantRows quant{};
  quant.key_rows = row_scales(key_cache, key_scales, "prefill_attention_quant");
  quant.value_rows = row_scales(value_cache, value_scales, "prefill_attention_quant");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "prefill_attention_quant: K and V caches of one format expected");
  dispatch_format(kv_format(key_cache), [&](auto f) {
    constexpr KvFormat F = decltype(f)::value;
    quant.dequant = dequant_row_bf16<F>;
    quant.k_scale = static_cast<float>(k_scale) * unit<F>();
    quant.v_scale = static_cast<float>(v_scale) * unit<F>();
  });
  prefill_attention_any(out, q, key_cache, value_cache, &quant, block_tables, starts,
                        query_lens, scale, window);
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
