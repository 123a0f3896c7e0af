// x @ W.T on kept-quantized weights (GGUF block types; AWQ, GPTQ and compressed-tensors
// int groups), in the layout that cpullm/model_executor/layers/quantization/gguf_blocks.py
// packs: per row of W, small unsigned integers u, a scale per block of 16, 32, 64 or 128
// weights (float16 or float32) and either a min per block (w = s * u + m) or a zero point
// (w = s * (u - zero)).
//
// x is quantized to int8 per block (scale dx, and dx * sum(q) per block), so that each
// block's dot product is an integer one, four u8 x s8 products per lane per VNNI
// instruction:
//     sum_i w_i x_i = s dx sum_i u_i q_i + (m or -zero s) dx sum_i q_i
// The weights are read once, as stored (4.5-10 bits each): a decode step reads 2-4x fewer
// bytes than from bfloat16.
//
// Layout: the blocks of a row go in groups of 16 blocks, one block per 32-bit lane; the
// remainder in groups of 8, 4, 2 and 1 blocks, a block over 2, 4, 8 or 16 lanes (at most
// block / 4), so that every group fills the 16 lanes. A group of G blocks with L lanes
// per block is S = block / (4 L) steps of 64 bytes; in step j, lane g L + i holds
// u[4 (j L + i) .. + 3] of the group's block g:
//
//     16 blocks, step j:  | blk 0: u[4j..4j+3] | blk 1: u[4j..4j+3] | ... | blk 15 |
//
// so that the integer sums build up in registers and meet their scales once per group,
// with no shuffling for the groups of 16. With 4 bits, steps 2i and 2i + 1 share bytes
// (step 2i in the low halves); a one-step group of 16 lanes keeps bytes i and i + 32 of
// its step in byte i; a one-step group of fewer lanes (one block of 32) one u per byte.
// x is laid out in the same steps, per token.
//
// For many rows of x (prompts, big batches) the same blocks feed the bfloat16 GEMM instead
// (quant_gemm_bf16): each thread dequantizes 32 rows of W at a time into a panel of the dense
// GEMM's layout and runs its tiles on it. A VNNI instruction does 64 multiply-adds and a
// BF16 dot product 32, but on Zen 5 the first issues once per cycle and the second twice,
// so once a step is compute-bound the int8 path, with its unpacking and per-group scaling
// on top, loses; dequantizing a panel costs about 8 rows of the bf16 GEMM, and from ~20
// rows on the panels are faster (docs/quantization.md).
#include "gemm_tiles.h"
#include "ops.h"

#include <vector>

