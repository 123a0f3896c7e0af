// x @ W.T on FP8 (e4m3) weights kept as the checkpoint stores them: one byte per weight,
// row-major [n, k], and a float32 scale per row and block of `block` columns (per tensor
// and per channel are one block of k; FP8's 128 x 128 blocks are 128 columns here, their
// scale repeated over their rows).
//
// No x86 CPU multiplies in FP8, but e4m3 converts exactly and cheaply. For many rows of x,
// each thread dequantizes 32 rows of W at a time into a bfloat16 panel of the dense GEMM's
// layout and runs its tiles on it (gemm_on_panels); for few rows (`dot`: decode) x, in
// float32, is multiplied by the bytes as they are read (dot_rows). Either way a step reads
// half the bytes of a bfloat16 weight. The conversion needs no table: the 7 bits below an
// e4m3 sign, shifted left by 7, are a float16 whose value is the e4m3 value / 256 (float16
// has 5 exponent bits of bias 15 where e4m3 has 4 of bias 7, both with subnormals below), so
//     w = float(half((b & 0x7f) << 7 | (b & 0x80) << 8)) * (256 * scale)
// exactly; the panels round it once to float32, as the reference's float(b) * scale does,
// then once to bfloat16. (e4m3's NaN, 0x7f, becomes a finite value; checkpoints hold none.)
#include "gemm_tiles.h"
#include "ops.h"

namespace cpullm {

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace {

// 32 e4m3 bytes -> 32 float32 values / 256, as two vectors of 16.
inline void e4m3x32_to_ps(__m256i bytes, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  const __m512i h = _mm512_or_si512(
      _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7f)), 7),
      _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// Rows [r0, r0 + 32) of W into a bfloat16 panel [k / 2][32] of (2kk, 2kk + 1) pairs: per
// 32 columns, 16 rows' 16 pairs are transposed in registers so that each pair's 16 rows
// go out as one 64-byte store.
void dequantize_panel(const uint8_t* data, const float* scales, int64_t k, int64_t blocks,
                      int64_t block, int64_t r0, int32_t* panel) {
  for (int64_t c0 = 0; c0 < 32; c0 += 16) {
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
      const int64_t left = std::min<int64_t>(32, k - k0);
      const __mmask32 mask = left == 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      __m512i pairs[16];
      for (int c = 0; c < 16; ++c) {
        const int64_t row = r0 + c0 + c;
        const uint8_t* p = data + row * k + k0;
        if (k0 % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + 32 * k), _MM_HINT_T1);
        const __m512 s = _mm512_set1_ps(256.f * scales[row * blocks + k0 / block]);
        __m512 lo, hi;
        e4m3x32_to_ps(_mm256_maskz_loadu_epi8(mask, p), lo, hi);
        pairs[c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
      }
      transpose16(pairs);
      for (int64_t i = 0; i < left / 2; ++i)
        _mm512_storeu_si512(panel + (k0 / 2 + i) * 32 + c0, pairs[i]);
    }
  }
}

// 64 e4m3 bytes -> their float16 values / 256, as the even bytes' 32 and the odd bytes' 32.
// Read as 32 words, byte 2i is the low half of word i: shifted up by 8 its sign is bit 15,
// and an arithmetic shift right by 1 puts the magnitude at bits 7..13 (bit 14, a copy of
// the sign, is cleared); byte 2i + 1 needs only the arithmetic shift.
inline void e4m3x64_to_ph(__m512i bytes, __m512i& even, __m512i& odd) {
  const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0xbf80));
  even = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(bytes, 8), 1), keep);
  odd = _mm512_and_si512(_mm512_srai_epi16(bytes, 1), keep);
}

