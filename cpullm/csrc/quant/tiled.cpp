// A kept weight is laid out again after loading (quantization/kept.py, TiledWeight) with 16
// rows of W side by side, one per 32-bit lane: per 16 rows
// ("a group") and 32 k ("a chunk"), steps of 64 bytes whose lane r holds 4 consecutive k of
// row r. With 8 bits, 8 steps, step q the k 4q .. 4q + 3; with 4 bits, 4 steps, step q
// those k in its low halves and 16 + 4q .. 16 + 4q + 3 in its high ones. The scales (and
// mins) are [groups][blocks][16]. So:
// - dequantized, a step is rows of the B operand of TDPBF16PS as they lie (pairs of k by 16
//   columns of W), and half of a row of the dense GEMM's panels: a group's 16 rows need no
//   transpose, and the dense GEMMs run on the panels they make (gemm_on_panels_amx, x the A
//   operand where it lies, the products stored as they come: no tiles of x to lay out, no
//   products to transpose; gemm_on_panels on AVX-512 BF16);
// - for a few rows of x, a step is the operand of VNNI's dot products of 4 u by 4 q per
//   lane, x quantized to int8 per block and broadcast 4 k at a time. On CPUs whose BF16 dot
//   products are no faster than their VNNI ones (Zen 4: a VNNI instruction does twice the
//   multiply-adds at the same rate) these win at every number of rows.
// quantization/kept.py (TiledWeight.kernel_for) picks between them by rows and CPU.
#include "kept.h"