namespace cpullm {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

// One group of blocks of a row, as laid out above.
struct Group {
  int64_t first_block;
  int blocks, lanes_per_block, steps;
  int64_t weight_offset;  // bytes into a row of W
  int64_t x_offset;       // bytes into a token's quantized x
};

std::vector<Group> groups_of(int64_t blocks, int block, int bits) {
  std::vector<Group> groups;
  int64_t b0 = 0, w = 0, x = 0;
  while (b0 < blocks) {
    const int64_t left = blocks - b0;
    int g = 16;
    while (g > left) g /= 2;
    const int per_block = std::min(16 / g, block / 4), steps = block / (4 * per_block);
    const int lanes = g * per_block;
    groups.push_back(Group{b0, g, per_block, steps, w, x});
    const int64_t bytes = 4 * lanes * steps;  // u in this group
    w += bits == 8 ? bytes : (steps == 1 && lanes < 16 ? bytes : bytes / 2);
    x += 64 * steps;
    b0 += g;
  }
  return groups;
}

// Scales and mins of up to 16 blocks as float32.
inline __m512 load16(const at::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

// x as int8 in the weights' steps, per token (lanes past a group's end zero), dx and
// dx * sum(q) per block.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  int64_t q_stride, block_stride;
};

template <int BLOCK>
void quantize_row(const c10::BFloat16* x, const std::vector<Group>& groups, int8_t* q,
                  float* scale, float* sum) {
  alignas(64) int8_t block_q[BLOCK];
  for (const Group& g : groups) {
    for (int lb = 0; lb < g.blocks; ++lb) {
      const int64_t b = g.first_block + lb;
      __m512 v[BLOCK / 16];
      __m512 amax = _mm512_setzero_ps();
      for (int i = 0; i < BLOCK / 16; ++i) {
        v[i] = bf16x16_load(x + b * BLOCK + 16 * i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
      }
      const float d = _mm512_reduce_max_ps(amax) / 127.f;
      const __m512 inv = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
      int32_t total = 0;
      for (int i = 0; i < BLOCK / 16; ++i) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  // to nearest
        total += _mm512_reduce_add_epi32(qi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(block_q + 16 * i), _mm512_cvtsepi32_epi8(qi));
      }
      scale[b] = d;
      sum[b] = d * static_cast<float>(total);
      const int per_block = g.lanes_per_block;
      for (int j = 0; j < g.steps; ++j)
        for (int i = 0; i < per_block; ++i)
          std::memcpy(q + g.x_offset + 64 * j + 4 * (lb * per_block + i),
                      block_q + 4 * (j * per_block + i), 4);
    }
  }
}

QuantizedX quantize_x(const at::Tensor& x, int64_t block, const std::vector<Group>& groups) {
  const int64_t m = x.size(0), blocks = x.size(1) / block;
  const Group& last = groups.back();
  const int64_t q_stride = last.x_offset + 64 * last.steps;
  QuantizedX out{std::vector<int8_t>(m * q_stride, 0), std::vector<float>(m * blocks),
                 std::vector<float>(m * blocks), q_stride, blocks};
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int8_t* q = out.q.data() + t * q_stride;
      float* s = out.scale.data() + t * blocks;
      float* sum = out.sum.data() + t * blocks;
      const c10::BFloat16* row = xp + t * x.stride(0);
      switch (block) {
        case 16: quantize_row<16>(row, groups, q, s, sum); break;
        case 32: quantize_row<32>(row, groups, q, s, sum); break;
        case 64: quantize_row<64>(row, groups, q, s, sum); break;
        default: quantize_row<128>(row, groups, q, s, sum);
      }
    }
  });
  return out;
}

struct Weight {
  const uint8_t* data;
  int64_t row_bytes;
  const void* scales;
  const void* mins;
  int64_t blocks;  // per row
  float zero;
};

constexpr int kRows = 4;       // rows of W per tile (or 1, at the end of W)
constexpr int kItemRows = 16;  // rows of W per item: 4 tiles, whose sums reduce together
constexpr int64_t kTokenBlock = 192;  // tokens whose quantized x a thread keeps in L2

// 64 u of a row (one step) at p: one per byte, or two per byte sharing bytes i and i + 32.
template <bool PAIRED>
inline __m512i load_step(const uint8_t* p, __mmask64 bytes) {
  if constexpr (PAIRED) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw),
                                               _mm256_srli_epi16(raw, 4), 1),
                            _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_maskz_loadu_epi8(bytes, p);
  }
}

// The steps of one of a row's last groups (fewer than 16 blocks: masked loads, one to
// eight steps) into the integer sums dot[r][t][chain]; odd steps go to the last chain.
template <int BITS, int R, int T, int CHAINS, bool PREFETCH>
inline void group_dots(const uint8_t* const* wrow, const int8_t* const* xq, const Group& g,
                       int64_t ahead, __m512i (&dot)[R][T][CHAINS]) {
  const int lanes = g.blocks * g.lanes_per_block;
  const __mmask64 bytes = lanes == 16 ? ~__mmask64{0} : (__mmask64{1} << (4 * lanes)) - 1;
  if (g.steps >= 2) {
    // two steps at a time: from one load of 4-bit u, or two loads of 8-bit u
    for (int j = 0; j < g.steps; j += 2) {
      __m512i xv[T][2];
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h) xv[t][h] = _mm512_loadu_si512(xq[t] + g.x_offset + (j + h) * 64);
      for (int r = 0; r < R; ++r) {
        __m512i u[2];
        if constexpr (BITS == 4) {
          const uint8_t* p = wrow[r] + g.weight_offset + j * 2 * lanes;
          if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
          const __m512i packed = _mm512_maskz_loadu_epi8(bytes, p);
          u[0] = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
          u[1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
        } else {
          const uint8_t* p = wrow[r] + g.weight_offset + j * 4 * lanes;
          if (PREFETCH) {
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T1);
          }
          u[0] = _mm512_maskz_loadu_epi8(bytes, p);
          u[1] = _mm512_maskz_loadu_epi8(bytes, p + 4 * lanes);
        }
        for (int t = 0; t < T; ++t) {
          dot[r][t][0] = _mm512_dpbusd_epi32(dot[r][t][0], u[0], xv[t][0]);
          dot[r][t][CHAINS - 1] = _mm512_dpbusd_epi32(dot[r][t][CHAINS - 1], u[1], xv[t][1]);
        }
      }
    }
    return;
  }
  __m512i xv[T];  // one step
  for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(xq[t] + g.x_offset);
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = wrow[r] + g.weight_offset;
    if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
    const __m512i u = BITS == 4 && lanes == 16 ? load_step<true>(p, bytes) : load_step<false>(p, bytes);
    for (int t = 0; t < T; ++t) dot[r][t][0] = _mm512_dpbusd_epi32(dot[r][t][0], u, xv[t]);
  }
}

