// The quantized KV cache's kernels (kv_quant.h has the formats): the store of a step's keys
// and values into their slots, and paged decode attention that reads the one-byte elements
// in place, converting them to float32 in registers (no dequantized copy).
#include "kv_quant.h"

namespace cpullm {
namespace attn {
namespace {

// How many rows ahead the loops prefetch (rows of one KV head are token_stride apart).
constexpr int64_t kPrefetchRows = 8;

inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
#if defined(__AVX512F__) || defined(__AVX2__)
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b,
                                                       _MM_HINT_T0);
#endif
}

// scores[g * n + (t - first)] = q_g . k_t * scale for the query heads of one KV head, one
// row at a time (the shapes the vector kernel below does not take).
template <KvFormat F>
void quant_scores_rows(float* scores, const float* q, int64_t group, int64_t head_dim,
                       float scale, const PagedRows& k, int64_t first, int64_t len,
                       float* key) {
  const int64_t n = len - first;
  for (int64_t t = first; t < len; ++t) {
    const int64_t block = k.bt[t / k.block_size], off = t % k.block_size;
    dequant_row<F>(key, k.row(block, off), head_dim, k.row_scale(block, off));
    for (int64_t g = 0; g < group; ++g)
      scores[g * n + t - first] = dot(q + g * head_dim, key, head_dim) * scale;
  }
}

#if defined(KV_VECTOR)
// Scores of the keys first..len-1 of one KV head against G query heads, 16 rows at a time
// within a block's run: dots(row, a) leaves a row's G partial sums (vectors) in a; on
// AVX-512 16 rows' sums are reduced together, one lane a row. scores[g * n + t - first] =
// the sum * the row's scale * scale * head_scale[g].
template <int G, typename Dots>
void walk_scores(float* scores, int64_t head_dim, float scale, const float* head_scale,
                 const PagedRows& k, int64_t first, int64_t len, Dots&& dots) {
  const int64_t n = len - first;
  typename Vec::R part[G][16];
  alignas(64) float row_scales[16];
  for (int64_t t = first; t < len;) {
    const int64_t block = k.bt[t / k.block_size], off = t % k.block_size;
    const int64_t run = std::min(len - t, k.block_size - off);
    float* row = scores + (t - first);
    for (int64_t i = 0; i < run; i += 16) {
      const int64_t m = std::min<int64_t>(16, run - i);
      for (int64_t j = 0; j < m; ++j) {
        const uint8_t* kr = k.row(block, off + i + j);
        prefetch_bytes(kr + kPrefetchRows * k.token_stride, head_dim);
        row_scales[j] = k.row_scale(block, off + i + j) * scale;
        typename Vec::R a[G];
        dots(kr, a);
        for (int g = 0; g < G; ++g) part[g][j] = a[g];
      }
#if defined(__AVX512F__)
      if (m == 16) {
        const __m512 rs = _mm512_load_ps(row_scales);
        for (int g = 0; g < G; ++g)
          _mm512_storeu_ps(row + g * n + i, _mm512_mul_ps(
              reduce16(part[g]), _mm512_mul_ps(rs, _mm512_set1_ps(head_scale[g]))));
        continue;
      }
#endif
      for (int g = 0; g < G; ++g)
        for (int64_t j = 0; j < m; ++j)
          row[g * n + i + j] = Vec::sum(part[g][j]) * (row_scales[j] * head_scale[g]);
    }
    t += run;
  }
}

// The float path, head_dim a multiple of the vector width: each row's chunks are converted
// once and multiplied into the G heads' accumulators (in registers).
template <KvFormat F, int G>
void quant_scores(float* scores, const float* q, int64_t head_dim, float scale,
                  const PagedRows& k, int64_t first, int64_t len) {
  constexpr int kW = Vec::kWidth;
  const int64_t chunks = head_dim / kW;
  std::array<float, G> ones;
  ones.fill(1.f);
  walk_scores<G>(scores, head_dim, scale, ones.data(), k, first, len,
                 [&](const uint8_t* kr, typename Vec::R* a) {
    for (int g = 0; g < G; ++g) a[g] = Vec::zero();
    for (int64_t c = 0; c < chunks; ++c) {
      const auto x = Vec::bytes<F>(kr + c * kW);
      for (int g = 0; g < G; ++g) a[g] = Vec::fmadd(Vec::load(q + g * head_dim + c * kW), x, a[g]);
    }
  });
}

template <KvFormat F>
using QuantScoresFn = void (*)(float*, const float*, int64_t, float, const PagedRows&, int64_t,
                               int64_t);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 keys, head_dim a multiple of 32 up to 256, a bfloat16 query: the query heads in int16
// (each its own scale: bfloat16's 8 significant bits fit in 15 with room to spare), and each
// row's 32 bytes widened to int16 meet them in the VNNI int16 dot products (32 products a
// instruction, summed in int32 pairs), where the float path converts 16 values and multiplies
// them once per query head.
template <int G>
void int8_scores(float* scores, const float* q, int64_t head_dim, float scale,
                 const PagedRows& k, int64_t first, int64_t len) {
  const int64_t chunks = head_dim / 32;
  __m512i q16[G][8];
  float qs[G];
  for (int g = 0; g < G; ++g) {
    const float* qg = q + g * head_dim;
    float amax = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(qg[d]));
    qs[g] = amax > 0.f ? amax / 32767.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / qs[g]);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256i lo = _mm512_cvtsepi32_epi16(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qg + c * 32), inv)));
      const __m256i hi = _mm512_cvtsepi32_epi16(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qg + c * 32 + 16), inv)));
      q16[g][c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  }
  walk_scores<G>(scores, head_dim, scale, qs, k, first, len, [&](const uint8_t* kr, __m512* a) {
    __m512i acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i x = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr + c * 32)));
      for (int g = 0; g < G; ++g) acc[g] = _mm512_dpwssd_epi32(acc[g], q16[g][c], x);
    }
    for (int g = 0; g < G; ++g) a[g] = _mm512_cvtepi32_ps(acc[g]);
  });
}
#endif

