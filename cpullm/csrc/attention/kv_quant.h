// The quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2): its formats, their
// conversion to float32, and where a row lives; the store and decode attention are in
// kv_quant.cpp, the fused prompt attention in prefill.cpp.
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
#pragma once

#include "common.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace cpullm {
namespace attn {

enum class KvFormat { kInt8, kE4M3, kE5M2 };

inline KvFormat kv_format(const at::Tensor& cache) {
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

// The scales tensor of an int8 cache ([slots or blocks, ..., kv_heads] float16, one per
// row of `cache`), checked; nullptr for fp8.
inline const c10::Half* row_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& scales,
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

template <typename Body>
void dispatch_format(KvFormat format, Body&& body) {
  switch (format) {
    case KvFormat::kInt8: body(std::integral_constant<KvFormat, KvFormat::kInt8>{}); break;
    case KvFormat::kE4M3: body(std::integral_constant<KvFormat, KvFormat::kE4M3>{}); break;
    case KvFormat::kE5M2: body(std::integral_constant<KvFormat, KvFormat::kE5M2>{}); break;
  }
}

}  // namespace attn
}  // namespace cpullm