// A group of 16 blocks (one per lane, STEPS = block / 4 steps): group_dots with the trip
// count known and no masks, so that the compiler keeps everything in registers. Nearly all
// of a row is such groups.
template <int BITS, int STEPS, int R, int T, int CHAINS, bool PREFETCH>
inline void full_group_dots(const uint8_t* const* wrow, const int8_t* const* xq,
                            int64_t weight_offset, int64_t x_offset, int64_t ahead,
                            __m512i (&dot)[R][T][CHAINS]) {
  if constexpr (T == 1) {
    // A step pair at a time (one load of 4-bit u), the steps taking turns over the chains.
#pragma GCC unroll 8
    for (int j = 0; j < STEPS; j += 2) {
      const __m512i x0 = _mm512_loadu_si512(xq[0] + x_offset + j * 64);
      const __m512i x1 = _mm512_loadu_si512(xq[0] + x_offset + j * 64 + 64);
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = wrow[r] + weight_offset + j * 32 * BITS / 4;
        if (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
        if (PREFETCH && BITS == 8) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T1);
        __m512i u0, u1;
        if constexpr (BITS == 4) {
          const __m512i packed = _mm512_loadu_si512(p);
          u0 = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));
          u1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));
        } else {
          u0 = _mm512_loadu_si512(p);
          u1 = _mm512_loadu_si512(p + 64);
        }
        dot[r][0][j % CHAINS] = _mm512_dpbusd_epi32(dot[r][0][j % CHAINS], u0, x0);
        dot[r][0][(j + 1) % CHAINS] = _mm512_dpbusd_epi32(dot[r][0][(j + 1) % CHAINS], u1, x1);
      }
    }
    return;
  }
  // Several tokens: one step at a time, each row's u reloaded (from L1) for the second
  // step of a 4-bit pair: with 4 x 4 sums, one step's x and one row's u are all the
  // registers left.
#pragma GCC unroll 8
  for (int j = 0; j < STEPS; ++j) {
    __m512i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(xq[t] + x_offset + j * 64);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = wrow[r] + weight_offset + (BITS == 4 ? (j / 2) * 64 : j * 64);
      if (PREFETCH && (BITS == 8 || j % 2 == 0))
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
      __m512i u = _mm512_loadu_si512(p);
      if constexpr (BITS == 4)
        u = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(u, 4) : u, _mm512_set1_epi8(0x0F));
      for (int t = 0; t < T; ++t) dot[r][t][0] = _mm512_dpbusd_epi32(dot[r][t][0], u, xv[t]);
    }
  }
}

