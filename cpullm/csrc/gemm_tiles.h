// The bfloat16 GEMM's register tiles, shared by the dense GEMM (gemm.cpp) and the GEMM of
// kept-quantized weights on dequantized panels (quant/tiled_panels.cpp).
#pragma once

#include "vec.h"

#include <array>
#include <functional>
#include <utility>
#include <vector>

namespace cpullm {

#if defined(__AVX512BF16__)
constexpr int kGemmRows = 12;
constexpr int64_t kGemmBlockRows = 264;  // rows of x a thread keeps in L2 across its panels

// x, or where its rows lie a multiple of 4 KiB apart (a hidden size of 2048, 4096, ...) and
// there are enough of them, a copy of x with its rows 64 bytes further apart. Rows 4 KiB
// apart fall in one set of L1 (8 ways): a tile's 12 rows evict each other at every k step.
// Measured on Zen 4, one thread, the 1B Llama's four layer shapes: 10-17% faster at 4096
// rows, 12-20% at 128, 2-10% at 32, none at 8 (the copy's cost is less than 1%).
inline at::Tensor rows_apart(const at::Tensor& x) {
  constexpr int64_t kFromRows = 16;
  if (x.size(0) < kFromRows || x.stride(0) * x.element_size() % 4096 != 0) return x;
  at::Tensor copy = at::empty({x.size(0), x.size(1) + 32}, x.options()).narrow(1, 0, x.size(1));
  copy.copy_(x);
  return copy;
}

// silu(gate) * up of 16 gate and 16 up sums (bias included), rounded where
// silu_and_mul_bf16 rounds; the product's own rounding is the store's.
inline __m512 silu_mul16(__m512 gate_sum, __m512 up_sum) {
  const __m512 gate = bf16_round(gate_sum), up = bf16_round(up_sum);
  const __m512 act = bf16_round(_mm512_div_ps(
      gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
  return _mm512_mul_ps(act, up);
}

// One row of a panel's product, 32 float32 columns in two halves, stored as bfloat16 (or,
// O = float, as float32: logits) with the bias added; with SILU_MUL the halves are 16 gate
// and 16 up columns, and the row stored is silu(gate) * up, rounded where silu_and_mul_bf16
// rounds. Every bf16 GEMM ends in it.
template <bool SILU_MUL, typename O>
inline void store_panel_row(O* out, __m512 lo, __m512 hi, __m512 bias_lo, __m512 bias_hi) {
  if (SILU_MUL) {
    store16(out, silu_mul16(_mm512_add_ps(lo, bias_lo), _mm512_add_ps(hi, bias_hi)));
  } else {
    store16(out, _mm512_add_ps(lo, bias_lo));
    store16(out + 16, _mm512_add_ps(hi, bias_hi));
  }
}

template <int MR, bool PREFETCH, bool SILU_MUL, typename O>
void gemm_tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t k2,
               const c10::BFloat16* bias, O* out, int64_t ldo, const char* next) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // (k, k+1) pairs
  const int64_t ldx2 = ldx / 2;
  for (int64_t kk = 0; kk < k2; ++kk) {
    if (PREFETCH) {
      _mm_prefetch(next + kk * 128, _MM_HINT_T1);
      _mm_prefetch(next + kk * 128 + 64, _MM_HINT_T1);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + kk * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + kk * 64 + 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xp[r * ldx2 + kk]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias0 = bf16x16_load(bias);
    bias1 = bf16x16_load(bias + 16);
  }
  for (int r = 0; r < MR; ++r)
    store_panel_row<SILU_MUL>(out + r * ldo, acc[r][0], acc[r][1], bias0, bias1);
}

template <typename O>
using GemmTile = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                          const c10::BFloat16*, O*, int64_t, const char*);
template <typename O = c10::BFloat16>
using GemmTiles = std::array<GemmTile<O>, kGemmRows>;

// gemm_tiles<PREFETCH, SILU_MUL, O>(...)[rows - 1] computes a tile of that many rows.
template <bool PREFETCH, bool SILU_MUL, typename O, int... MR>
constexpr GemmTiles<O> gemm_tiles(std::integer_sequence<int, MR...>) {
  return GemmTiles<O>{&gemm_tile<MR + 1, PREFETCH, SILU_MUL, O>...};
}

// What a kernel's out holds: bfloat16, or float32 (the LM head's logits). f(O{}) runs the
// kernel's body for that type.
template <typename F>
void with_out_type(const at::Tensor& out, const char* name, F&& f) {
  if (out.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, name, ": bfloat16 or float32 out expected");
    f(c10::BFloat16{});
  }
}