// The scores kernel for G query heads per KV head (int16_query: the query is bfloat16, so
// int8 keys may take the integer dot products); nullptr where no vector kernel fits.
template <KvFormat F>
QuantScoresFn<F> scores_kernel(int64_t group, int64_t head_dim, bool int16_query) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (F == KvFormat::kInt8) {
    static constexpr QuantScoresFn<F> ints[] = {
        nullptr, int8_scores<1>, int8_scores<2>, int8_scores<3>, int8_scores<4>,
        int8_scores<5>, int8_scores<6>, int8_scores<7>, int8_scores<8>};
    if (int16_query && group >= 1 && group <= 8 && head_dim % 32 == 0 && head_dim <= 256)
      return ints[group];
  }
#endif
  static constexpr QuantScoresFn<F> kernels[] = {
      nullptr, quant_scores<F, 1>, quant_scores<F, 2>, quant_scores<F, 3>, quant_scores<F, 4>,
      quant_scores<F, 5>, quant_scores<F, 6>, quant_scores<F, 7>, quant_scores<F, 8>};
  return group >= 1 && group <= 8 && head_dim % Vec::kWidth == 0 ? kernels[group] : nullptr;
}

// acc[g, d0:d0 + W vectors] = sum over t of probs[g * n + t - first] * v_t[...] for G
// query heads, the G x W accumulators in registers over the whole sequence.
template <KvFormat F, int G, int W>
void quant_values(float* acc, int64_t head_dim, const float* probs, const PagedRows& v,
                  int64_t first, int64_t len) {
  constexpr int kW = Vec::kWidth;
  const int64_t n = len - first;
  for (int64_t d0 = 0; d0 < head_dim; d0 += kW * W) {
    typename Vec::R a[G][W];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) a[g][c] = Vec::zero();
    for (int64_t t = first; t < len;) {
      const int64_t block = v.bt[t / v.block_size], off = t % v.block_size;
      const int64_t run = std::min(len - t, v.block_size - off);
      const float* p = probs + (t - first);
      for (int64_t j = 0; j < run; ++j) {
        const uint8_t* vr = v.row(block, off + j) + d0;
        prefetch_bytes(vr + kPrefetchRows * v.token_stride, kW * W);
        const float rs = v.row_scale(block, off + j);
        typename Vec::R x[W];
        for (int c = 0; c < W; ++c) x[c] = Vec::bytes<F>(vr + kW * c);
        for (int g = 0; g < G; ++g) {
          const auto pg = Vec::set1(p[g * n + j] * rs);
          for (int c = 0; c < W; ++c) a[g][c] = Vec::fmadd(pg, x[c], a[g][c]);
        }
      }
      t += run;
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) Vec::store(acc + g * head_dim + d0 + kW * c, a[g][c]);
  }
}