// The lane sums of rows [r0, r0 + R) of W with tokens [t0, t0 + T) of x, added into
// sums[t * kItemRows + slot + r]: one vector per dot product, its lanes still to be added.
// The integer sums of a group live in registers (R x T of them: with 4 x 4, enough
// independent VNNI chains to cover the instruction's latency); the float sums in ``sums``
// (L1), which they meet once per group.
template <int BITS, int BLOCK, typename S, bool MIN, int R, int T, bool PREFETCH>
void tile(const Weight& w, const std::vector<Group>& groups, int64_t r0, const QuantizedX& x,
          int64_t t0, __m512* sums, int slot) {
  // With one token, four chains of sums per row (steps take turns), for more VNNI
  // instructions in flight.
  constexpr int kChains = T == 1 ? 4 : 1;
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  const uint8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = w.data + (r0 + r) * w.row_bytes;
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) xq[t] = x.q.data() + (t0 + t) * x.q_stride;
  for (const Group& g : groups) {
    __m512i dot[R][T][kChains];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < kChains; ++c) dot[r][t][c] = _mm512_setzero_si512();
    if (g.blocks == 16)
      full_group_dots<BITS, BLOCK / 4, R, T, kChains, PREFETCH>(
          wrow, xq, g.weight_offset, g.x_offset, kItemRows * w.row_bytes, dot);
    else
      group_dots<BITS, R, T, kChains, PREFETCH>(wrow, xq, g, kItemRows * w.row_bytes, dot);
    // The integer sums meet their scales: s dx dot + (m or -zero s) dx sum(q). A block
    // over several lanes takes its scale into each (lane i: block i / lanes_per_block).
    const __mmask16 mask = static_cast<__mmask16>((1u << g.blocks) - 1);
    const __m512i spread = _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        __builtin_ctz(static_cast<unsigned>(g.lanes_per_block)));
    const int64_t b0 = g.first_block;
    __m512 xs[T], xsum[T];
    for (int t = 0; t < T; ++t) {
      xs[t] = _mm512_maskz_loadu_ps(mask, x.scale.data() + (t0 + t) * x.block_stride + b0);
      xsum[t] = _mm512_maskz_loadu_ps(mask, x.sum.data() + (t0 + t) * x.block_stride + b0);
    }
    for (int r = 0; r < R; ++r) {
      if (PREFETCH) {
        _mm_prefetch(reinterpret_cast<const char*>(scales + (r0 + r + kItemRows) * w.blocks + b0), _MM_HINT_T1);
        if (MIN) _mm_prefetch(reinterpret_cast<const char*>(mins + (r0 + r + kItemRows) * w.blocks + b0), _MM_HINT_T1);
      }
      const __m512 s = load16(scales + (r0 + r) * w.blocks + b0, mask);
      const __m512 m = MIN ? load16(mins + (r0 + r) * w.blocks + b0, mask)
                           : _mm512_mul_ps(s, _mm512_set1_ps(-w.zero));
      for (int t = 0; t < T; ++t) {
        __m512i d = dot[r][t][0];
        for (int c = 1; c < kChains; ++c) d = _mm512_add_epi32(d, dot[r][t][c]);
        __m512 scale = _mm512_mul_ps(s, xs[t]);
        if (g.lanes_per_block > 1) scale = _mm512_permutexvar_ps(spread, scale);
        __m512& acc = sums[t * kItemRows + slot + r];
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale,
                              _mm512_fmadd_ps(m, xsum[t], acc));  // m: once per block, unspread
      }
    }
  }
}

constexpr int kTokens = 4;  // tokens of x per tile

using Tile = void (*)(const Weight&, const std::vector<Group>&, int64_t, const QuantizedX&,
                      int64_t, __m512*, int);

// [prefetch][rows == 4][tokens == 4]: full tiles, and single rows or tokens for the edges.
template <int BITS, int BLOCK, typename S, bool MIN>
struct Tiles {
  static constexpr Tile table[2][2][2] = {
      {{&tile<BITS, BLOCK, S, MIN, 1, 1, false>, &tile<BITS, BLOCK, S, MIN, 1, kTokens, false>},
       {&tile<BITS, BLOCK, S, MIN, kRows, 1, false>, &tile<BITS, BLOCK, S, MIN, kRows, kTokens, false>}},
      {{&tile<BITS, BLOCK, S, MIN, 1, 1, true>, &tile<BITS, BLOCK, S, MIN, 1, kTokens, true>},
       {&tile<BITS, BLOCK, S, MIN, kRows, 1, true>, &tile<BITS, BLOCK, S, MIN, kRows, kTokens, true>}}};
};

using TileTable = const Tile (*)[2][2];

