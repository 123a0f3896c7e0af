// quant_gemm_bf16 and quant_gemm_bf16_amx: the groups layout's blocks dequantized into the
// operands of the bfloat16 GEMMs, on AVX-512 BF16's register tiles or on AMX.
#include "kept.h"

namespace cpullm {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace quant {
namespace {

// 64 u of step j of group g of a row, one per byte.
template <int BITS>
inline __m512i step_u(const uint8_t* row, const Group& g, int j) {
  const int lanes = g.blocks * g.lanes_per_block;
  const __mmask64 bytes = lanes == 16 ? ~__mmask64{0} : (__mmask64{1} << (4 * lanes)) - 1;
  const uint8_t* p = row + g.weight_offset;
  if (BITS == 8) return _mm512_maskz_loadu_epi8(bytes, p + j * 4 * lanes);
  if (g.steps >= 2) {
    const __m512i packed = _mm512_maskz_loadu_epi8(bytes, p + (j / 2) * 4 * lanes);
    return _mm512_and_si512(j % 2 ? _mm512_srli_epi16(packed, 4) : packed, _mm512_set1_epi8(0x0F));
  }
  return lanes == 16 ? load_step<true>(p, bytes) : load_step<false>(p, bytes);
}

// Rows [first[0], + 16) and [first[1], + 16) of W into a bfloat16 panel [k / 2][32][2]
// (dword [kk][c] = the pair (2kk, 2kk + 1) of panel row c: row first[c / 16] + c % 16). Per
// step, 16 rows' 32 pairs are transposed in registers, so that each pair's 16 rows go out as
// one 64-byte store. The rows ahead rows on (the next panel's) are prefetched into L2.
template <int BITS, typename S, bool MIN>
void dequantize_panel(const Weight& w, const int64_t* first, int64_t ahead,
                      const std::vector<Group>& groups, int block, int32_t* panel) {
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  for (int half = 0; half < 2; ++half) {
    const int64_t c0 = 16 * half;
    for (const Group& g : groups) {
      const int lanes = g.blocks * g.lanes_per_block;
      const __mmask16 mask = static_cast<__mmask16>((1u << g.blocks) - 1);
      const int shift = __builtin_ctz(static_cast<unsigned>(g.lanes_per_block));
      // Where dword i of a step's 32 pairs goes (lane i / 2, pair i % 2: weight e of block
      // b, at pair (b block + e) / 2 of the panel), in step 0; each step is 2 L pairs on.
      int64_t first_pair[32];
      for (int i = 0; i < 2 * lanes; ++i) {
        const int l = i / 2;
        const int64_t b = g.first_block + l / g.lanes_per_block;
        const int64_t e = 4 * (l % g.lanes_per_block) + 2 * (i % 2);
        first_pair[i] = (b * block + e) / 2 * 32;
      }
      const int64_t step_pairs = 2 * g.lanes_per_block * 32;
      // Per row and quarter of a step (lanes 4q .. 4q + 3, 4 u each): the scale and the
      // min (or -zero s) of each u's block, the same in every step of the group.
      __m512 s[16][4], m[16][4];
      for (int c = 0; c < 16; ++c) {
        const int64_t row = first[half] + c;
        _mm_prefetch(reinterpret_cast<const char*>(scales + (row + ahead) * w.blocks + g.first_block), _MM_HINT_T1);
        if (MIN) _mm_prefetch(reinterpret_cast<const char*>(mins + (row + ahead) * w.blocks + g.first_block), _MM_HINT_T1);
        const __m512 sc = load16(scales + row * w.blocks + g.first_block, mask);
        const __m512 mn = MIN ? load16(mins + row * w.blocks + g.first_block, mask)
                              : _mm512_mul_ps(sc, _mm512_set1_ps(-w.zero));
        for (int q = 0; q < 4; ++q) {
          const __m512i lane = _mm512_srli_epi32(_mm512_add_epi32(
              _mm512_set1_epi32(4 * q), _mm512_srli_epi32(_mm512_setr_epi32(
                  0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2)), shift);
          s[c][q] = _mm512_permutexvar_ps(lane, sc);
          m[c][q] = _mm512_permutexvar_ps(lane, mn);
        }
      }
      for (int j = 0; j < g.steps; ++j) {
        __m512i pairs[2][16];  // [lanes 0-7, lanes 8-15][row]: 16 pairs each
        for (int c = 0; c < 16; ++c) {
          const uint8_t* row = w.data + (first[half] + c) * w.row_bytes;
          // the next panel's rows into L2 as this one's are read (BITS / 8 lines a step)
          _mm_prefetch(reinterpret_cast<const char*>(row + ahead * w.row_bytes + g.weight_offset +
                                                     j * 4 * g.blocks * g.lanes_per_block * BITS / 8),
                       _MM_HINT_T1);
          const __m512i u = step_u<BITS>(row, g, j);
          __m512 v[4];
          for (int q = 0; q < 4; ++q)
            v[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, q))),
                                   s[c][q], m[c][q]);
          pairs[0][c] = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
          pairs[1][c] = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
        }
        for (int hl = 0; hl < 2 && 8 * hl < lanes; ++hl) {
          transpose16(pairs[hl]);
          const int count = std::min(16, 2 * (lanes - 8 * hl));
          for (int i = 0; i < count; ++i)
            _mm512_storeu_si512(panel + first_pair[16 * hl + i] + j * step_pairs + c0, pairs[hl][i]);
        }
      }
    }
  }
}

template <int BITS, int BLOCK, typename S, bool MIN>
struct PanelDequantizer {
  static constexpr auto entry = &dequantize_panel<BITS, S, MIN>;
};

// quant_gemm_bf16 below: its panels on the AVX-512 GEMM's register tiles.
void quant_gemm_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                       int64_t bits, int64_t block, int64_t zero,
                       const c10::optional<at::Tensor>& bias, bool silu_mul) {
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0), half_n = n / 2;
  const std::vector<Group>& groups =
      check_quant_gemm(out, x, data, scales, mins, bits, block, bias, silu_mul).groups;
  TORCH_CHECK(n % 32 == 0 && k % 2 == 0 && x.stride(0) % 2 == 0,
              "quant_gemm_bf16: 32-row panels of W (16 of gate and 16 of up with silu_mul) "
              "and (k, k+1) pairs of x expected");
  if (m == 0) return;
  const Weight w = weight_of(data, scales, mins, zero);
  const auto dequantize = pick_kept<PanelDequantizer>(bits, block, scales.scalar_type() == at::kHalf,
                                                      mins.has_value());
  gemm_on_panels(out, x, n, panel_bias(bias, n, silu_mul), [&](int64_t p, int32_t* panel) {
    const int64_t first[2] = {silu_mul ? 16 * p : 32 * p, silu_mul ? half_n + 16 * p : 32 * p + 16};
    dequantize(w, first, silu_mul ? 16 : 32, groups, static_cast<int>(block), panel);
  }, silu_mul);
}

