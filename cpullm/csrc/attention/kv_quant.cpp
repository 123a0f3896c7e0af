// The quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2): the store of a step's
// keys and values into their slots, and paged decode attention that reads the one-byte
// elements in place, converting them to float32 in registers (no dequantized copy).
//
//   int8: x = q * s, with s = max|x| / 127 per token and KV head, kept as float16 in a
//         scales tensor beside the cache [slots, kv_heads] (llama.cpp's q8_0 keeps a float16
//         scale per 32 values; one per row of head_dim costs 2 bytes a row: 1.94x bf16's
//         tokens at head_dim 64);
//   fp8:  x = f * s with f an e4m3 / e5m2 value and s one float per layer for K and one for V
//         (vLLM's k_scale / v_scale, 1.0 unless a checkpoint or --calculate-kv-scales sets
//         them); values past the format's largest finite one saturate to it.
//
// Both fp8 formats become float16 in integer steps and then float32 in one conversion
// (F16C): e5m2 is the upper byte of a float16, and e4m3's 7 bits below the sign shifted left
// by 7 are a float16 of value e4m3 / 256 (4 exponent bits of bias 7 inside 5 of bias 15).
#include "common.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace cpullm {
namespace attn {
namespace {

enum class KvFormat { kInt8, kE4M3, kE5M2 };

KvFormat kv_format(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return KvFormat::kInt8;
    case at::kFloat8_e4m3fn: return KvFormat::kE4M3;
    case at::kFloat8_e5m2: return KvFormat::kE5M2;
    default:
      TORCH_CHECK(false, "quantized KV cache: int8, float8_e4m3fn or float8_e5m2 expected, got ",
                  cache.scalar_type());
  }
}

// One byte of the cache -> its value before the scale (e4m3: / 256, as the vector loads).
template <KvFormat F>
inline float byte_value(uint8_t b) {
  if constexpr (F == KvFormat::kInt8) {
    return static_cast<float>(static_cast<int8_t>(b));
  } else if constexpr (F == KvFormat::kE4M3) {
    return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits())) / 256.f;
  } else {
    return static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  }
}

// What multiplies byte_value into the stored value, besides a per-row int8 scale.
template <KvFormat F>
constexpr float unit() { return F == KvFormat::kE4M3 ? 256.f : 1.f; }

// The vector kernels' registers: 16 float32 lanes on AVX-512, 8 on AVX2 (F16C converts
// both fp8 formats there too); KV_VECTOR where the build has either.
#if defined(__AVX2__) && defined(__F16C__)
template <KvFormat F>
inline __m256i fp8_to_half_bits(__m256i b) {  // 16-bit lanes holding one byte each
  if constexpr (F == KvFormat::kE4M3)
    return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                           _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm256_slli_epi16(b, 8);
}
#endif