// Every layout: u of 4 or 8 bits, blocks of 16, 32, 64 or 128, float16 or float32 scales,
// mins or a zero point. GGUF's types use blocks of 16 and 32 (gguf_blocks.FORMATS); the
// group-quantized formats (AWQ, GPTQ, compressed-tensors) blocks of their group size, or
// of 128 with a scale repeated for larger groups and per-channel scales.
template <int BITS, int BLOCK>
TileTable pick_scales(bool half, bool min) {
  using H = at::Half;
  if (half) return min ? Tiles<BITS, BLOCK, H, true>::table : Tiles<BITS, BLOCK, H, false>::table;
  return min ? Tiles<BITS, BLOCK, float, true>::table : Tiles<BITS, BLOCK, float, false>::table;
}

template <int BITS>
TileTable pick_block(int64_t block, bool half, bool min) {
  switch (block) {
    case 16: return pick_scales<BITS, 16>(half, min);
    case 32: return pick_scales<BITS, 32>(half, min);
    case 64: return pick_scales<BITS, 64>(half, min);
    default: return pick_scales<BITS, 128>(half, min);
  }
}

TileTable pick(int64_t bits, int64_t block, bool half, bool min) {
  return bits == 4 ? pick_block<4>(block, half, min) : pick_block<8>(block, half, min);
}

// 16 float32 -> 16 bfloat16, rounded to nearest even (no BF16 instructions needed).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Rows [16 item, 16 item + 16) of W (n rows) with tokens [tb, te) of x (at most
// kTokenBlock; the first pass over the item prefetches the next item's weights), stored
// into out (leading dimension ldo) with the bias bp (or none). The 16 rows' sums for a
// token are reduced together and stored as one vector.
inline void run_item(const Weight& w, const std::vector<Group>& groups, TileTable tiles,
                     const QuantizedX& xq, int64_t n, int64_t item, int64_t tb, int64_t te,
                     const c10::BFloat16* bp, c10::BFloat16* op, int64_t ldo, __m512* sums) {
  const int64_t r0 = item * kItemRows, rows = std::min<int64_t>(kItemRows, n - r0);
  const __mmask16 row_mask = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 b = bp != nullptr ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                       _mm256_maskz_loadu_epi16(row_mask, bp + r0)), 16))
                                 : _mm512_setzero_ps();
  for (int64_t t0 = tb; t0 < te; t0 += kTokens) {
    const int tokens = static_cast<int>(std::min<int64_t>(kTokens, te - t0));
    for (int i = 0; i < kTokens * kItemRows; ++i) sums[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < rows; ++q) {  // q: first row of a tile of 4 rows or 1
      const bool full_rows = rows - q >= kRows;
      const auto& by_tokens = tiles[t0 == tb][full_rows];
      if (tokens == kTokens) {
        by_tokens[1](w, groups, r0 + q, xq, t0, sums, static_cast<int>(q));
      } else {
        for (int t = 0; t < tokens; ++t)
          by_tokens[0](w, groups, r0 + q, xq, t0 + t, sums + t * kItemRows, static_cast<int>(q));
      }
      if (full_rows) q += kRows - 1;
    }
    for (int t = 0; t < tokens; ++t)
      _mm256_mask_storeu_epi16(op + (t0 + t) * ldo + r0, row_mask,
                               to_bf16(_mm512_add_ps(reduce16(sums + t * kItemRows), b)));
  }
}

}  // namespace

// The arguments' checks, shared by both kernels; the groups of a row of W.
static std::vector<Group> check_quant_gemm(const at::Tensor& out, const at::Tensor& x,
                                           const at::Tensor& data, const at::Tensor& scales,
                                           const c10::optional<at::Tensor>& mins, int64_t bits,
                                           int64_t block, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "quant_gemm: bfloat16 x and out expected");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && scales.is_contiguous(),
              "quant_gemm: uint8 data and contiguous scales expected");
  TORCH_CHECK((bits == 4 || bits == 8) && (block == 16 || block == 32 || block == 64 || block == 128),
              "quant_gemm: bits 4 or 8, blocks of 16, 32, 64 or 128");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
              "quant_gemm: float16 or float32 scales");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  TORCH_CHECK(k % block == 0 && k > 0 && scales.size(0) == n && scales.size(1) == k / block &&
              x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == m && out.size(1) == n,
              "quant_gemm: shapes do not match");
  const std::vector<Group> groups = groups_of(k / block, static_cast<int>(block), static_cast<int>(bits));
  const Group& last = groups.back();
  const int64_t last_lanes = last.blocks * last.lanes_per_block;
  const int64_t row_bytes = last.weight_offset +
      (bits == 8 || (last.steps == 1 && last_lanes < 16) ? 4 * last_lanes * last.steps
                                                         : 2 * last_lanes * last.steps);
  TORCH_CHECK(data.size(1) == row_bytes, "quant_gemm: weight rows of ", row_bytes, " bytes expected");
  if (mins.has_value())
    TORCH_CHECK(mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                mins->sizes() == scales.sizes(), "quant_gemm: mins like scales expected");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                bias->numel() == n, "quant_gemm: a bfloat16 bias of n values expected");
  return groups;
}

