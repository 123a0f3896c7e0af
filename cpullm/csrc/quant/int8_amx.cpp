// Per-channel INT8 (W8A8's weights: u = q + 128, one scale per row of W) laid out as AMX-INT8
// B tiles at load time: [n / 16][k / 64][16][64], tile row i holding k = 64 j + 4 i .. + 3 of
// each of 16 rows of W (quantization/kept.py, AmxInt8Weight). x is quantized per token (W8A8's
// dynamic scheme: dx = max |x| / 127 over the token), in order, so its rows are the A tiles
// as they lie, and the product of a token and a row of W over all of K is one chain of
// TDPBSUD, scaled once at the end:
//     y[t][r] = dx[t] s[r] (sum_k q[t][k] u[r][k] - 128 sum_k q[t][k]) + bias[r]
// Tiles: 4 sums (32 tokens x 32 rows of W), 2 of x, 2 of W; each step of 64 k loads 4 tiles
// for 4 tile products. Up to 8 tokens (a decode step) read the same tiles on AVX-512 VNNI.
#include "kept.h"

namespace cpullm {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace quant {
namespace {

constexpr int64_t kInt8TokenBytes = 1 << 20;  // the quantized tokens a pass keeps in L2

struct QuantizedTokens {
  std::unique_ptr<int8_t[]> q;    // [tokens, rounded up to 16][k]
  std::vector<float> scale;       // dx per token
  std::vector<int32_t> zero_sum;  // 128 sum(q) per token
};

QuantizedTokens quantize_tokens(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), padded = (m + 15) / 16 * 16;
  QuantizedTokens out{std::unique_ptr<int8_t[]>(new int8_t[padded * k]),
                      std::vector<float>(padded, 0.f), std::vector<int32_t>(padded, 0)};
  std::memset(out.q.get() + m * k, 0, (padded - m) * k);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, m, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int32_t total = 0;
      out.scale[t] = quantize_span(xp + t * x.stride(0), k, out.q.get() + t * k, total);
      out.zero_sum[t] = 128 * total;
    }
  });
  return out;
}

// acc [32 tokens][32 rows of W] (int32) = TT x 16 tokens (at a, lda bytes apart) times WR x
// 16 rows of W (their tiles at w, w + wtile), over steps steps. next: a block of W to bring
// into L2 as these run, or null: bytes [line0, line1) x 64 of each step's 2 KiB of it (at
// next, next + wtile), so that the token tiles over a block share its prefetch.
template <int TT, int WR>
void int8_tile_product(const int8_t* a, int64_t lda, const uint8_t* w, int64_t wtile,
                       int64_t steps, const uint8_t* next, int line0, int line1, int32_t* acc) {
  // a step: 64 k of the tokens' rows, a 1 KiB tile of each 16 rows of W
  const TileSource x{{a, a + 16 * lda}, {lda, lda}, 64}, wt{{w, w + wtile}, {64, 64}, 1024};
  auto prefetch = [&](int64_t j) {
    if (next != nullptr)
      for (int line = line0; line < line1; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + (line / 16) * wtile + j * 1024 +
                                                   (line % 16) * 64), _MM_HINT_T1);
  };
  tile_products<TileOp::kS8U8, TT, WR>(x, wt, steps, acc, false, prefetch, NoWork{});
}

// A few tokens (T <= kInt8VnniTokens) by the same tiles on AVX-512 VNNI: row i of a tile is
// 16 rows of W's 4 bytes of k = 64 j + 4 i .. + 3, so one VPDPBUSD with those 4 bytes of a
// token broadcast adds them into 16 rows' sums, one row of W a lane: no horizontal sums, no
// repacking, and the weights streamed once (16 rows of W are k * 16 contiguous bytes).
// Rows [r, r + 16) of W (tiles at w, their scales at row_scales, their bias b) into y[t],
// float32, for each of the T tokens.
constexpr int kInt8VnniTokens = 8;

