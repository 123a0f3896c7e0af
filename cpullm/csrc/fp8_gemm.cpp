// x @ W.T on FP8 (e4m3) weights kept one byte per weight, with a float32 scale per row and
// block of `block` columns (per tensor and per channel are one block of k; FP8's 128 x 128
// blocks are 128 columns here, their scale repeated over their rows), scales [n, blocks].
//
// The bytes are laid out at load (fp8.py) in panels of 32 rows of W: per panel, per pair of
// columns (2kk, 2kk + 1), 64 bytes holding the 32 rows' two weights, in the order in which
// one conversion leaves them as the bfloat16 GEMM's panel row [32 rows][2]: byte 2i is
// element i of that row (rows 0..15), byte 2i + 1 element 32 + i (rows 16..31). So the
// bytes stream in order, a 64-byte load becomes two vectors of (row, pair) weights with no
// shuffle, and the dot products leave one output per lane: nothing to transpose or reduce.
//
// No x86 CPU multiplies in FP8, but e4m3 converts exactly and cheaply. For few rows of x
// (`dot`: decode), each 64-byte load feeds every row's BF16 dot products directly, a
// block's sums meeting its scales once (dot_panel); for many rows, each thread dequantizes
// one panel at a time, scales applied, into a bfloat16 panel and runs the dense GEMM's
// tiles on it (gemm_on_panels). Either way a step reads half the bytes of a bfloat16
// weight. The conversion needs no table: the 7 bits below an e4m3 sign, shifted left by 7,
// are a float16 whose value is the e4m3 value / 256 (float16 has 5 exponent bits of bias 15
// where e4m3 has 4 of bias 7, both with subnormals below), so
//     w = float(half((b & 0x7f) << 7 | (b & 0x80) << 8)) * (256 * scale)
// exactly; the panels round it once to float32, as the reference's float(b) * scale does,
// then once to bfloat16. (e4m3's NaN, 0x7f, becomes a finite value; checkpoints hold none.)
#include "gemm_tiles.h"
#include "ops.h"

namespace cpullm {

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace {

// 64 e4m3 bytes -> their float16 values / 256, as the even bytes' 32 and the odd bytes' 32.
// Read as 32 words, byte 2i is the low half of word i: shifted up by 8 its sign is bit 15,
// and an arithmetic shift right by 1 puts the magnitude at bits 7..13 (bit 14, a copy of
// the sign, is cleared); byte 2i + 1 needs only the arithmetic shift.
inline void e4m3x64_to_ph(__m512i bytes, __m512i& even, __m512i& odd) {
  const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0xbf80));
  even = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(bytes, 8), 1), keep);
  odd = _mm512_and_si512(_mm512_srai_epi16(bytes, 1), keep);
}

// 32 float16 -> 32 bfloat16 (exact: e4m3 values / 256 fit both).
inline __m512bh ph_to_bf16(__m512i h) {
  return _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)),
                             _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
}

// 32 float16 times the float32 scales of their lanes (lo: 0..15, hi: 16..31), rounded
// once to bfloat16.
inline __m512bh ph_to_bf16(__m512i h, __m512 lo, __m512 hi) {
  return _mm512_cvtne2ps_pbh(
      _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), hi),
      _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), lo));
}

// The scales of panel p's rows at block b, times 256: rows 0..15 and rows 16..31.
inline void panel_scales(const float* scales, int64_t blocks, int64_t p, int64_t b,
                         __m512& s0, __m512& s1) {
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(blocks)));
  const float* base = scales + 32 * p * blocks + b;
  const __m512 x256 = _mm512_set1_ps(256.f);
  s0 = _mm512_mul_ps(_mm512_i32gather_ps(rows, base, 4), x256);
  s1 = _mm512_mul_ps(_mm512_i32gather_ps(rows, base + 16 * blocks, 4), x256);
}

// Panel p of W into the bfloat16 GEMM's panel [k / 2][32][2], each weight times its scale.
void dequantize_panel(const uint8_t* data, const float* scales, int64_t k, int64_t blocks,
                      int64_t block, int64_t p, int32_t* panel) {
  const int64_t k2 = k / 2;
  const uint8_t* w = data + p * k2 * 64;
  // lanes 0..15 of a half of the panel row are rows 0..7 (their pairs), 16..31 rows 8..15
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 s0, s1;
    panel_scales(scales, blocks, p, b, s0, s1);
    const __m512 s0l = _mm512_permutexvar_ps(lo, s0), s0h = _mm512_permutexvar_ps(hi, s0);
    const __m512 s1l = _mm512_permutexvar_ps(lo, s1), s1h = _mm512_permutexvar_ps(hi, s1);
    const int64_t end = std::min(k, (b + 1) * block) / 2;
    for (int64_t kk = b * block / 2; kk < end; ++kk) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k2 + kk) * 64), _MM_HINT_T1);  // next panel
      __m512i even, odd;
      e4m3x64_to_ph(_mm512_loadu_si512(w + kk * 64), even, odd);
      _mm512_storeu_si512(panel + kk * 32, (__m512i)ph_to_bf16(even, s0l, s0h));
      _mm512_storeu_si512(panel + kk * 32 + 16, (__m512i)ph_to_bf16(odd, s1l, s1h));
    }
  }
}