// ----- the same blocks on AMX tiles, W the A operand -----
//
// On AMX a dequantized row of W needs no transpose: 16 rows of W by 32 k are the A operand
// of TDPBF16PS as they lie, and x, whose few rows are reused by every row of W, is laid out
// once as the B operand (pairs of k by 16 tokens). The products are [rows of W][tokens],
// transposed in registers on the way out (once per 32 x 32 block, over all of K). And since
// a dot product does not care in which order it meets its k, a row is written in the order
// its steps unpack (one 32-bit lane per block: byte b of every lane is one vector, scaled by
// the 16 blocks' scales as they lie), and x's pairs follow that order instead
// (pairs_of_chunks, layout.cpp): the dequantization is shifts, masks, conversions and FMAs,
// with one interleave per 32 weights.

// Rows [first[0], + 16) and [first[1], + 16) of W as bfloat16 A tiles, chunk after chunk:
// tiles [chunk][2][16 rows][16 pairs]; of those 32 rows, [r0, r1). The rows ahead rows on
// are prefetched into L2.
template <int BITS, typename S, bool MIN>
void dequantize_rows(const Weight& w, const int64_t* first, int64_t ahead,
                     const std::vector<Group>& groups, int32_t* tiles, int r0, int r1) {
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  const __m512i interleave = pair_halves();  // lane l's two bfloat16 values side by side
  const __m512i low_byte = _mm512_set1_epi32(0xFF);
  const __m512i lane_ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = r0; r < r1; ++r) {
    const int half = r / 16, c = r % 16;
    const int64_t row = first[half] + c;
    const uint8_t* data = w.data + row * w.row_bytes;
    const S* row_scales = scales + row * w.blocks;
    const S* row_mins = MIN ? mins + row * w.blocks : nullptr;
    _mm_prefetch(reinterpret_cast<const char*>(row_scales + ahead * w.blocks), _MM_HINT_T1);
    if (MIN) _mm_prefetch(reinterpret_cast<const char*>(row_mins + ahead * w.blocks), _MM_HINT_T1);
    int32_t* out = tiles + (16 * half + c) * 16;
    for (const Group& g : groups) {
      const __mmask16 mask = static_cast<__mmask16>((1u << g.blocks) - 1);
      __m512 sc = load16(row_scales + g.first_block, mask);
      __m512 mn = MIN ? load16(row_mins + g.first_block, mask)
                      : _mm512_mul_ps(sc, _mm512_set1_ps(-w.zero));
      if (g.lanes_per_block > 1) {  // lane l: block l / L
        const __m512i block_of = _mm512_srli_epi32(
            lane_ids, __builtin_ctz(static_cast<unsigned>(g.lanes_per_block)));
        sc = _mm512_permutexvar_ps(block_of, sc);
        mn = _mm512_permutexvar_ps(block_of, mn);
      }
      const int64_t step_bytes = 4 * g.blocks * g.lanes_per_block * BITS / 8;
      for (int j = 0; j < g.steps; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(data + ahead * w.row_bytes + g.weight_offset +
                                                   j * step_bytes), _MM_HINT_T1);
        const __m512i u = step_u<BITS>(data, g, j);
        __m512 v[4];
        for (int b = 0; b < 4; ++b)
          v[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
                                     b == 0 ? u : _mm512_srli_epi32(u, 8 * b), low_byte)),
                                 sc, mn);
        _mm512_storeu_si512(out, _mm512_permutexvar_epi16(
            interleave, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0])));
        _mm512_storeu_si512(out + 512, _mm512_permutexvar_epi16(
            interleave, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2])));
        out += 1024;
      }
    }
  }
}