#if defined(__AVX512F__)
#define KV_VECTOR 1
struct Vec {
  using R = __m512;
  static constexpr int kWidth = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(R x) { return _mm512_reduce_add_ps(x); }
  // 16 bytes of the cache -> 16 float32 byte_values
  template <KvFormat F>
  static R bytes(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (F == KvFormat::kInt8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    return _mm512_cvtph_ps(fp8_to_half_bits<F>(_mm256_cvtepu8_epi16(raw)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_VECTOR 1
struct Vec {
  using R = __m256;
  static constexpr int kWidth = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(R x) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
  template <KvFormat F>
  static R bytes(const uint8_t* p) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (F == KvFormat::kInt8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    const __m256i h = fp8_to_half_bits<F>(_mm256_cvtepu8_epi16(raw));  // (8 lanes used)
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  }
};
#endif

// dst[0:n] = byte_value(src[0:n]) * scale
template <KvFormat F>
inline void dequant_row(float* dst, const uint8_t* src, int64_t n, float scale) {
  int64_t d = 0;
#if defined(KV_VECTOR)
  const auto vs = Vec::set1(scale);
  for (; d + Vec::kWidth <= n; d += Vec::kWidth)
    Vec::store(dst + d, Vec::mul(Vec::bytes<F>(src + d), vs));
#endif
  for (; d < n; ++d) dst[d] = byte_value<F>(src[d]) * scale;
}

// Where a token's K or V row of one KV head lives, and its scale.
struct PagedRows {
  const uint8_t* data;     // the cache at the KV head
  const c10::Half* rows;   // int8: the per-row scales at the KV head, else nullptr
  float scale;             // the layer's scale (fp8) times unit()
  const int64_t* bt;
  int64_t block_size, block_stride, token_stride, kv_heads;

  // (block-table entry, offset in block) -> the row and its scale
  const uint8_t* row(int64_t block, int64_t off) const {
    return data + block * block_stride + off * token_stride;
  }
  float row_scale(int64_t block, int64_t off) const {
    return rows ? scale * static_cast<float>(rows[(block * block_size + off) * kv_heads]) : scale;
  }
};

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
// The same for G query heads, head_dim a multiple of the vector width: each row's chunks
// are converted once and multiplied into the G heads' accumulators (in registers); on
// AVX-512 16 rows' sums are reduced together, one lane a row.
template <KvFormat F, int G>
void quant_scores(float* scores, const float* q, int64_t head_dim, float scale,
                  const PagedRows& k, int64_t first, int64_t len) {
  constexpr int kW = Vec::kWidth;
  const int64_t n = len - first, chunks = head_dim / kW;
  Vec::R part[G][16];
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
        for (int g = 0; g < G; ++g) a[g] = Vec::zero();
        for (int64_t c = 0; c < chunks; ++c) {
          const auto x = Vec::bytes<F>(kr + c * kW);
          for (int g = 0; g < G; ++g) a[g] = Vec::fmadd(Vec::load(q + g * head_dim + c * kW), x, a[g]);
        }
        for (int g = 0; g < G; ++g) part[g][j] = a[g];
      }
#if defined(__AVX512F__)
      if (m == 16) {
        const __m512 rs = _mm512_load_ps(row_scales);
        for (int g = 0; g < G; ++g)
          _mm512_storeu_ps(row + g * n + i, _mm512_mul_ps(reduce16(part[g]), rs));
        continue;
      }
#endif
      for (int g = 0; g < G; ++g)
        for (int64_t j = 0; j < m; ++j) row[g * n + i + j] = Vec::sum(part[g][j]) * row_scales[j];
    }
    t += run;
  }
}

template <KvFormat F>
using QuantScoresFn = void (*)(float*, const float*, int64_t, float, const PagedRows&, int64_t,
                               int64_t);

template <KvFormat F>
QuantScoresFn<F> scores_kernel(int64_t group, int64_t head_dim) {
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
  const QuantScoresFn<F> scores_fn = scores_kernel<F>(group, head_dim);
  const QuantValuesFn<F> values_fn = values_kernel<F>(group, head_dim);
#endif
  auto cost = [&](int64_t item) { return decode_cost(lens, item, num_kv_heads, window); };
  parallel_by_cost(num_seqs * num_kv_heads, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores, row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + s * q_stride + (kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = to_f(src[d]);
      }
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

// The scales tensor of an int8 cache ([slots or blocks, ..., kv_heads] float16, one per
// row of `cache`), checked; nullptr for fp8.
const c10::Half* row_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& scales,
                            const char* what) {
  if (kv_format(cache) != KvFormat::kInt8) {
    TORCH_CHECK(!scales.has_value(), what, ": per-row scales are for an int8 cache only");
    return nullptr;
  }
  TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kHalf &&
              scales->is_contiguous() &&
              scales->numel() * cache.size(-1) == cache.numel(),
              what, ": an int8 cache needs contiguous float16 scales, one per row");
  return scales->data_ptr<c10::Half>();
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

template <typename Body>
void dispatch_format(KvFormat format, Body&& body) {
  switch (format) {
    case KvFormat::kInt8: body(std::integral_constant<KvFormat, KvFormat::kInt8>{}); break;
    case KvFormat::kE4M3: body(std::integral_constant<KvFormat, KvFormat::kE4M3>{}); break;
    case KvFormat::kE5M2: body(std::integral_constant<KvFormat, KvFormat::kE5M2>{}); break;
  }
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
