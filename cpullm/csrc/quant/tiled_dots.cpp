// quant_gemm_tiled_int8 and quant_gemm_tiled_grouped: the int8 dot products on the 16-row
// tiles (tiled.h), on AVX-512 VNNI where the library has it, else on AVX2.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "tiled_dots_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "tiled_dots_avx2.h"
#endif

namespace cpullm {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace quant {

namespace {
// tiled_dots of the library's level, by layout, tokens and tiles
template <int BITS, int BLOCK, typename S, bool MIN>
struct TiledDots {
  using Fn = void (*)(const TiledWeight&, int64_t, int64_t, const BlockQuantizedX&, int64_t,
                      Sums*);
  template <bool P>
  static constexpr Fn one(int t, int g) {
    constexpr Fn table[kTiledTokens][2] = {
        {&tiled_dots<BITS, BLOCK, S, MIN, 1, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 1, 2, P>},
        {&tiled_dots<BITS, BLOCK, S, MIN, 2, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 2, 2, P>},
        {&tiled_dots<BITS, BLOCK, S, MIN, 3, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 3, 2, P>},
        {&tiled_dots<BITS, BLOCK, S, MIN, 4, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 4, 2, P>}};
    return table[t][g];
  }
  // [PREFETCH][tokens - 1][tiles - 1]
  static constexpr Fn entry[2][kTiledTokens][2] = {
      {{one<false>(0, 0), one<false>(0, 1)}, {one<false>(1, 0), one<false>(1, 1)},
       {one<false>(2, 0), one<false>(2, 1)}, {one<false>(3, 0), one<false>(3, 1)}},
      {{one<true>(0, 0), one<true>(0, 1)}, {one<true>(1, 0), one<true>(1, 1)},
       {one<true>(2, 0), one<true>(2, 1)}, {one<true>(3, 0), one<true>(3, 1)}}};
};
}  // namespace

// A set of tiles laid out again for the many tokens a thread runs over it: u of 5 or 6 bits
// widened to a byte and two-level scales multiplied out, once per set and block of rows
// instead of in every item of 4 tokens (where the dot products are compute-bound, the
// few instructions that read the file-sized layout would cost up to a third more).
struct WideTiles {
  std::vector<uint8_t> data;
  std::vector<float> scales, mins;
  TiledWeight view{};

  // Tiles g0, g0 + apart, ... (gs of them) of w as tiles 0 .. gs - 1 of view.
  void of(const TiledWeight& w, int64_t g0, int64_t apart, int gs, int64_t bits, int64_t block,
          at::ScalarType scale_type) {
    const int64_t chunks = w.k / 32, wide_bits = bits == 4 ? 4 : 8;
    const int64_t tile_bytes = w.k * 2 * wide_bits;
    data.resize(gs * tile_bytes);
    scales.resize(gs * w.blocks * 16);
    mins.resize(w.mins != nullptr ? scales.size() : 0);
    for (int g = 0; g < gs; ++g) {
      const int64_t tile = g0 + g * apart;
      const uint8_t* src = w.data + tile * w.tile_bytes;
      uint8_t* dst = data.data() + g * tile_bytes;
      if (bits == 4)
        std::memcpy(dst, src, tile_bytes);
      for (int64_t c = 0; bits != 4 && c < chunks; ++c)
        (bits == 5 ? widen_chunk<5> : widen_chunk<6>)(src + c * bits * 64, dst + c * 8 * 64);
      expand(w.scales, scales.data() + g * w.blocks * 16, w, tile, block, scale_type);
      if (w.mins != nullptr)
        expand(w.mins, mins.data() + g * w.blocks * 16, w, tile, block, scale_type);
    }
    view = TiledWeight{data.data(), scales.data(), w.mins != nullptr ? mins.data() : nullptr,
                       w.k, w.blocks, tile_bytes, w.zero};
  }