namespace cpullm {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace quant {
namespace {

struct TiledWeight {
  const uint8_t* data;  // [groups][k / 32][steps][64]
  const void* scales;   // [groups][blocks][16]
  const void* mins;     // the same, or null
  int64_t k, blocks, group_bytes;
  float zero;
};

inline __m512 group_values(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 group_values(const float* p) { return _mm512_loadu_ps(p); }

// The scale and the min (or -zero s) of block b of group g's 16 rows.
template <typename S, bool MIN>
inline void group_scales(const TiledWeight& w, int64_t g, int64_t b, __m512& s, __m512& m) {
  const int64_t at = (g * w.blocks + b) * 16;
  s = group_values(static_cast<const S*>(w.scales) + at);
  m = MIN ? group_values(static_cast<const S*>(w.mins) + at)
          : _mm512_mul_ps(s, _mm512_set1_ps(-w.zero));
}

// The u of each lane that SHIFT moves to the bits of mask, as the float32 one + u: one is
// 128 (4 bits: u at bits 16-19 of its mantissa) or 256 (8 bits: u at bits 15-22).
template <int SHIFT>
inline __m512 biased_u(__m512i v, __m512i mask, __m512i one) {
  if constexpr (SHIFT > 0) v = _mm512_slli_epi32(v, SHIFT);
  if constexpr (SHIFT < 0) v = _mm512_srli_epi32(v, -SHIFT);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, mask, one, 0xEA));  // v & mask | one
}

// Parts [part0, part1) of groups group[0] and group[1] of W as a bfloat16 panel [k / 2][32]
// [2] (columns 0-15 and 16-31), a part 32 k of one group (part i: chunk i % (k / 32) of
// group[i / (k / 32)]): w = s u + m = s (one + u) + (m - one s), one FMA per 16 weights.
// The groups ahead groups on (the next panel's) are prefetched into L2.
template <int BITS, typename S, bool MIN, int BLOCK>
void dequantize_tiled(const TiledWeight& w, const int64_t* group, int64_t ahead,
                      int32_t* panel, int64_t part0, int64_t part1) {
  constexpr int kSteps = BITS == 4 ? 4 : 8;
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
      group_scales<S, MIN>(w, group[half], (32 * c + 16 * h) / BLOCK, s[h], m[h]);
      m[h] = _mm512_fnmadd_ps(s[h], _mm512_set1_ps(one), m[h]);
    }
    const uint8_t* steps = w.data + group[half] * w.group_bytes + c * kSteps * 64;
    int32_t* out = panel + c * 16 * 32 + 16 * half;  // pair 16c, this half's columns
    for (int q = 0; q < kSteps; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(steps + ahead * w.group_bytes + q * 64),
                   _MM_HINT_T1);
      const __m512i u = _mm512_loadu_si512(steps + q * 64);
      if (BITS == 8) {
        const int h = q / 4;
        store(out + 2 * q * 32, _mm512_fmadd_ps(biased_u<15>(u, mask, bits), s[h], m[h]),
              _mm512_fmadd_ps(biased_u<7>(u, mask, bits), s[h], m[h]));
        store(out + (2 * q + 1) * 32, _mm512_fmadd_ps(biased_u<-1>(u, mask, bits), s[h], m[h]),
              _mm512_fmadd_ps(biased_u<-9>(u, mask, bits), s[h], m[h]));
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

// x quantized to int8 per block, in order: q [m][k], dx and dx sum(q) [m][blocks].
struct BlockQuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

// two_levels: as quantize_x's (rows 2t and 2t + 1 for token t).
BlockQuantizedX quantize_blocks(const at::Tensor& x, int64_t block, bool two_levels) {
  const int64_t k = x.size(1), blocks = k / block, per_token = two_levels ? 2 : 1;
  const int64_t m = x.size(0) * per_token;
  BlockQuantizedX out{std::vector<int8_t>(m * k), std::vector<float>(m * blocks),
                      std::vector<float>(m * blocks)};
  auto quantize = [&](const auto* row, int64_t t) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t total = 0;
      const float d = quantize_span(row + b * block, block, out.q.data() + t * k + b * block,
                                    total);
      out.scale[t * blocks + b] = d;
      out.sum[t * blocks + b] = d * static_cast<float>(total);
    }
  };
  quantize_levels(x, block, two_levels, 4, quantize);
  return out;
}

constexpr int64_t kTiledAhead = 4096;  // bytes of a group prefetched ahead (tiled_dots)

// Tokens [t0, t0 + T) by G groups g0, g0 + apart, ... (16 G rows of W), as float32 [T][G][16]
// in acc: per block, the integer sums of u q (4 k per lane per instruction, x's 4 broadcast)
// meet the block's scales once: s dx sum(u q) + m dx sum(q). PREFETCH: each step's bytes
// kTiledAhead on are brought into L1 (where W streams from memory past a few rows of x: the
// hardware's prefetch does not cross the 4 KiB pages of a group's bytes).
template <int BITS, int BLOCK, typename S, bool MIN, int T, int G, bool PREFETCH>
void tiled_dots(const TiledWeight& w, int64_t g0, int64_t apart, const BlockQuantizedX& xq,
                int64_t t0, __m512* acc) {
  constexpr int kSteps = BITS == 4 ? 4 : 8;
  const int64_t k = w.k;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // chains of integer sums per token and group: at least 8 in all where there are fewer
  // tokens and groups than that, so that VPDPBUSD's latency is covered
  constexpr int C = T * G >= 8 ? 1 : T * G >= 4 ? 2 : 4;
  __m512i sums[T][G][C];
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      acc[t * G + g] = _mm512_setzero_ps();
      for (int i = 0; i < C; ++i) sums[t][g][i] = _mm512_setzero_si512();
    }
  for (int64_t c = 0; c < k / 32; ++c)
    for (int h = 0; h < 2; ++h) {  // k 32c + 16h .. + 15
      for (int q = 0; q < 4; ++q) {
        __m512i u[G];
        for (int g = 0; g < G; ++g) {
          const uint8_t* steps = w.data + (g0 + g * apart) * w.group_bytes + c * kSteps * 64;
          if (PREFETCH && (h == 0 || BITS == 8))  // the group's bytes kTiledAhead on
            _mm_prefetch(reinterpret_cast<const char*>(steps + kTiledAhead +
                                                       (BITS == 8 ? 4 * h + q : q) * 64),
                         _MM_HINT_T0);
          if (BITS == 8) {
            u[g] = _mm512_loadu_si512(steps + (4 * h + q) * 64);
          } else {
            const __m512i packed = _mm512_loadu_si512(steps + q * 64);
            u[g] = _mm512_and_si512(h ? _mm512_srli_epi16(packed, 4) : packed, low);
          }
        }
        for (int t = 0; t < T; ++t) {
          int32_t quad;
          std::memcpy(&quad, xq.q.data() + (t0 + t) * k + 32 * c + 16 * h + 4 * q, 4);
          const __m512i xs = _mm512_set1_epi32(quad);
          for (int g = 0; g < G; ++g)
            sums[t][g][q % C] = _mm512_dpbusd_epi32(sums[t][g][q % C], u[g], xs);
        }
      }
      const int64_t kk = 32 * c + 16 * h + 16;  // k done
      if (kk % BLOCK == 0) {
        const int64_t b = kk / BLOCK - 1;
        for (int g = 0; g < G; ++g) {
          __m512 s, m;
          group_scales<S, MIN>(w, g0 + g * apart, b, s, m);
          for (int t = 0; t < T; ++t) {
            const int64_t at = (t0 + t) * w.blocks + b;
            __m512& a = acc[t * G + g];
            for (int i = 1; i < C; ++i)
              sums[t][g][0] = _mm512_add_epi32(sums[t][g][0], sums[t][g][i]);
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][g][0]),
                                _mm512_mul_ps(s, _mm512_set1_ps(xq.scale[at])), a);
            a = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.sum[at]), a);
            for (int i = 0; i < C; ++i) sums[t][g][i] = _mm512_setzero_si512();
          }
        }
      }
    }
}