void quant_gemm(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                c10::optional<at::Tensor> mins, int64_t bits, int64_t block, int64_t zero,
                c10::optional<at::Tensor> bias) {
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  const std::vector<Group> groups = check_quant_gemm(out, x, data, scales, mins, bits, block, bias);
  const bool half = scales.scalar_type() == at::kHalf;
  const int64_t row_bytes = data.size(1);
  if (m == 0) return;

  const QuantizedX xq = quantize_x(x, block, groups);
  const Weight w{data.data_ptr<uint8_t>(), row_bytes, scales.data_ptr(),
                 mins.has_value() ? mins->data_ptr() : nullptr, k / block, static_cast<float>(zero)};
  const TileTable tiles = pick(bits, block, half, mins.has_value());
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0), items = (n + kItemRows - 1) / kItemRows;
  // Each thread takes a run of 16-row items; for many tokens it walks them a block of
  // tokens at a time, so that their quantized x stays in L2 while its weights stream past
  // (the first pass over an item prefetches the next item's weights).
  at::parallel_for(0, items, std::max<int64_t>(1, 16 / std::min<int64_t>(m, 16)),
                   [&](int64_t begin, int64_t end) {
    __m512 sums[kTokens * kItemRows];  // [token][row]
    for (int64_t tb = 0; tb < m; tb += kTokenBlock) {
      const int64_t te = std::min(m, tb + kTokenBlock);
      for (int64_t item = begin; item < end; ++item)
        run_item(w, groups, tiles, xq, n, item, tb, te, bp, op, ldo, sums);
    }
  });
}

void quant_gemm_grouped(at::Tensor out, at::Tensor x, std::vector<at::Tensor> data,
                        std::vector<at::Tensor> scales, std::vector<at::Tensor> mins,
                        std::vector<at::Tensor> biases, std::vector<int64_t> offsets,
                        int64_t bits, int64_t block, int64_t zero) {
  const int64_t weights = static_cast<int64_t>(data.size());
  TORCH_CHECK(weights > 0 && static_cast<int64_t>(scales.size()) == weights &&
              (mins.empty() || static_cast<int64_t>(mins.size()) == weights) &&
              (biases.empty() || static_cast<int64_t>(biases.size()) == weights) &&
              static_cast<int64_t>(offsets.size()) == weights + 1 && offsets[0] == 0 &&
              offsets[weights] == x.size(0),
              "quant_gemm_grouped: a scale (and min, bias) per weight and offsets [0, ..., rows]");
  std::vector<Group> groups;
  for (int64_t g = 0; g < weights; ++g) {
    TORCH_CHECK(offsets[g] <= offsets[g + 1] && data[g].sizes() == data[0].sizes() &&
                scales[g].scalar_type() == scales[0].scalar_type(),
                "quant_gemm_grouped: weights of one shape and layout expected");
    groups = check_quant_gemm(out, x, data[g], scales[g],
                              mins.empty() ? c10::optional<at::Tensor>() : mins[g], bits, block,
                              biases.empty() ? c10::optional<at::Tensor>() : biases[g]);
  }
  const int64_t m = x.size(0), k = x.size(1), n = data[0].size(0);
  if (m == 0) return;
  const QuantizedX xq = quantize_x(x, block, groups);
  const TileTable tiles = pick(bits, block, scales[0].scalar_type() == at::kHalf, !mins.empty());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldo = out.stride(0), items = (n + kItemRows - 1) / kItemRows;
  // Every (weight, 16-row item) is one unit of a single parallel loop; each runs over its
  // weight's tokens.
  at::parallel_for(0, weights * items, 1, [&](int64_t begin, int64_t end) {
    __m512 sums[kTokens * kItemRows];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t g = unit / items, item = unit % items;
      const Weight w{data[g].data_ptr<uint8_t>(), data[g].size(1), scales[g].data_ptr(),
                     mins.empty() ? nullptr : mins[g].data_ptr(), k / block,
                     static_cast<float>(zero)};
      const c10::BFloat16* bp = biases.empty() ? nullptr : biases[g].data_ptr<c10::BFloat16>();
      for (int64_t tb = offsets[g]; tb < offsets[g + 1]; tb += kTokenBlock)
        run_item(w, groups, tiles, xq, n, item, tb, std::min(offsets[g + 1], tb + kTokenBlock),
                 bp, op, ldo, sums);
    }
  });
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
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