  // tile g's scales (or mins) as float32 [blocks][16]: two-level ones as gguf's products
  static void expand(const void* values, float* out, const TiledWeight& w, int64_t g,
                     int64_t block, at::ScalarType scale_type) {
    const int64_t n = w.blocks * 16;
    if (scale_type == at::kFloat) {
      std::memcpy(out, static_cast<const float*>(values) + g * n, n * sizeof(float));
    } else if (scale_type == at::kHalf) {
      const at::Half* half = static_cast<const at::Half*>(values) + g * n;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(half[i]);
    } else {
      const int64_t per = kSuperBlock / block, supers = w.k / kSuperBlock;
      const int8_t* record = static_cast<const int8_t*>(values) + g * supers * (32 + 16 * per);
      for (int64_t s = 0; s < supers; ++s, record += 32 + 16 * per) {
        float factor[16];
        for (int lane = 0; lane < 16; ++lane)
          factor[lane] = static_cast<float>(reinterpret_cast<const at::Half*>(record)[lane]);
        for (int64_t b = 0; b < per; ++b, out += 16)
          for (int lane = 0; lane < 16; ++lane)
            out[lane] = factor[lane] * static_cast<float>(record[32 + 16 * b + lane]);
      }
    }
  }
};

// Above this many quads of tokens over a set of tiles in a block of rows, WideTiles.
constexpr int64_t kWideQuads = 4;

TiledWeight check_tiled(const at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        int64_t bits, int64_t block, int64_t zero,
                        const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && out.stride(1) == 1 &&
              (out.scalar_type() == at::kBFloat16 ||
               (out.scalar_type() == at::kFloat && !silu_mul)),
              "quant_gemm_tiled: bfloat16 x, bfloat16 or float32 (logits, without silu_mul) out, "
              "unit column strides expected");
  TORCH_CHECK((bits == 4 || bits == 5 || bits == 6 || bits == 8) &&
              (block == 16 || block == 32 || block == 64 || block == 128),
              "quant_gemm_tiled: bits 4, 5, 6 or 8, blocks of 16, 32, 64 or 128");
  const bool two_levels = scales.scalar_type() == at::kChar;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 2 &&
              scales.is_contiguous() && scales.dim() == 3 &&
              (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat ||
               two_levels),
              "quant_gemm_tiled: uint8 data [n / 16, k * 2 bits] and float16 or float32 "
              "scales [n / 16, blocks, 16] (or int8 two-level records) expected");
  const int64_t m = x.size(0), k = x.size(1), tiles = data.size(0), n = 16 * tiles;
  TORCH_CHECK(k % 32 == 0 && k % block == 0 && data.size(1) == k * 2 * bits &&
              scales.size(0) == tiles &&
              out.size(0) == m && out.size(1) == (silu_mul ? n / 2 : n),
              "quant_gemm_tiled: shapes do not match (K a multiple of 32)");
  if (two_levels) {
    TORCH_CHECK(k % kSuperBlock == 0 && scales.size(1) == k / kSuperBlock &&
                scales.size(2) == 32 + 16 * (kSuperBlock / block),
                "quant_gemm_tiled: two-level records [n / 16, k / 256, 32 + 16 blocks] expected");
  } else {
    TORCH_CHECK(scales.size(1) == k / block && scales.size(2) == 16,
                "quant_gemm_tiled: scales [n / 16, k / block, 16] expected");
  }
  if (mins.has_value())
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                mins->sizes() == scales.sizes(), "quant_gemm_tiled: mins like scales expected");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                bias->numel() == n, "quant_gemm_tiled: a bfloat16 bias of n values expected");
  return TiledWeight{data.data_ptr<uint8_t>(), scales.data_ptr(),
                     mins.has_value() ? mins->data_ptr() : nullptr, k, k / block,
                     data.size(1), static_cast<float>(zero)};
}

}  // namespace quant

using namespace quant;

void quant_gemm_tiled_int8(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                           c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                           int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul) {
  const TiledWeight w = check_tiled(out, x, data, scales, mins, bits, block, zero, bias, silu_mul);
  const int64_t m = x.size(0), tiles = data.size(0);
  TORCH_CHECK(!silu_mul || kStoresSiluMul,
              "quant_gemm_tiled_int8: this library stores products, not SiLU-mul");
  TORCH_CHECK(!silu_mul || tiles % 2 == 0,
              "quant_gemm_tiled_int8: gate and up of 16-row multiples expected");
  if (m == 0) return;
  const auto dots = pick_kept<TiledDots>(bits, block, scales.scalar_type(),
                                         mins.has_value());
  const bool widens = bits == 5 || bits == 6 || scales.scalar_type() == at::kChar;
  const auto wide_dots = pick_kept<TiledDots>(bits == 4 ? 4 : 8, block, at::kFloat,
                                              mins.has_value());
  // float32 out (logits): x in two levels, rows 2t and 2t + 1 of xq for token t, whose
  // products are added (a pair never splits: t0 below is a multiple of 4)
  const bool logits = out.scalar_type() == at::kFloat;
  const BlockQuantizedX xq = quantize_blocks(x, block, logits);
  const int64_t rows = logits ? 2 * m : m;
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const TiledOut to = tiled_out(out);
  // an item: 4 rows of xq by a set of two tiles, g0 and g0 + apart (with silu_mul, 16 rows
  // of gate and their 16 of up); for one token, of one tile (one stream of W an item, which
  // keeps up with memory better than two)
  const int64_t per = !silu_mul && m == 1 ? 1 : 2;
  const int64_t sets = silu_mul ? tiles / 2 : (tiles + per - 1) / per;
  const int64_t apart = silu_mul ? tiles / 2 : 1;
  const int64_t quads = (rows + kTiledTokens - 1) / kTiledTokens;
  const int64_t block_quads = std::min<int64_t>(quads, kTiledBlockRows / kTiledTokens);
  at::parallel_for(0, sets * quads, 1, [&](int64_t begin, int64_t end) {
    Sums acc[kTiledTokens * 2];
    WideTiles wide;
    int64_t wide_of = -1;  // the set and block of rows wide holds (set + sets tb)
    for (int64_t item = begin; item < end; ++item) {
      // blocks of block_quads quads of tokens (the last one maybe fewer), each set of
      // tiles over a block's quads in turn
      const int64_t tb = item / (sets * block_quads), local = item % (sets * block_quads);
      const int64_t in_block = std::min(block_quads, quads - tb * block_quads);
      const int64_t set = local / in_block;
      const int64_t t0 = (tb * block_quads + local % in_block) * kTiledTokens;
      const int64_t g0 = silu_mul ? set : per * set;
      const int tokens = static_cast<int>(std::min<int64_t>(kTiledTokens, rows - t0));
      const int gs = silu_mul ? 2 : static_cast<int>(std::min<int64_t>(per, tiles - g0));
      if (widens && in_block > kWideQuads) {
        if (wide_of != set + sets * tb) {
          wide.of(w, g0, apart, gs, bits, block, scales.scalar_type());
          wide_of = set + sets * tb;
        }
        wide_dots[false][tokens - 1][gs - 1](wide.view, 0, 1, xq, t0, acc);
      } else {
        // up to 4 tokens, W read once as it streams from memory: prefetched
        dots[quads == 1][tokens - 1][gs - 1](w, g0, apart, xq, t0, acc);
      }
      store_sums(acc, tokens, gs, t0, g0, apart, silu_mul ? set : -1, bp, to);
    }
  });
}