constexpr int kTiledTokens = 4;  // tokens of x per item of the int8 dot products
// Rows of x whose int8 copy (k bytes each) a thread's sets of groups run over before the
// next such block: W is read from memory once per block, x's block from L2.
constexpr int64_t kTiledBlockRows = 256;

template <int BITS, int BLOCK, typename S, bool MIN>
struct TiledDots {
  using Fn = void (*)(const TiledWeight&, int64_t, int64_t, const BlockQuantizedX&, int64_t,
                      __m512*);
  template <bool P>
  static constexpr Fn one(int t, int g) {
    constexpr Fn table[kTiledTokens][2] = {
        {&tiled_dots<BITS, BLOCK, S, MIN, 1, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 1, 2, P>},
        {&tiled_dots<BITS, BLOCK, S, MIN, 2, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 2, 2, P>},
        {&tiled_dots<BITS, BLOCK, S, MIN, 3, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 3, 2, P>},
        {&tiled_dots<BITS, BLOCK, S, MIN, 4, 1, P>, &tiled_dots<BITS, BLOCK, S, MIN, 4, 2, P>}};
    return table[t][g];
  }
  // [PREFETCH][tokens - 1][groups - 1]
  static constexpr Fn entry[2][kTiledTokens][2] = {
      {{one<false>(0, 0), one<false>(0, 1)}, {one<false>(1, 0), one<false>(1, 1)},
       {one<false>(2, 0), one<false>(2, 1)}, {one<false>(3, 0), one<false>(3, 1)}},
      {{one<true>(0, 0), one<true>(0, 1)}, {one<true>(1, 0), one<true>(1, 1)},
       {one<true>(2, 0), one<true>(2, 1)}, {one<true>(3, 0), one<true>(3, 1)}}};
};

// Where quant_gemm_tiled_int8's sums go: bfloat16 rows, or float32 logits (a token's two
// levels of x, rows 2t and 2t + 1 of its quantized x, added).
struct TiledOut {
  float* logits;
  c10::BFloat16* rows;
  int64_t ldo;
};

inline TiledOut tiled_out(const at::Tensor& out) {
  const bool logits = out.scalar_type() == at::kFloat;
  return TiledOut{logits ? out.data_ptr<float>() : nullptr,
                  logits ? nullptr : out.data_ptr<c10::BFloat16>(), out.stride(0)};
}

