// What the kernels on kept-quantized weights share (GGUF block types; AWQ, GPTQ and
// compressed-tensors int groups): per row of W, small unsigned integers u, a scale per block
// of 16, 32, 64 or 128 weights (float16 or float32) and either a min per block
// (w = s * u + m) or a zero point (w = s * (u - zero)); laid out after loading in 16-row
// tiles (tiled.h), or as AMX-INT8 tiles for per-channel INT8 (int8_amx.cpp).
//
// x is quantized to int8 per block (scale dx, and dx * sum(q) per block), so that each
// block's dot product is an integer one, four u8 x s8 products per lane per VNNI
// instruction:
//     sum_i w_i x_i = s dx sum_i u_i q_i + (m or -zero s) dx sum_i q_i
// The weights are read once, as kept (4.5-10 bits each): a decode step reads 2-4x fewer
// bytes than from bfloat16.
//
// Files: kept.h (x's int8 blocks, the kernels' instances by layout), tiled.h with
// tiled_dots.cpp over tiled_dots_avx512.h / tiled_dots_avx2.h (the int8 dot products) and
// tiled_panels.cpp (dequantized panels for the bf16 GEMMs, AVX-512 and AMX), int8_amx.cpp
// (per-channel int8 on AMX-INT8 tiles).
#pragma once

#include "../amx.h"
#include "../gemm_tiles.h"
#include "../ops.h"

#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace cpullm {
namespace quant {

// x's quantization and the kernels' instances: shared by every library level (each has
// AVX2, FMA and F16C).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// x[0, len) (len a multiple of 16; bfloat16, or float32: a remainder_row) as int8 q, to
// nearest, with d = max |x| / 127; returns d, and sum(q) in total.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 widen16(const c10::BFloat16* p) { return bf16x16_load(p); }
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

template <typename T>
inline float quantize_span(const T* x, int64_t len, int8_t* q, int32_t& total) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t c = 0; c < len; c += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(widen16(x + c)));
  const float d = _mm512_reduce_max_ps(amax) / 127.f;
  const __m512 inv = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t c = 0; c < len; c += 16) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(widen16(x + c), inv));
    sum = _mm512_add_epi32(sum, qi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm512_cvtsepi32_epi8(qi));
  }
  total = _mm512_reduce_add_epi32(sum);
  return d;
}
#else
inline __m256 bf16x8_load(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 widen8(const c10::BFloat16* p) { return bf16x8_load(p); }
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

template <typename T>
inline float quantize_span(const T* x, int64_t len, int8_t* q, int32_t& total) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t c = 0; c < len; c += 8)
    amax = _mm256_max_ps(amax, _mm256_and_ps(widen8(x + c), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  const float d = *std::max_element(lanes, lanes + 8) / 127.f;
  const __m256 inv = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t c = 0; c < len; c += 16) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(widen8(x + c), inv));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(widen8(x + c + 8), inv));
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
    // int32 -> int16 -> int8 with saturation; the packs work within 128-bit halves
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm256_castsi256_si128(bytes));
  }
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum);
  total = 0;
  for (int32_t v : sums) total += v;
  return d;
}
#endif

// What x's int8 blocks (quantize_span's) leave of it, r = x - d q, in float32: the second
// level of x for logits (quantize_blocks with two_levels), whose bfloat16
// rounding would leave ~1/256 of each block's largest value in the products.
inline void remainder_row(const c10::BFloat16* x, int64_t k, int64_t block, float* r) {
  alignas(64) int8_t q[128];
  for (int64_t b = 0; b < k; b += block) {
    int32_t total = 0;
    const float d = quantize_span(x + b, block, q, total);
    for (int64_t i = 0; i < block; ++i)
      r[b + i] = static_cast<float>(x[b + i]) - d * static_cast<float>(q[i]);
  }
}