template <int BITS, int BLOCK, typename S, bool MIN>
struct RowsDequantizer {
  static constexpr auto entry = &dequantize_rows<BITS, S, MIN>;
};

// x's rows as B tiles for those A tiles, into buffer (grown if needed): [token tile][chunk]
// [16 pairs][16 tokens], pair l of a chunk the one the layout's pairs name (zero where they
// name none, and past token m).
const __m512i* token_tiles(const at::Tensor& x, const RowLayout& layout,
                           std::vector<__m512i>& buffer) {
  const int64_t m = x.size(0), k2 = x.size(1) / 2, ldx2 = x.stride(0) / 2;
  const std::vector<int32_t>& pairs = layout.pairs;
  const std::vector<int32_t>& slot_of = layout.slot_of;
  const int64_t slots = static_cast<int64_t>(pairs.size()), tiles = (m + 15) / 16;
  if (static_cast<int64_t>(buffer.size()) < tiles * slots) buffer.resize(tiles * slots);
  __m512i* out = buffer.data();
  const auto* x32 = reinterpret_cast<const int32_t*>(x.data_ptr<c10::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      __m512i* dst = out + tile * slots;
      for (int64_t s = 0; s < slots; ++s)
        if (pairs[s] < 0) dst[s] = _mm512_setzero_si512();
      const int64_t t0 = 16 * tile, tokens = std::min<int64_t>(16, m - t0);
      for (int64_t q = 0; q < k2; q += 16) {
        const int64_t count = std::min<int64_t>(16, k2 - q);
        const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
        __m512i v[16];
        for (int t = 0; t < 16; ++t)
          v[t] = t < tokens ? _mm512_maskz_loadu_epi32(mask, x32 + (t0 + t) * ldx2 + q)
                            : _mm512_setzero_si512();
        transpose16(v);  // v[i]: pair q + i of the 16 tokens
        for (int64_t i = 0; i < count; ++i) dst[slot_of[q + i]] = v[i];
      }
    }
  });
  return out;
}