// Several weights of one shape and layout, weight i over rows [offsets[i], offsets[i + 1]) of x
// (a mixture's chosen experts): x quantized once, and every (weight, set of tiles, 4 rows)
// one item of a single parallel loop, each as quant_gemm_tiled_int8 runs it.
void quant_gemm_tiled_grouped(at::Tensor out, at::Tensor x, std::vector<at::Tensor> data,
                              std::vector<at::Tensor> scales, std::vector<at::Tensor> mins,
                              std::vector<at::Tensor> biases, std::vector<int64_t> offsets,
                              int64_t bits, int64_t block, int64_t zero) {
  const int64_t weights = static_cast<int64_t>(data.size());
  TORCH_CHECK(weights > 0 && static_cast<int64_t>(scales.size()) == weights &&
              (mins.empty() || static_cast<int64_t>(mins.size()) == weights) &&
              (biases.empty() || static_cast<int64_t>(biases.size()) == weights) &&
              static_cast<int64_t>(offsets.size()) == weights + 1 && offsets[0] == 0 &&
              offsets[weights] == x.size(0),
              "quant_gemm_tiled_grouped: a scale (and min, bias) per weight and offsets "
              "[0, ..., rows]");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16,
              "quant_gemm_tiled_grouped: bfloat16 out expected");
  std::vector<TiledWeight> tiled;
  for (int64_t i = 0; i < weights; ++i) {
    TORCH_CHECK(offsets[i] <= offsets[i + 1] && data[i].sizes() == data[0].sizes() &&
                scales[i].scalar_type() == scales[0].scalar_type(),
                "quant_gemm_tiled_grouped: weights of one shape and layout expected");
    tiled.push_back(check_tiled(
        out, x, data[i], scales[i],
        mins.empty() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(mins[i]), bits,
        block, zero, biases.empty() ? c10::optional<at::Tensor>() : biases[i], false));
  }
  if (x.size(0) == 0) return;
  const auto dots = pick_kept<TiledDots>(bits, block, scales[0].scalar_type(),
                                         !mins.empty());
  const BlockQuantizedX xq = quantize_blocks(x, block, false);
  const TiledOut to = tiled_out(out);
  // (weight, first row, rows, first tile, tiles, prefetch): a weight's sets of two tiles
  // (one for a weight of one row, as quant_gemm_tiled_int8 takes one token) each over its
  // rows 4 at a time
  struct Item {
    int64_t weight, t0, g0;
    int tokens, gs;
    bool prefetch;
  };
  std::vector<Item> items;
  const int64_t tiles = data[0].size(0);
  for (int64_t i = 0; i < weights; ++i) {
    const int64_t rows = offsets[i + 1] - offsets[i], per = rows == 1 ? 1 : 2;
    for (int64_t g0 = 0; rows > 0 && g0 < tiles; g0 += per)
      for (int64_t t = 0; t < rows; t += kTiledTokens)
        items.push_back(Item{i, offsets[i] + t, g0,
                             static_cast<int>(std::min<int64_t>(kTiledTokens, rows - t)),
                             static_cast<int>(std::min(per, tiles - g0)), rows <= kTiledTokens});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Sums acc[kTiledTokens * 2];
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      dots[item.prefetch][item.tokens - 1][item.gs - 1](tiled[item.weight], item.g0, 1, xq,
                                                        item.t0, acc);
      store_sums(acc, item.tokens, item.gs, item.t0, item.g0, 1, -1,
                 biases.empty() ? nullptr : biases[item.weight].data_ptr<c10::BFloat16>(), to);
    }
  });
}
#endif

}  // namespace cpullm