// Rows [0, 32) at data into a bfloat16 panel [k / 2][32][2] (dword [kk][c] = the pair
// (2kk, 2kk + 1) of row c). Per step, 16 rows' 32 pairs are transposed in registers, so
// that each pair's 16 rows go out as one 64-byte store.
template <int BITS, typename S, bool MIN>
void dequantize_panel(const Weight& w, int64_t r0, const std::vector<Group>& groups, int block,
                      int32_t* panel) {
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
        const int64_t row = r0 + c0 + c;
        _mm_prefetch(reinterpret_cast<const char*>(scales + (row + 32) * w.blocks + g.first_block), _MM_HINT_T1);
        if (MIN) _mm_prefetch(reinterpret_cast<const char*>(mins + (row + 32) * w.blocks + g.first_block), _MM_HINT_T1);
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
          const uint8_t* row = w.data + (r0 + c0 + c) * w.row_bytes;
          // the next panel's rows into L2 as this one's are read (BITS / 8 lines a step)
          _mm_prefetch(reinterpret_cast<const char*>(row + 32 * w.row_bytes + g.weight_offset +
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

using Dequantize = void (*)(const Weight&, int64_t, const std::vector<Group>&, int, int32_t*);

template <int BITS>
Dequantize pick_dequantize(bool half, bool min) {
  if (half) return min ? &dequantize_panel<BITS, at::Half, true> : &dequantize_panel<BITS, at::Half, false>;
  return min ? &dequantize_panel<BITS, float, true> : &dequantize_panel<BITS, float, false>;
}

// quant_gemm_bf16 below, its panels on AMX tiles or on the AVX-512 GEMM's register tiles.
void quant_gemm_panels(at::Tensor& out, const at::Tensor& x, const at::Tensor& data,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                       int64_t bits, int64_t block, int64_t zero,
                       const c10::optional<at::Tensor>& bias, bool amx) {
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  const std::vector<Group> groups = check_quant_gemm(out, x, data, scales, mins, bits, block, bias);
  TORCH_CHECK(n % 32 == 0 && k % 2 == 0 && x.stride(0) % 2 == 0,
              "quant_gemm_bf16: 32-row panels of W and (k, k+1) pairs of x expected");
  if (m == 0) return;
  const bool half = scales.scalar_type() == at::kHalf;
  const Weight w{data.data_ptr<uint8_t>(), data.size(1), scales.data_ptr(),
                 mins.has_value() ? mins->data_ptr() : nullptr, k / block, static_cast<float>(zero)};
  const Dequantize dequantize = bits == 4 ? pick_dequantize<4>(half, mins.has_value())
                                          : pick_dequantize<8>(half, mins.has_value());
  gemm_on_panels(out, x, n, bias, [&](int64_t p, int32_t* panel) {
    dequantize(w, 32 * p, groups, static_cast<int>(block), panel);
  }, amx);
}

}  // namespace

void quant_gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                     c10::optional<at::Tensor> mins, int64_t bits, int64_t block, int64_t zero,
                     c10::optional<at::Tensor> bias) {
  quant_gemm_panels(out, x, data, scales, mins, bits, block, zero, bias, false);
}

void quant_gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                         c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                         int64_t zero, c10::optional<at::Tensor> bias) {
  quant_gemm_panels(out, x, data, scales, mins, bits, block, zero, bias, true);
}
#endif

}  // namespace cpullm