// The sums of tiled_dots (acc [tokens][gs][16]: rows t0.. of the quantized x by groups g0,
// g0 + apart, ...) into out's rows, the bias (bp, or null) added. silu_set >= 0: the two
// groups are 16 rows of gate and their 16 of up, stored as silu(gate) * up in columns
// 16 silu_set ...
inline void store_sums(const __m512* acc, int tokens, int gs, int64_t t0, int64_t g0,
                       int64_t apart, int64_t silu_set, const c10::BFloat16* bp,
                       const TiledOut& out) {
  auto biased = [&](__m512 sum, int64_t r) {
    return bp ? _mm512_add_ps(sum, bf16x16_load(bp + r)) : sum;
  };
  if (out.logits != nullptr) {
    for (int t = 0; t < tokens; t += 2) {
      float* row = out.logits + (t0 + t) / 2 * out.ldo;
      for (int g = 0; g < gs; ++g) {
        const int64_t r = 16 * (g0 + g * apart);
        _mm512_storeu_ps(row + r, biased(_mm512_add_ps(acc[t * gs + g], acc[(t + 1) * gs + g]), r));
      }
    }
    return;
  }
  for (int t = 0; t < tokens; ++t) {
    const __m512* sums = acc + t * gs;
    c10::BFloat16* row = out.rows + (t0 + t) * out.ldo;
    if (silu_set >= 0) {
      bf16x16_store(row + 16 * silu_set,
                    silu_mul16(biased(sums[0], 16 * g0), biased(sums[1], 16 * (g0 + apart))));
      continue;
    }
    for (int g = 0; g < gs; ++g) {
      const int64_t r = 16 * (g0 + g * apart);
      bf16x16_store(row + r, biased(sums[g], r));
    }
  }
}

TiledWeight check_tiled(const at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        int64_t bits, int64_t block, int64_t zero,
                        const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && out.stride(1) == 1 &&
              (out.scalar_type() == at::kBFloat16 ||
               (out.scalar_type() == at::kFloat && !silu_mul)),
              "quant_gemm_tiled: bfloat16 x, bfloat16 or float32 (logits, without silu_mul) out, "
              "unit column strides expected");
  TORCH_CHECK((bits == 4 || bits == 8) && (block == 16 || block == 32 || block == 64 || block == 128),
              "quant_gemm_tiled: bits 4 or 8, blocks of 16, 32, 64 or 128");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 2 &&
              scales.is_contiguous() && scales.dim() == 3 &&
              (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "quant_gemm_tiled: uint8 data [n / 16, k * 2 bits] and float16 or float32 "
              "scales [n / 16, blocks, 16] expected");
  const int64_t m = x.size(0), k = x.size(1), groups = data.size(0), n = 16 * groups;
  TORCH_CHECK(k % 32 == 0 && k % block == 0 && data.size(1) == k * 2 * bits &&
              scales.size(0) == groups && scales.size(1) == k / block && scales.size(2) == 16 &&
              out.size(0) == m && out.size(1) == (silu_mul ? n / 2 : n),
              "quant_gemm_tiled: shapes do not match (K a multiple of 32)");
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

}  // namespace
}  // namespace quant

using namespace quant;