// Few rows of x (decode): panel p of W times T rows of x, the bytes converted as they are
// read and each conversion feeding every row. Lane i of a row's two sums is W's row
// 32p + i (and 32p + 16 + i): a block's sums meet the block's scales in one multiply-add.
// For one or two rows, the pairs alternate between two sums each, so that more than two
// dot-product chains run side by side.
template <int T>
void dot_panel(const uint8_t* data, const float* scales, int64_t k, int64_t blocks,
               int64_t block, const c10::BFloat16* x, int64_t ldx, int64_t p,
               const float* bias, c10::BFloat16* out, int64_t ldo) {
  constexpr int S = T <= 2 ? 2 : 1;
  const int64_t k2 = k / 2, ldx2 = ldx / 2;
  const uint8_t* w = data + p * k2 * 64;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // (k, k+1) pairs
  __m512 total[T][2];
  for (int t = 0; t < T; ++t) total[t][0] = total[t][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[S][T][2];
    for (int q = 0; q < S; ++q)
      for (int t = 0; t < T; ++t) acc[q][t][0] = acc[q][t][1] = _mm512_setzero_ps();
    auto step = [&](int64_t kk, int q) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kk + 16) * 64), _MM_HINT_T0);
      __m512i even, odd;
      e4m3x64_to_ph(_mm512_loadu_si512(w + kk * 64), even, odd);
      const __m512bh w0 = ph_to_bf16(even), w1 = ph_to_bf16(odd);
      for (int t = 0; t < T; ++t) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[t * ldx2 + kk]);
        acc[q][t][0] = _mm512_dpbf16_ps(acc[q][t][0], a, w0);
        acc[q][t][1] = _mm512_dpbf16_ps(acc[q][t][1], a, w1);
      }
    };
    const int64_t end = std::min(k, (b + 1) * block) / 2;
    int64_t kk = b * block / 2;
    for (; kk + S <= end; kk += S)
      for (int q = 0; q < S; ++q) step(kk + q, q);
    for (; kk < end; ++kk) step(kk, 0);
    __m512 s[2];
    panel_scales(scales, blocks, p, b, s[0], s[1]);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2; ++h) {
        __m512 sum = acc[0][t][h];
        for (int q = 1; q < S; ++q) sum = _mm512_add_ps(sum, acc[q][t][h]);
        total[t][h] = _mm512_fmadd_ps(sum, s[h], total[t][h]);
      }
  }
  for (int h = 0; h < 2; ++h) {
    const __m512 add = bias != nullptr ? _mm512_loadu_ps(bias + 32 * p + 16 * h)
                                       : _mm512_setzero_ps();
    for (int t = 0; t < T; ++t)
      bf16x16_store(out + t * ldo + 32 * p + 16 * h, _mm512_add_ps(total[t][h], add));
  }
}

using DotPanel = void (*)(const uint8_t*, const float*, int64_t, int64_t, int64_t,
                          const c10::BFloat16*, int64_t, int64_t, const float*, c10::BFloat16*,
                          int64_t);
constexpr int kDotRows = 8;  // rows of x per pass over a panel
constexpr DotPanel kDotPanel[kDotRows] = {&dot_panel<1>, &dot_panel<2>, &dot_panel<3>,
                                          &dot_panel<4>, &dot_panel<5>, &dot_panel<6>,
                                          &dot_panel<7>, &dot_panel<8>};

void dot_gemm(at::Tensor& out, const at::Tensor& x, const uint8_t* data, const float* scales,
              int64_t blocks, int64_t block, const c10::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  std::vector<float> bf;
  if (bias.has_value()) {
    bf.resize(n);
    load_row(bf.data(), bias->data_ptr<c10::BFloat16>(), n);
  }
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t t0 = 0; t0 < m; t0 += kDotRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kDotRows, m - t0));
        kDotPanel[rows - 1](data, scales, k, blocks, block, xp + t0 * ldx, ldx, p,
                            bf.empty() ? nullptr : bf.data(), op + t0 * ldo, ldo);
      }
  });
}

}  // namespace

namespace {

// fp8_gemm_bf16 below; amx: its panels on AMX tiles.
void fp8_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
              const at::Tensor& scales, int64_t block, const c10::optional<at::Tensor>& bias,
              bool dot, bool amx) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "fp8_gemm_bf16: bfloat16 x and out expected");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
              scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "fp8_gemm_bf16: uint8 data (e4m3 bytes) and contiguous float32 scales expected");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  const int64_t blocks = (k + block - 1) / block;
  TORCH_CHECK(data.size(1) == k && k > 0 && x.stride(1) == 1 && out.stride(1) == 1 &&
              out.size(0) == m && out.size(1) == n, "fp8_gemm_bf16: shapes do not match");
  TORCH_CHECK(n % 32 == 0 && k % 2 == 0 && x.stride(0) % 2 == 0,
              "fp8_gemm_bf16: panels of 32 rows of W and (k, k+1) pairs of x expected");
  TORCH_CHECK(block > 0 && (block % 2 == 0 || blocks == 1) && scales.size(0) == n &&
              scales.size(1) == blocks,
              "fp8_gemm_bf16: a scale per row and block of an even number of columns expected");
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
    dequantize_panel(dp, sp, k, blocks, block, p, panel);
  }, false, amx);
}

}  // namespace

void fp8_gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                   int64_t block, c10::optional<at::Tensor> bias, bool dot) {
  fp8_gemm(out, x, data, scales, block, bias, dot, false);
}

void fp8_gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                       int64_t block, c10::optional<at::Tensor> bias) {
  fp8_gemm(out, x, data, scales, block, bias, false, true);
}
#endif

}  // namespace cpullm