template <int T>
void int8_vnni_rows(const int8_t* xq, int64_t k, const uint8_t* w, const float* scale,
                    const int32_t* zero_sum, const float* row_scales, __m512 b, __m512* y) {
  constexpr int kChains = T == 1 ? 4 : T == 2 ? 2 : 1;  // independent sums per token
  __m512i acc[T][kChains];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < kChains; ++c) acc[t][c] = _mm512_setzero_si512();
  const int32_t* xd = reinterpret_cast<const int32_t*>(xq);
  for (int64_t j = 0; j < k / 64; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (j + 8) * 1024), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m512i wv = _mm512_loadu_si512(w + j * 1024 + i * 64);
      for (int t = 0; t < T; ++t)
        acc[t][i % kChains] = _mm512_dpbusd_epi32(acc[t][i % kChains], wv,
                                                  _mm512_set1_epi32(xd[t * k / 4 + 16 * j + i]));
    }
  }
  const __m512 s = _mm512_loadu_ps(row_scales);
  for (int t = 0; t < T; ++t) {
    __m512i sum = acc[t][0];
    for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[t][c]);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(zero_sum[t])));
    y[t] = _mm512_fmadd_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(scale[t])), b);
  }
}

using Int8VnniRows = void (*)(const int8_t*, int64_t, const uint8_t*, const float*,
                              const int32_t*, const float*, __m512, __m512*);
constexpr Int8VnniRows kInt8VnniRows[kInt8VnniTokens] = {
    &int8_vnni_rows<1>, &int8_vnni_rows<2>, &int8_vnni_rows<3>, &int8_vnni_rows<4>,
    &int8_vnni_rows<5>, &int8_vnni_rows<6>, &int8_vnni_rows<7>, &int8_vnni_rows<8>};

using Int8TileProduct = void (*)(const int8_t*, int64_t, const uint8_t*, int64_t, int64_t,
                                 const uint8_t*, int, int, int32_t*);
constexpr Int8TileProduct kInt8TileProducts[2][2] = {
    {&int8_tile_product<1, 1>, &int8_tile_product<1, 2>},
    {&int8_tile_product<2, 1>, &int8_tile_product<2, 2>}};

}  // namespace
}  // namespace quant

using namespace quant;