template <KvFormat F>
using QuantValuesFn = void (*)(float*, int64_t, const float*, const PagedRows&, int64_t,
                               int64_t);

// The values kernel for G query heads per KV head: 4, 2 or 1 vectors of dimensions a pass,
// the most whose accumulators fit the registers (AVX-512's 32, AVX2's 16); nullptr where
// no vector kernel fits.
template <KvFormat F>
QuantValuesFn<F> values_kernel(int64_t group, int64_t head_dim) {
  static constexpr QuantValuesFn<F> k4[] = {
      nullptr, quant_values<F, 1, 4>, quant_values<F, 2, 4>, quant_values<F, 3, 4>,
      quant_values<F, 4, 4>, quant_values<F, 5, 4>, quant_values<F, 6, 4>};
  static constexpr QuantValuesFn<F> k2[] = {
      nullptr, quant_values<F, 1, 2>, quant_values<F, 2, 2>, quant_values<F, 3, 2>,
      quant_values<F, 4, 2>, quant_values<F, 5, 2>, quant_values<F, 6, 2>,
      quant_values<F, 7, 2>, quant_values<F, 8, 2>};
  static constexpr QuantValuesFn<F> k1[] = {
      nullptr, quant_values<F, 1, 1>, quant_values<F, 2, 1>, quant_values<F, 3, 1>,
      quant_values<F, 4, 1>, quant_values<F, 5, 1>, quant_values<F, 6, 1>,
      quant_values<F, 7, 1>, quant_values<F, 8, 1>};
  constexpr int kW = Vec::kWidth, kRegs = kW == 16 ? 24 : 12;  // accumulators at most
  if (group < 1 || group > 8 || head_dim % kW != 0) return nullptr;
  if (head_dim % (4 * kW) == 0 && group * 4 <= kRegs) return k4[group];
  if (head_dim % (2 * kW) == 0 && group * 2 <= kRegs) return k2[group];
  return k1[group];
}
#endif

// acc[g, :] = sum over t of probs[g * n + t - first] * v_t, one row at a time.
template <KvFormat F>
void quant_values_rows(float* acc, int64_t group, int64_t head_dim, const float* probs,
                       const PagedRows& v, int64_t first, int64_t len, float* value) {
  const int64_t n = len - first;
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t = first; t < len; ++t) {
    const int64_t block = v.bt[t / v.block_size], off = t % v.block_size;
    dequant_row<F>(value, v.row(block, off), head_dim, v.row_scale(block, off));
    for (int64_t g = 0; g < group; ++g) axpy(acc + g * head_dim, probs[g * n + t - first],
                                             value, head_dim);
  }
}