// Few rows of x (decode): dot products on the bytes as stored, with no panel. Per 64
// weights of a row, one conversion (e4m3x64_to_ph, float16 -> float32 -> bfloat16, each
// exact) feeds T tokens' BF16 dot products; x is laid out once, per 64 columns in the
// order the conversion leaves the weights in (columns 0, 2, .., 62 | 1, 3, .., 63), its
// rows padded with zeros to a multiple of 64. R rows of W at a time, the two halves of a
// chunk in S sums each, so that several chains run side by side without spilling; a
// block's sums meet its scale once.
template <int R, int T>
void dot_rows(const uint8_t* data, const float* scales, int64_t k, int64_t blocks,
              int64_t block, const c10::BFloat16* xo, int64_t ldxo, int64_t r0,
              const float* bias, c10::BFloat16* out, int64_t ldo) {
  constexpr int S = T <= 2 ? 2 : 1;
  __m512 total[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) total[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * block, end = std::min(k, begin + block);
    __m512 acc[R][T][S];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int q = 0; q < S; ++q) acc[r][t][q] = _mm512_setzero_ps();
    for (int64_t k0 = begin; k0 < end; k0 += 64) {
      const int64_t left = std::min<int64_t>(64, end - k0);
      const __mmask64 mask = left == 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      __m512bh w[R][2];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = data + (r0 + r) * k + k0;
        _mm_prefetch(reinterpret_cast<const char*>(p + R * k), _MM_HINT_T1);
        __m512i even, odd;
        e4m3x64_to_ph(_mm512_maskz_loadu_epi8(mask, p), even, odd);
        w[r][0] = _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(even, 1)),
                                      _mm512_cvtph_ps(_mm512_castsi512_si256(even)));
        w[r][1] = _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(odd, 1)),
                                      _mm512_cvtph_ps(_mm512_castsi512_si256(odd)));
      }
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xo + t * ldxo + k0 + 32 * h);
          for (int r = 0; r < R; ++r)
            acc[r][t][h % S] = _mm512_dpbf16_ps(acc[r][t][h % S], w[r][h], xv);
        }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(256.f * scales[(r0 + r) * blocks + b]);
      for (int t = 0; t < T; ++t) {
        __m512 sum = acc[r][t][0];
        for (int q = 1; q < S; ++q) sum = _mm512_add_ps(sum, acc[r][t][q]);
        total[r][t] = _mm512_fmadd_ps(sum, s, total[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const float v = _mm512_reduce_add_ps(total[r][t]) + (bias != nullptr ? bias[r0 + r] : 0.f);
      out[t * ldo + r0 + r] = c10::BFloat16(v);
    }
}

using DotRows = void (*)(const uint8_t*, const float*, int64_t, int64_t, int64_t,
                         const c10::BFloat16*, int64_t, int64_t, const float*, c10::BFloat16*,
                         int64_t);
constexpr int kDotTokens = 4;  // tokens per pass over W's rows
constexpr DotRows kDotRows[2][kDotTokens] = {
    {&dot_rows<1, 1>, &dot_rows<1, 2>, &dot_rows<1, 3>, &dot_rows<1, 4>},
    {&dot_rows<2, 1>, &dot_rows<2, 2>, &dot_rows<2, 3>, &dot_rows<2, 4>}};

// x [m, k], each row in dot_rows' column order and padded with zeros to ldxo columns.
std::vector<c10::BFloat16> dot_order(const at::Tensor& x, int64_t ldxo) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<c10::BFloat16> xo(m * ldxo, c10::BFloat16(0.f));
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < m; ++t) {
    c10::BFloat16* dst = xo.data() + t * ldxo;
    for (int64_t c = 0; c < k; ++c) {
      const int64_t i = c % 64;
      dst[c - i + (i % 2) * 32 + i / 2] = xp[t * x.stride(0) + c];
    }
  }
  return xo;
}

void dot_gemm(at::Tensor& out, const at::Tensor& x, const uint8_t* data, const float* scales,
              int64_t blocks, int64_t block, const c10::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t ldxo = (k + 63) / 64 * 64;
  const std::vector<c10::BFloat16> xo = dot_order(x, ldxo);
  std::vector<float> bf;
  if (bias.has_value()) {
    bf.resize(n);
    load_row(bf.data(), bias->data_ptr<c10::BFloat16>(), n);
  }
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, (n + 1) / 2, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < m; t0 += kDotTokens) {
      const int tokens = static_cast<int>(std::min<int64_t>(kDotTokens, m - t0));
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t r0 = 2 * pair;
        kDotRows[r0 + 1 < n][tokens - 1](data, scales, k, blocks, block, xo.data() + t0 * ldxo,
                                         ldxo, r0, bf.empty() ? nullptr : bf.data(),
                                         op + t0 * ldo, ldo);
      }
    }
  });
}

}  // namespace

void fp8_gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                   int64_t block, c10::optional<at::Tensor> bias, bool dot) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "fp8_gemm_bf16: bfloat16 x and out expected");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
              scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "fp8_gemm_bf16: uint8 data (e4m3 bytes) and contiguous float32 scales expected");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  const int64_t blocks = (k + block - 1) / block;
  TORCH_CHECK(data.size(1) == k && k > 0 && x.stride(1) == 1 && out.stride(1) == 1 &&
              out.size(0) == m && out.size(1) == n, "fp8_gemm_bf16: shapes do not match");
  TORCH_CHECK(dot || (n % 32 == 0 && k % 2 == 0 && x.stride(0) % 2 == 0),
              "fp8_gemm_bf16: 32-row panels of W and (k, k+1) pairs of x expected");
  TORCH_CHECK(block > 0 && (block % 64 == 0 || blocks == 1) && scales.size(0) == n &&
              scales.size(1) == blocks,
              "fp8_gemm_bf16: a scale per row and block of a multiple of 64 columns expected");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                bias->numel() == n, "fp8_gemm_bf16: a bfloat16 bias of n values expected");
  if (m == 0) return;
  const uint8_t* dp = data.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  if (dot) {
    dot_gemm(out, x, dp, sp, blocks, block, bias);
    return;
  }
  gemm_on_panels(out, x, n, bias, [&](int64_t p, int32_t* panel) {
    dequantize_panel(dp, sp, k, blocks, block, 32 * p, panel);
  });
}
#endif

}  // namespace cpullm