// acc [32 rows of W][32 tokens] = the A tiles w (both halves) by the B tiles x0 (tokens
// 0-15) and, if TWO, x1 (16-31), over chunks chunks; work() after each chunk's products.
template <bool TWO, typename Work>
void rows_tile_product(const int32_t* w, const __m512i* x0, const __m512i* x1, int64_t chunks,
                       float* acc, Work&& work) {
  // a chunk: 16 pairs of 32 rows of W (two 1 KiB tiles), of 16 tokens' (1 KiB)
  const TileSource a{{w, w + 256}, {64, 64}, 2048}, b{{x0, x1}, {64, 64}, 1024};
  tile_products<TileOp::kBF16, 2, TWO ? 2 : 1>(a, b, chunks, acc, false, [](int64_t) {}, work);
}

// 16 tokens' products with 32 rows of W (acc: [32 rows][32 tokens] float32, its first 16
// tokens' columns) as the tokens' rows of out, ldo apart: the bias of each row of W
// (bias_rows) added, and with silu_mul the 16 rows of gate and their 16 of up made one value
// first, so that one 16 x 16 transpose takes the rows to tokens: of float32 for silu_mul's
// 16 outputs, else of the two halves' bfloat16 values paired in 32 bits.
inline void store_token_rows(const float* acc, const float* bias_rows, bool silu_mul,
                             int64_t tokens, c10::BFloat16* out, int64_t ldo) {
  __m512i v[16];
  if (silu_mul) {
    for (int r = 0; r < 16; ++r)
      v[r] = _mm512_castps_si512(silu_mul16(
          _mm512_add_ps(_mm512_load_ps(acc + r * 32), _mm512_set1_ps(bias_rows[r])),
          _mm512_add_ps(_mm512_load_ps(acc + (16 + r) * 32), _mm512_set1_ps(bias_rows[16 + r]))));
    transpose16(v);
    for (int64_t i = 0; i < tokens; ++i) bf16x16_store(out + i * ldo, _mm512_castsi512_ps(v[i]));
    return;
  }
  const __m512i pair = pair_halves();  // and back:
  const __m512i unpair = _mm512_set_epi16(
      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
      30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int r = 0; r < 16; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(acc + r * 32), _mm512_set1_ps(bias_rows[r]));
    const __m512 hi =
        _mm512_add_ps(_mm512_load_ps(acc + (16 + r) * 32), _mm512_set1_ps(bias_rows[16 + r]));
    v[r] = _mm512_permutexvar_epi16(pair, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  transpose16(v);  // v[t]: 32-bit word r holds rows r and 16 + r of token t
  for (int64_t i = 0; i < tokens; ++i)
    _mm512_storeu_si512(out + i * ldo, _mm512_permutexvar_epi16(unpair, v[i]));
}

constexpr int64_t kKeptTokenTileBytes = 8 << 20;

// quant_gemm_bf16_amx below: 32 rows of W an item (16 of gate and 16 of up with silu_mul),
// dequantized once into A tiles that every 32 tokens of x run over.
void quant_gemm_rows_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                         int64_t bits, int64_t block, int64_t zero,
                         const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(amx_permitted(), "quant_gemm_bf16_amx: the OS gives this process no AMX tiles");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "quant_gemm_bf16_amx: bfloat16 out expected");
  const int64_t m = x.size(0), n = data.size(0), half_n = n / 2;
  const RowLayout& layout =
      check_quant_gemm(out, x, data, scales, mins, bits, block, bias, silu_mul);
  const std::vector<Group>& groups = layout.groups;
  TORCH_CHECK(n % 32 == 0 && x.stride(0) % 2 == 0,
              "quant_gemm_bf16_amx: 32-row blocks of W (16 of gate and 16 of up with silu_mul) "
              "and (k, k+1) pairs of x expected");
  if (m == 0) return;
  const Weight w = weight_of(data, scales, mins, zero);
  const auto dequantize = pick_kept<RowsDequantizer>(bits, block, scales.scalar_type() == at::kHalf,
                                                     mins.has_value());
  const int64_t chunks = static_cast<int64_t>(layout.pairs.size()) / 16;
  // x's tiles, in a buffer that this thread keeps for the next call unless it is large
  const int64_t xt_bytes = (m + 15) / 16 * static_cast<int64_t>(layout.pairs.size()) * 64;
  thread_local std::vector<__m512i> kept_buffer;
  std::vector<__m512i> large_buffer;
  const __m512i* xt = token_tiles(x, layout, xt_bytes <= kKeptTokenTileBytes ? kept_buffer
                                                                          : large_buffer);
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0), width = silu_mul ? 16 : 32;
  const int64_t token_blocks = (m + 31) / 32;
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    // Two buffers of A tiles [chunk][2][16 rows] of 16 pairs: while the tokens run over one
    // block of W, the next block is dequantized into the other, a few rows after each chunk.
    thread_local std::vector<__m512i> buffers;
    if (static_cast<int64_t>(buffers.size()) < 2 * chunks * 32) buffers.resize(2 * chunks * 32);
    int32_t* tiles[2] = {reinterpret_cast<int32_t*>(buffers.data()),
                         reinterpret_cast<int32_t*>(buffers.data() + chunks * 32)};
    auto first_rows = [&](int64_t p, int64_t* first) {
      first[0] = silu_mul ? 16 * p : 32 * p;
      first[1] = silu_mul ? half_n + 16 * p : 32 * p + 16;
    };
    int64_t first[2], next_first[2];
    first_rows(begin, first);
    dequantize(w, first, silu_mul ? 16 : 32, groups, tiles[0], 0, 32);
    alignas(64) float acc[32 * 32];
    for (int64_t p = begin; p < end; ++p) {
      first_rows(p, first);
      const int32_t* wt = tiles[(p - begin) % 2];
      int32_t* next = tiles[(p - begin + 1) % 2];
      const bool more = p + 1 < end;
      if (more) first_rows(p + 1, next_first);
      // the next block's rows, spread evenly over this block's chunk steps
      const int64_t calls = token_blocks * chunks;
      int64_t call = 0;
      int done = more ? 0 : 32;
      auto work = [&]() {
        ++call;
        const int target = static_cast<int>((call * 32 + calls - 1) / calls);
        if (target > done) {
          dequantize(w, next_first, silu_mul ? 16 : 32, groups, next, done, target);
          done = target;
        }
      };
      alignas(64) float bias_rows[32] = {};  // of the block's rows of W
      if (bp != nullptr) {
        _mm512_store_ps(bias_rows, bf16x16_load(bp + first[0]));
        _mm512_store_ps(bias_rows + 16, bf16x16_load(bp + first[1]));
      }
      for (int64_t t0 = 0; t0 < m; t0 += 32) {
        const __m512i* x0 = xt + (t0 / 16) * chunks * 16;
        if (t0 + 16 < m)
          rows_tile_product<true>(wt, x0, x0 + chunks * 16, chunks, acc, work);
        else
          rows_tile_product<false>(wt, x0, nullptr, chunks, acc, work);
        for (int64_t q = 0; q < 2 && t0 + 16 * q < m; ++q)
          store_token_rows(acc + 16 * q, bias_rows, silu_mul,
                           std::min<int64_t>(16, m - t0 - 16 * q),
                           op + (t0 + 16 * q) * ldo + width * p, ldo);
      }
    }
    release_tiles();
  });
}

}  // namespace
}  // namespace quant

using namespace quant;

void quant_gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                     c10::optional<at::Tensor> mins, int64_t bits, int64_t block, int64_t zero,
                     c10::optional<at::Tensor> bias, bool silu_mul) {
  quant_gemm_panels(out, x, data, scales, mins, bits, block, zero, bias, silu_mul);
}

void quant_gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                         c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                         int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul) {
  quant_gemm_rows_amx(out, x, data, scales, mins, bits, block, zero, bias, silu_mul);
}
#endif

}  // namespace cpullm