template <KvFormat F, typename T>
void decode_quant_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const c10::Half* key_rows,
                       const c10::Half* value_rows, double k_scale, double v_scale,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                       int64_t window, double softcap, const float* sinks) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const auto* kp = static_cast<const uint8_t*>(key_cache.data_ptr());
  const auto* vp = static_cast<const uint8_t*>(value_cache.data_ptr());
  const float fscale = static_cast<float>(scale);
  const float kunit = static_cast<float>(k_scale) * unit<F>();
  const float vunit = static_cast<float>(v_scale) * unit<F>();
#if defined(KV_VECTOR)
  const QuantScoresFn<F> scores_fn =
      scores_kernel<F>(group, head_dim, std::is_same_v<T, c10::BFloat16>);
  const QuantValuesFn<F> values_fn = values_kernel<F>(group, head_dim);
#endif
  auto cost = [&](int64_t item) { return decode_cost(lens, item, num_kv_heads, window); };
  parallel_by_cost(num_seqs * num_kv_heads, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores, row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[s], first = window_first(len, window), n = len - first;
      // (the group's query heads are contiguous)
      load_row(query.data(), qp + s * q_stride + kvh * group * head_dim, group * head_dim);
      const PagedRows k{kp + kvh * head_dim, key_rows ? key_rows + kvh : nullptr, kunit,
                        bt + s * max_blocks, block_size, block_stride, token_stride,
                        num_kv_heads};
      PagedRows v = k;
      v.data = vp + kvh * head_dim;
      v.rows = value_rows ? value_rows + kvh : nullptr;
      v.scale = vunit;
      scores.resize(group * n);
#if defined(KV_VECTOR)
      if (scores_fn != nullptr)
        scores_fn(scores.data(), query.data(), head_dim, fscale, k, first, len);
      else
#endif
        quant_scores_rows<F>(scores.data(), query.data(), group, head_dim, fscale, k, first,
                             len, row.data());
      if (softcap > 0) soft_cap(scores.data(), group * n, static_cast<float>(softcap));
      for (int64_t g = 0; g < group; ++g)
        softmax(scores.data() + g * n, n, sinks ? sinks[kvh * group + g] : kNoSink);
#if defined(KV_VECTOR)
      if (values_fn != nullptr)
        values_fn(acc.data(), head_dim, scores.data(), v, first, len);
      else
#endif
        quant_values_rows<F>(acc.data(), group, head_dim, scores.data(), v, first, len,
                             row.data());
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (s * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

// Quantizes one row of n values into dst (fp8: divided by the layer's `scale`, as torch's
// store divides); returns the row's int8 scale (1 for fp8).
template <KvFormat F, typename T>
float quantize_row(uint8_t* dst, const T* src, int64_t n, float scale, float* buf) {
  for (int64_t d = 0; d < n; ++d) buf[d] = to_f(src[d]);
  if constexpr (F == KvFormat::kInt8) {
    float amax = 0.f;
    for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(buf[d]));
    // the scale as stored (float16), so that values quantize against what is read back
    const float s = static_cast<float>(c10::Half(amax / 127.f));
    const float inv = s > 0.f ? 1.f / s : 0.f;
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; d + 16 <= n; d += 16)  // round to nearest even, saturate to [-128, 127]
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtsepi32_epi8(
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(buf + d), vinv))));
#endif
    for (; d < n; ++d) {
      const float x = std::nearbyint(buf[d] * inv);
      dst[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(x, -127.f, 127.f)));
    }
    return s;
  } else {
    using Fp8 = std::conditional_t<F == KvFormat::kE4M3, c10::Float8_e4m3fn, c10::Float8_e5m2>;
    const float top = static_cast<float>(std::numeric_limits<Fp8>::max());
    for (int64_t d = 0; d < n; ++d)
      dst[d] = Fp8(std::clamp(buf[d] / scale, -top, top)).x;
    return 1.f;
  }
}