// out [m, n] = x [m, k] @ W.T (+ bias) for a W that is never held in bfloat16 whole:
// dequantize(p, panel) writes panel p's 32 rows of W into a bfloat16 panel [k / 2][32][2]
// (the packed GEMM's layout): rows [32 p, 32 p + 32), or with silu_mul 16 rows of gate and
// their 16 rows of up, whose product is stored as 16 columns of silu(gate) * up (out
// [m, n / 2]; the bias, if any, 16 gate and 16 up values a panel). Each thread dequantizes
// its panels one at a time and runs every row of x over each: x comes from L3 (or L2, up
// to a few hundred rows), the panel from L1/L2.
template <typename O, typename Dequantize>
void gemm_on_panels_as(at::Tensor& out, const at::Tensor& x, int64_t n,
                       const c10::optional<at::Tensor>& bias, Dequantize&& dequantize,
                       bool silu_mul) {
  using Rows = std::make_integer_sequence<int, kGemmRows>;
  static const GemmTiles<O> plain = gemm_tiles<false, false, O>(Rows{});
  static const GemmTiles<O> fused = gemm_tiles<false, true, O>(Rows{});
  const GemmTiles<O>& tiles = silu_mul ? fused : plain;
  const int64_t m = x.size(0), k = x.size(1), width = silu_mul ? 16 : 32;
  const at::Tensor xs = rows_apart(x);
  const c10::BFloat16* xp = xs.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  O* op = out.data_ptr<O>();
  const int64_t ldx = xs.stride(0), ldo = out.stride(0);
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> panel(16 * k);  // [k / 2][32] pairs
    auto* pp = reinterpret_cast<const c10::BFloat16*>(panel.data());
    for (int64_t p = begin; p < end; ++p) {
      dequantize(p, panel.data());
      for (int64_t r = 0; r < m; r += kGemmRows) {
        const int64_t rows = std::min<int64_t>(kGemmRows, m - r);
        tiles[rows - 1](xp + r * ldx, ldx, pp, k / 2, bp != nullptr ? bp + 32 * p : nullptr,
                        op + r * ldo + width * p, ldo, nullptr);
      }
    }
  });
}

template <typename Dequantize>
void gemm_on_panels(at::Tensor& out, const at::Tensor& x, int64_t n,
                    const c10::optional<at::Tensor>& bias, Dequantize&& dequantize,
                    bool silu_mul) {
  with_out_type(out, "gemm_on_panels", [&](auto o) {
    gemm_on_panels_as<decltype(o)>(out, x, n, bias, dequantize, silu_mul);
  });
}

// gemm_on_panels on AMX tiles (gemm_amx.cpp), for K a multiple of 32 where
// amx_bf16_ready(), silu_mul as above: dequantize(p, panel, part0, part1) writes parts
// [part0, part1) of panel p (of parts in all).
using PanelParts = std::function<void(int64_t, int32_t*, int64_t, int64_t)>;
void gemm_on_panels_amx(at::Tensor& out, const at::Tensor& x, int64_t n,
                        const c10::optional<at::Tensor>& bias, const PanelParts& dequantize,
                        int64_t parts, bool silu_mul);

// ... a whole panel at a time: dequantize(p, panel).
inline void gemm_on_panels_amx(at::Tensor& out, const at::Tensor& x, int64_t n,
                               const c10::optional<at::Tensor>& bias,
                               const std::function<void(int64_t, int32_t*)>& dequantize,
                               bool silu_mul) {
  gemm_on_panels_amx(out, x, n, bias, [&](int64_t p, int32_t* panel, int64_t, int64_t) {
    dequantize(p, panel);
  }, 1, silu_mul);
}

// gemm_on_panels on AMX tiles or on the register tiles above.
template <typename Dequantize>
void gemm_on_panels(at::Tensor& out, const at::Tensor& x, int64_t n,
                    const c10::optional<at::Tensor>& bias, Dequantize&& dequantize,
                    bool silu_mul, bool amx) {
  if (amx)
    gemm_on_panels_amx(out, x, n, bias, dequantize, silu_mul);
  else
    gemm_on_panels(out, x, n, bias, dequantize, silu_mul);
}

#endif

}  // namespace cpullm
