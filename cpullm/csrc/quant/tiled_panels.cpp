// quant_gemm_tiled_bf16 and quant_gemm_tiled_amx: the 16-row tiles (tiled.h) dequantized
// into the bf16 GEMMs' panels, on AVX-512 BF16 and on AMX tiles.
#include "tiled.h"

namespace cpullm {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace quant {
namespace {

// The u of each lane that SHIFT moves to the bits of mask, as the float32 one + u: one is
// 128 (4 bits: u at bits 16-19 of its mantissa) or 256 (5 to 8 bits: one u a byte, at
// bits 15-22).
template <int SHIFT>
inline __m512 biased_u(__m512i v, __m512i mask, __m512i one) {
  if constexpr (SHIFT > 0) v = _mm512_slli_epi32(v, SHIFT);
  if constexpr (SHIFT < 0) v = _mm512_srli_epi32(v, -SHIFT);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, mask, one, 0xEA));  // v & mask | one
}

// Parts [part0, part1) of tiles tile[0] and tile[1] of W as a bfloat16 panel [k / 2][32]
// [2] (columns 0-15 and 16-31), a part 32 k of one tile (part i: chunk i % (k / 32) of
// tile[i / (k / 32)]): w = s u + m = s (one + u) + (m - one s), one FMA per 16 weights.
// The tiles ahead tiles on (the next panel's) are prefetched into L2.
template <int BITS, typename S, bool MIN, int BLOCK>
void dequantize_tiled(const TiledWeight& w, const int64_t* tile, int64_t ahead,
                      int32_t* panel, int64_t part0, int64_t part1) {
  constexpr int kSteps = BITS;  // 64-byte steps a chunk of 32 k
  const float one = BITS == 4 ? 128.f : 256.f;
  const __m512i mask = _mm512_set1_epi32(BITS == 4 ? 0x000F0000 : 0x007F8000);
  const __m512i bits = _mm512_set1_epi32(BITS == 4 ? 0x43000000 : 0x43800000);
  const __m512i interleave = pair_halves();
  // pairs (a[l], b[l]) of 16 columns: one row of the panel's half
  auto store = [&](int32_t* dst, __m512 a, __m512 b) {
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a)));
  };
  const int64_t chunks = w.k / 32;
  for (int64_t part = part0; part < part1; ++part) {
    const int64_t half = part / chunks, c = part % chunks;
    __m512 s[2], m[2];  // of k 32c .. + 15 and 32c + 16 .. + 31
    for (int h = 0; h < 2; ++h) {
      tile_scales<S, MIN, BLOCK>(w, tile[half], (32 * c + 16 * h) / BLOCK, s[h], m[h]);
      m[h] = _mm512_fnmadd_ps(s[h], _mm512_set1_ps(one), m[h]);
    }
    const uint8_t* steps = w.data + tile[half] * w.tile_bytes + c * kSteps * 64;
    int32_t* out = panel + c * 16 * 32 + 16 * half;  // pair 16c, this half's columns
    // step i of 8 (k 4i .. 4i + 3 of each lane) as one u a byte
    auto store_bytes = [&](int i, __m512i u) {
      const int h = i / 4;
      store(out + 2 * i * 32, _mm512_fmadd_ps(biased_u<15>(u, mask, bits), s[h], m[h]),
            _mm512_fmadd_ps(biased_u<7>(u, mask, bits), s[h], m[h]));
      store(out + (2 * i + 1) * 32, _mm512_fmadd_ps(biased_u<-1>(u, mask, bits), s[h], m[h]),
            _mm512_fmadd_ps(biased_u<-9>(u, mask, bits), s[h], m[h]));
    };
    for (int q = 0; q < kSteps; ++q)
      _mm_prefetch(reinterpret_cast<const char*>(steps + ahead * w.tile_bytes + q * 64),
                   _MM_HINT_T1);
    for (int q = 0; q < (BITS == 8 ? 8 : 4); ++q) {
      const __m512i u = _mm512_loadu_si512(steps + q * 64);
      if constexpr (BITS == 8) {
        store_bytes(q, u);
      } else if constexpr (BITS > 4) {  // 5 or 6 bits: the low halves, the high bits
        const __m512i low = _mm512_set1_epi8(0x0F);
        store_bytes(q, with_high_bits<BITS>(_mm512_and_si512(u, low), steps, q));
        store_bytes(4 + q, with_high_bits<BITS>(_mm512_and_si512(_mm512_srli_epi16(u, 4), low),
                                                steps, 4 + q));
      } else {
        store(out + 2 * q * 32, _mm512_fmadd_ps(biased_u<16>(u, mask, bits), s[0], m[0]),
              _mm512_fmadd_ps(biased_u<8>(u, mask, bits), s[0], m[0]));
        store(out + (2 * q + 1) * 32, _mm512_fmadd_ps(biased_u<0>(u, mask, bits), s[0], m[0]),
              _mm512_fmadd_ps(biased_u<-8>(u, mask, bits), s[0], m[0]));
        store(out + (8 + 2 * q) * 32, _mm512_fmadd_ps(biased_u<12>(u, mask, bits), s[1], m[1]),
              _mm512_fmadd_ps(biased_u<4>(u, mask, bits), s[1], m[1]));
        store(out + (9 + 2 * q) * 32, _mm512_fmadd_ps(biased_u<-4>(u, mask, bits), s[1], m[1]),
              _mm512_fmadd_ps(biased_u<-12>(u, mask, bits), s[1], m[1]));
      }
    }
  }
}