template <KvFormat F, typename T>
void cache_kv_quant_impl(const at::Tensor& key_cache, const at::Tensor& value_cache,
                         c10::Half* key_rows, c10::Half* value_rows, const at::Tensor& k,
                         const at::Tensor& v, const int64_t* sp, double k_scale,
                         double v_scale) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  auto* kc = static_cast<uint8_t*>(key_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(value_cache.data_ptr());
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float ks_layer = static_cast<float>(k_scale), vs_layer = static_cast<float>(v_scale);
  at::parallel_for(0, tokens * heads, grain_for(2 * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads, row = sp[t] * heads + h;
      const float ks = quantize_row<F>(kc + row * dim, kp + t * k.stride(0) + h * dim, dim,
                                       ks_layer, buf.data());
      const float vs = quantize_row<F>(vc + row * dim, vp + t * v.stride(0) + h * dim, dim,
                                       vs_layer, buf.data());
      if (key_rows != nullptr) {
        key_rows[row] = c10::Half(ks);
        value_rows[row] = c10::Half(vs);
      }
    }
  });
}

}  // namespace
}  // namespace attn

using namespace attn;

void cache_kv_quant(at::Tensor key_cache, at::Tensor value_cache,
                    c10::optional<at::Tensor> key_scales, c10::optional<at::Tensor> value_scales,
                    at::Tensor k, at::Tensor v, at::Tensor slots, double k_scale,
                    double v_scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 3 &&
              key_cache.scalar_type() == value_cache.scalar_type() &&
              slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "cache_kv_quant: contiguous caches [slots, kv_heads, head_dim], int64 slots");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == slots.numel() &&
              k.size(1) == key_cache.size(1) && k.size(2) == key_cache.size(2) &&
              k.scalar_type() == v.scalar_type() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "cache_kv_quant: k and v must be [tokens, kv_heads, head_dim] rows");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "cache_kv_quant: scales must be positive");
  const KvFormat format = kv_format(key_cache);
  auto* key_rows = const_cast<c10::Half*>(row_scales(key_cache, key_scales, "cache_kv_quant"));
  auto* value_rows =
      const_cast<c10::Half*>(row_scales(value_cache, value_scales, "cache_kv_quant"));
  const int64_t num_slots = key_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "cache_kv_quant: slot ", sp[t], " out of range");
  dispatch_format(format, [&](auto f) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "cache_kv_quant",
                                    [&] {
      cache_kv_quant_impl<decltype(f)::value, scalar_t>(key_cache, value_cache, key_rows,
                                                        value_rows, k, v, sp, k_scale, v_scale);
    });
  });
}

void decode_attention_quant(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                            at::Tensor value_cache, c10::optional<at::Tensor> key_scales,
                            c10::optional<at::Tensor> value_scales, double k_scale,
                            double v_scale, at::Tensor block_tables, at::Tensor seq_lens,
                            double scale, int64_t window, double softcap,
                            c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "decode_attention_quant: bad q layout");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous() &&
              key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 4 &&
              key_cache.scalar_type() == value_cache.scalar_type() &&
              key_cache.size(3) == q.size(2) && q.size(1) % key_cache.size(2) == 0,
              "decode_attention_quant: contiguous caches [blocks, block_size, kv_heads, "
              "head_dim] of q's head_dim expected");
  const KvFormat format = kv_format(key_cache);
  const c10::Half* key_rows = row_scales(key_cache, key_scales, "decode_attention_quant");
  const c10::Half* value_rows = row_scales(value_cache, value_scales, "decode_attention_quant");
  const float* sp = sink_logits(sinks, q.size(1));
  dispatch_format(format, [&](auto f) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                    "decode_attention_quant", [&] {
      decode_quant_impl<decltype(f)::value, scalar_t>(
          out, q, key_cache, value_cache, key_rows, value_rows, k_scale, v_scale, block_tables,
          seq_lens, scale, window, softcap, sp);
    });
  });
}

}  // namespace cpullm