void quant_gemm_tiled_int8(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                           c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                           int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul) {
  const TiledWeight w = check_tiled(out, x, data, scales, mins, bits, block, zero, bias, silu_mul);
  const int64_t m = x.size(0), groups = data.size(0);
  TORCH_CHECK(!silu_mul || groups % 2 == 0,
              "quant_gemm_tiled_int8: gate and up of 16-row multiples expected");
  if (m == 0) return;
  const auto dots = pick_kept<TiledDots>(bits, block, scales.scalar_type() == at::kHalf,
                                         mins.has_value());
  // float32 out (logits): x in two levels, rows 2t and 2t + 1 of xq for token t, whose
  // products are added (a pair never splits: t0 below is a multiple of 4)
  const bool logits = out.scalar_type() == at::kFloat;
  const BlockQuantizedX xq = quantize_blocks(x, block, logits);
  const int64_t rows = logits ? 2 * m : m;
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const TiledOut to = tiled_out(out);
  // an item: 4 rows of xq by a set of two groups, g0 and g0 + apart (with silu_mul, 16 rows
  // of gate and their 16 of up); for one token, of one group (one stream of W an item, which
  // keeps up with memory better than two)
  const int64_t per = !silu_mul && m == 1 ? 1 : 2;
  const int64_t sets = silu_mul ? groups / 2 : (groups + per - 1) / per;
  const int64_t apart = silu_mul ? groups / 2 : 1;
  const int64_t quads = (rows + kTiledTokens - 1) / kTiledTokens;
  const int64_t block_quads = std::min<int64_t>(quads, kTiledBlockRows / kTiledTokens);
  at::parallel_for(0, sets * quads, 1, [&](int64_t begin, int64_t end) {
    __m512 acc[kTiledTokens * 2];
    for (int64_t item = begin; item < end; ++item) {
      // blocks of block_quads quads of tokens (the last one maybe fewer), each set of
      // groups over a block's quads in turn
      const int64_t tb = item / (sets * block_quads), local = item % (sets * block_quads);
      const int64_t in_block = std::min(block_quads, quads - tb * block_quads);
      const int64_t set = local / in_block;
      const int64_t t0 = (tb * block_quads + local % in_block) * kTiledTokens;
      const int64_t g0 = silu_mul ? set : per * set;
      const int tokens = static_cast<int>(std::min<int64_t>(kTiledTokens, rows - t0));
      const int gs = silu_mul ? 2 : static_cast<int>(std::min<int64_t>(per, groups - g0));
      // up to 4 tokens, W read once as it streams from memory: prefetched
      dots[quads == 1][tokens - 1][gs - 1](w, g0, apart, xq, t0, acc);
      store_sums(acc, tokens, gs, t0, g0, apart, silu_mul ? set : -1, bp, to);
    }
  });
}

// Several weights of one shape and layout, weight i over rows [offsets[i], offsets[i + 1]) of x
// (a mixture's chosen experts): x quantized once, and every (weight, set of groups, 4 rows)
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
  const auto dots = pick_kept<TiledDots>(bits, block, scales[0].scalar_type() == at::kHalf,
                                         !mins.empty());
  const BlockQuantizedX xq = quantize_blocks(x, block, false);
  const TiledOut to = tiled_out(out);
  // (weight, first row, rows, first group, groups, prefetch): a weight's sets of two groups
  // (one for a weight of one row, as quant_gemm_tiled_int8 takes one token) each over its
  // rows 4 at a time
  struct Item {
    int64_t weight, t0, g0;
    int tokens, gs;
    bool prefetch;
  };
  std::vector<Item> items;
  const int64_t groups = data[0].size(0);
  for (int64_t i = 0; i < weights; ++i) {
    const int64_t rows = offsets[i + 1] - offsets[i], per = rows == 1 ? 1 : 2;
    for (int64_t g0 = 0; rows > 0 && g0 < groups; g0 += per)
      for (int64_t t = 0; t < rows; t += kTiledTokens)
        items.push_back(Item{i, offsets[i] + t, g0,
                             static_cast<int>(std::min<int64_t>(kTiledTokens, rows - t)),
                             static_cast<int>(std::min(per, groups - g0)), rows <= kTiledTokens});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    __m512 acc[kTiledTokens * 2];
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      dots[item.prefetch][item.tokens - 1][item.gs - 1](tiled[item.weight], item.g0, 1, xq,
                                                        item.t0, acc);
      store_sums(acc, item.tokens, item.gs, item.t0, item.g0, 1, -1,
                 biases.empty() ? nullptr : biases[item.weight].data_ptr<c10::BFloat16>(), to);
    }
  });
}

namespace quant {
namespace {

// quant_gemm_tiled_bf16 and quant_gemm_tiled_amx: panels of two groups (16 rows of gate and
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
  const auto dequantize = pick_kept<TiledDequantizer>(bits, block, scales.scalar_type() == at::kHalf,
                                                      mins.has_value());
  const PanelParts panel_parts = [&](int64_t p, int32_t* panel, int64_t part0, int64_t part1) {
    const int64_t group[2] = {silu_mul ? p : 2 * p, silu_mul ? n / 32 + p : 2 * p + 1};
    dequantize(w, group, silu_mul ? 1 : 2, panel, part0, part1);
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