template <int BITS, int BLOCK, typename S, bool MIN>
struct TiledDequantizer {
  static constexpr auto entry = &dequantize_tiled<BITS, S, MIN, BLOCK>;
};

// quant_gemm_tiled_bf16 and quant_gemm_tiled_amx: panels of two tiles (16 rows of gate and
// their 16 of up with silu_mul) dequantized in parts, on AMX tiles (the next panel's parts
// between the current one's tile products) or on the AVX-512 GEMM's register tiles (a
// whole panel before its products).
void tiled_panels(const char* name, at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                  const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
                  int64_t block, int64_t zero, const c10::optional<at::Tensor>& bias,
                  bool silu_mul, bool amx) {
  const TiledWeight w = check_tiled(out, x, data, scales, mins, bits, block, zero, bias, silu_mul);
  const int64_t n = 16 * data.size(0), parts = 2 * (x.size(1) / 32);
  TORCH_CHECK(n % 32 == 0, name, ": 32-row panels of W (16 of gate and 16 of up with silu_mul) "
              "expected");
  if (x.size(0) == 0) return;
  const auto dequantize = pick_kept<TiledDequantizer>(bits, block, scales.scalar_type(),
                                                      mins.has_value());
  const PanelParts panel_parts = [&](int64_t p, int32_t* panel, int64_t part0, int64_t part1) {
    const int64_t tile[2] = {silu_mul ? p : 2 * p, silu_mul ? n / 32 + p : 2 * p + 1};
    dequantize(w, tile, silu_mul ? 1 : 2, panel, part0, part1);
  };
  const c10::optional<at::Tensor> biases = panel_bias(bias, n, silu_mul);
  if (amx) {
    gemm_on_panels_amx(out, x, n, biases, panel_parts, parts, silu_mul);
  } else {
    gemm_on_panels(out, x, n, biases, [&](int64_t p, int32_t* panel) {
      panel_parts(p, panel, 0, parts);
    }, silu_mul);
  }
}

}  // namespace
}  // namespace quant

using namespace quant;

// The panels of quant_gemm_tiled_amx (below) on the AVX-512 GEMM's register tiles, for CPUs
// without AMX.
void quant_gemm_tiled_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                           c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                           int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul) {
  tiled_panels("quant_gemm_tiled_bf16", out, x, data, scales, mins, bits, block, zero, bias,
               silu_mul, false);
}

void quant_gemm_tiled_amx(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                          c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                          int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul) {
  TORCH_CHECK(amx_permitted(), "quant_gemm_tiled_amx: the OS gives this process no AMX tiles");
  tiled_panels("quant_gemm_tiled_amx", out, x, data, scales, mins, bits, block, zero, bias,
               silu_mul, true);
}
#endif

}  // namespace cpullm