// Calls quantize(row, r) on each row of x's quantization: token t's x as row t, or with
// two_levels (logits) as row 2t and its remainder_row (float32) as row 2t + 1.
template <typename F>
void quantize_levels(const at::Tensor& x, int64_t block, bool two_levels, int64_t grain,
                     const F& quantize) {
  const int64_t k = x.size(1);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, x.size(0), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> remainder(two_levels ? k : 0);
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* row = xp + t * x.stride(0);
      if (!two_levels) {
        quantize(row, t);
        continue;
      }
      quantize(row, 2 * t);
      remainder_row(row, k, block, remainder.data());
      quantize(static_cast<const float*>(remainder.data()), 2 * t + 1);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The index of a word permutation: words (2 l, 2 l + 1) <- words (l, l + 16).
inline __m512i pair_halves() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}
#endif

// The instance Of<BITS, BLOCK, S, MIN>::entry of a kernel template (a function, or a table
// of them) for a weight's layout: u of 4 or 8 bits, blocks of 16, 32, 64 or 128, float16
// or float32 scales, mins or a zero point; and the layouts of GGUF's other types: 5 bits
// in blocks of 32 with float16 scales (Q5_0, Q5_1), and the K-quants' two-level scales
// (S int8_t): Q2_K and Q3_K (4 bits, blocks of 16), Q4_K, Q5_K (4 and 5, 32, mins), Q6_K
// (6, 16, a zero point). GGUF's types use blocks of 16 and 32 (gguf_blocks.FORMATS); the
// group-quantized formats (AWQ, GPTQ, compressed-tensors) blocks of their group size, or
// of 128 with a scale repeated for larger groups and per-channel scales.
template <template <int, int, typename, bool> class Of, int BITS, int BLOCK>
auto pick_scales(bool half, bool min) {
  if (half) return min ? Of<BITS, BLOCK, at::Half, true>::entry : Of<BITS, BLOCK, at::Half, false>::entry;
  return min ? Of<BITS, BLOCK, float, true>::entry : Of<BITS, BLOCK, float, false>::entry;
}

template <template <int, int, typename, bool> class Of, int BITS>
auto pick_block(int64_t block, bool half, bool min) {
  switch (block) {
    case 16: return pick_scales<Of, BITS, 16>(half, min);
    case 32: return pick_scales<Of, BITS, 32>(half, min);
    case 64: return pick_scales<Of, BITS, 64>(half, min);
    default: return pick_scales<Of, BITS, 128>(half, min);
  }
}

template <template <int, int, typename, bool> class Of>
auto pick_kept(int64_t bits, int64_t block, at::ScalarType scales, bool min) {
  const bool half = scales == at::kHalf;
  if (scales == at::kChar) {  // two-level
    if (bits == 4 && block == 16)
      return min ? Of<4, 16, int8_t, true>::entry : Of<4, 16, int8_t, false>::entry;
    if (bits == 4 && block == 32 && min) return Of<4, 32, int8_t, true>::entry;
    if (bits == 5 && block == 32 && min) return Of<5, 32, int8_t, true>::entry;
    TORCH_CHECK(bits == 6 && block == 16 && !min, "quant_gemm_tiled: no kernel for two-level "
                "scales of ", bits, "-bit u in blocks of ", block);
    return Of<6, 16, int8_t, false>::entry;
  }
  if (bits == 5) {
    TORCH_CHECK(block == 32 && half, "quant_gemm_tiled: 5-bit u in blocks of 32 with float16 "
                "scales expected");
    return min ? Of<5, 32, at::Half, true>::entry : Of<5, 32, at::Half, false>::entry;
  }
  TORCH_CHECK(bits == 4 || bits == 8, "quant_gemm_tiled: no kernel for ", bits, "-bit u");
  return bits == 4 ? pick_block<Of, 4>(block, half, min) : pick_block<Of, 8>(block, half, min);
}

// The bias of each panel's 32 columns: with silu_mul, a panel is 16 rows of gate and the
// same 16 of up, and its bias too.
inline c10::optional<at::Tensor> panel_bias(const c10::optional<at::Tensor>& bias, int64_t n,
                                            bool silu_mul) {
  if (!silu_mul || !bias.has_value()) return bias;
  return bias->view({2, n / 32, 16}).transpose(0, 1).contiguous();
}

#endif

}  // namespace quant
}  // namespace cpullm