// silu_mul: W is gate and up stacked (rows [0, n / 2) and [n / 2, n), each a multiple of 16),
// and out [m, n / 2] gets silu(gate) * up: a block of tiles takes 16 rows of gate and the same
// 16 of up, and their sums leave as one product, rounded as gemm_bf16's.
void quant_gemm_int8_amx(at::Tensor out, at::Tensor x, at::Tensor tiles, at::Tensor row_scales,
                         c10::optional<at::Tensor> bias, bool silu_mul) {
  TORCH_CHECK(amx_permitted(), "quant_gemm_int8_amx: the OS gives this process no AMX tiles");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              x.stride(1) == 1 && out.stride(1) == 1, "quant_gemm_int8_amx: rows of bfloat16 x and out");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 4 &&
              tiles.size(2) == 16 && tiles.size(3) == 64,
              "quant_gemm_int8_amx: uint8 tiles [n / 16, k / 64, 16, 64] expected");
  const int64_t m = x.size(0), k = x.size(1), n = tiles.size(0) * 16;
  TORCH_CHECK(tiles.size(1) * 64 == k && out.size(0) == m &&
              out.size(1) == (silu_mul ? n / 2 : n) && (!silu_mul || n % 32 == 0),
              "quant_gemm_int8_amx: shapes do not match");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
              row_scales.numel() == n, "quant_gemm_int8_amx: a float32 scale per row of W");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                bias->numel() == n, "quant_gemm_int8_amx: a bfloat16 bias of n values expected");
  if (m == 0) return;
  const QuantizedTokens xq = quantize_tokens(x);
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const float* sp = row_scales.data_ptr<float>();
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0), steps = k / 64, padded = (m + 15) / 16 * 16, up = n / 2;
  auto bias_at = [&](int64_t r) { return bp != nullptr ? bf16x16_load(bp + r) : _mm512_setzero_ps(); };
  if (m <= kInt8VnniTokens) {
    // 16 rows of W (with silu_mul, 16 of gate and their 16 of up) an item
    at::parallel_for(0, silu_mul ? n / 32 : n / 16, 4, [&](int64_t begin, int64_t end) {
      __m512 y[kInt8VnniTokens], y_up[kInt8VnniTokens];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = 16 * item;
        kInt8VnniRows[m - 1](xq.q.get(), k, wp + r * k, xq.scale.data(), xq.zero_sum.data(),
                             sp + r, bias_at(r), y);
        if (silu_mul)
          kInt8VnniRows[m - 1](xq.q.get(), k, wp + (up + r) * k, xq.scale.data(),
                               xq.zero_sum.data(), sp + up + r, bias_at(up + r), y_up);
        for (int64_t t = 0; t < m; ++t) {
          if (silu_mul)
            store_panel_row<true>(op + t * ldo + r, y[t], y_up[t], _mm512_setzero_ps(),
                                  _mm512_setzero_ps());
          else
            bf16x16_store(op + t * ldo + r, y[t]);
        }
      }
    });
    return;
  }
  // A block of tiles: 32 rows of W, or with silu_mul 16 of gate and 16 of up (wtile: bytes
  // from its first 16 rows' tiles to its second's).
  const int64_t blocks = silu_mul ? n / 32 : (n + 31) / 32, wtile = silu_mul ? up * k : 16 * k;
  auto block_rows = [&](int64_t item) { return silu_mul ? 16 * item : 32 * item; };
  const int64_t token_block = std::max<int64_t>(32, kInt8TokenBytes / k / 32 * 32);
  // Each thread takes a run of 32-row blocks of W; for many tokens it walks them a block of
  // tokens at a time, whose quantized x stays in L2 while its rows of W come past.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) int32_t acc[32 * 32];
    for (int64_t tb = 0; tb < padded; tb += token_block) {
      const int64_t te = std::min(padded, tb + token_block);
      const int64_t pairs = (te - tb + 31) / 32;
      const int share = static_cast<int>((32 + pairs - 1) / pairs);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r0 = block_rows(item), wr = silu_mul ? 2 : std::min<int64_t>(32, n - r0) / 16;
        // the block this thread takes next: its next one, or its first one again for the
        // next block of tokens
        const int64_t next_r0 = item + 1 < end ? block_rows(item + 1)
                                : te < padded ? block_rows(begin) : -1;
        const int next_lines = next_r0 < 0 ? 0
            : silu_mul ? 32 : static_cast<int>(std::min<int64_t>(32, n - next_r0));
        for (int64_t t0 = tb; t0 < te; t0 += 32) {
          const int64_t tt = std::min<int64_t>(32, te - t0) / 16;
          const int line0 = std::min<int>(next_lines, static_cast<int>((t0 - tb) / 32) * share);
          const int line1 = std::min<int>(next_lines, line0 + share);
          kInt8TileProducts[tt - 1][wr - 1](xq.q.get() + t0 * k, k, wp + r0 * k, wtile, steps,
                                           line0 < line1 ? wp + next_r0 * k : nullptr,
                                           line0, line1, acc);
          // token i's value of the block's rows 16 h .. 16 h + 15
          auto value = [&](int64_t i, int64_t h, __m512 s, __m512 b) {
            const int64_t t = t0 + i;
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(
                _mm512_load_si512(acc + i * 32 + 16 * h), _mm512_set1_epi32(xq.zero_sum[t])));
            return _mm512_fmadd_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(xq.scale[t])), b);
          };
          if (silu_mul) {
            const __m512 s_gate = _mm512_loadu_ps(sp + r0), s_up = _mm512_loadu_ps(sp + up + r0);
            const __m512 b_gate = bias_at(r0), b_up = bias_at(up + r0);
            for (int64_t i = 0; i < 16 * tt && t0 + i < m; ++i)
              store_panel_row<true>(op + (t0 + i) * ldo + r0, value(i, 0, s_gate, b_gate),
                                    value(i, 1, s_up, b_up), _mm512_setzero_ps(),
                                    _mm512_setzero_ps());
            continue;
          }
          for (int64_t h = 0; h < wr; ++h) {
            const int64_t r = r0 + 16 * h;
            const __m512 s = _mm512_loadu_ps(sp + r), b = bias_at(r);
            for (int64_t i = 0; i < 16 * tt && t0 + i < m; ++i)
              bf16x16_store(op + (t0 + i) * ldo + r, value(i, h, s, b));
          }
        }
      }
    }
    release_tiles();
  });
}
#endif

}  // namespace cpullm
