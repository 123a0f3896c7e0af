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
// rows on the panels are faster (docs/quantization.md). Where the CPU has AMX, the blocks'
// dequantized rows are the A operand of the tiles instead (quant_gemm_bf16_amx, below).
// Wherever these kernels run, a model's weights are laid out again in 16-row tiles after
// loading, with kernels of their own (quant_gemm_tiled_*, at the end); the layout above stays
// for a mixture's experts (quant_gemm_grouped) and for shapes the tiles do not take.
// Where the CPU has no AVX-512 VNNI, the AVX2 library runs the same int8 dot products on
// 256-bit halves of the steps, for every number of rows (quant_gemm's AVX2 build, below).
#include "amx.h"
#include "gemm_tiles.h"
#include "ops.h"

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace cpullm {

// The layouts, x's quantization and the arguments' checks: shared by the AVX-512 VNNI
// kernels and the AVX2 ones (every library level has AVX2, FMA and F16C).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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

// A row's k order on AMX (quant_gemm_bf16_amx, below): chunks of 16 pairs (a tile row's
// 32 k), two per step of each group. Chunk 2 j + h of group g holds, in dword l (l = L blk +
// i, L lanes per block), the pair (e, e + 1) of block g.first_block + blk, e = 4 (j L + i) +
// 2 h.
//
// The pair of x (k / 2) that each dword of a row's chunks meets; -1: past a group's lanes.
std::vector<int32_t> pairs_of_chunks(const std::vector<Group>& groups, int block) {
  std::vector<int32_t> pairs;
  for (const Group& g : groups) {
    const int lanes = g.blocks * g.lanes_per_block, per_block = g.lanes_per_block;
    for (int j = 0; j < g.steps; ++j)
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 16; ++l) {
          const int64_t b = g.first_block + l / per_block;
          const int64_t e = 4 * (j * per_block + l % per_block) + 2 * h;
          pairs.push_back(l < lanes ? static_cast<int32_t>((b * block + e) / 2) : -1);
        }
  }
  return pairs;
}

// A row's layout for a shape: its groups; for the AMX kernel, the pair of x that each dword
// of a row's chunks meets (-1: none) and the dword that meets each pair. It depends on the
// shape alone: made at a shape's first call, and kept.
struct RowLayout {
  std::vector<Group> groups;
  std::vector<int32_t> pairs, slot_of;
};

const RowLayout& layout_of(int64_t blocks, int block, int bits) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int, int>, std::unique_ptr<const RowLayout>> layouts;
  const std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<const RowLayout>& layout = layouts[{blocks, block, bits}];
  if (!layout) {
    auto made = std::make_unique<RowLayout>();
    made->groups = groups_of(blocks, block, bits);
    made->pairs = pairs_of_chunks(made->groups, block);
    made->slot_of.assign(blocks * block / 2, -1);
    for (size_t slot = 0; slot < made->pairs.size(); ++slot)
      if (made->pairs[slot] >= 0) made->slot_of[made->pairs[slot]] = static_cast<int32_t>(slot);
    layout = std::move(made);
  }
  return *layout;
}

// x as int8 in the weights' steps, per token (lanes past a group's end zero), dx and
// dx * sum(q) per block.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  int64_t q_stride, block_stride;
};

// x[0, len) (len a multiple of 16; bfloat16, or float32: a remainder, below) as int8 q, to
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
// level of x for logits (quantize_x and quantize_blocks with two_levels), whose bfloat16
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

template <int BLOCK, typename T>
void quantize_row(const T* x, const std::vector<Group>& groups, int8_t* q,
                  float* scale, float* sum) {
  alignas(64) int8_t block_q[BLOCK];
  for (const Group& g : groups) {
    for (int lb = 0; lb < g.blocks; ++lb) {
      const int64_t b = g.first_block + lb;
      int32_t total = 0;
      const float d = quantize_span(x + b * BLOCK, BLOCK, block_q, total);
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

// two_levels (logits): rows 2t and 2t + 1 hold token t's x and its remainder_row, whose
// products the kernels add (x to ~1/32000 of a block's largest value instead of 1/254).
QuantizedX quantize_x(const at::Tensor& x, int64_t block, const std::vector<Group>& groups,
                      bool two_levels = false) {
  const int64_t k = x.size(1), blocks = k / block, per_token = two_levels ? 2 : 1;
  const int64_t m = x.size(0) * per_token;
  const Group& last = groups.back();
  const int64_t q_stride = last.x_offset + 64 * last.steps;
  QuantizedX out{std::vector<int8_t>(m * q_stride, 0), std::vector<float>(m * blocks),
                 std::vector<float>(m * blocks), q_stride, blocks};
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  auto quantize = [&](const auto* row, int64_t t) {
    int8_t* q = out.q.data() + t * q_stride;
    float* s = out.scale.data() + t * blocks;
    float* sum = out.sum.data() + t * blocks;
    switch (block) {
      case 16: quantize_row<16>(row, groups, q, s, sum); break;
      case 32: quantize_row<32>(row, groups, q, s, sum); break;
      case 64: quantize_row<64>(row, groups, q, s, sum); break;
      default: quantize_row<128>(row, groups, q, s, sum);
    }
  };
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> remainder(two_levels ? k : 0);
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* row = xp + t * x.stride(0);
      quantize(row, t * per_token);
      if (two_levels) {
        remainder_row(row, k, block, remainder.data());
        quantize(remainder.data(), 2 * t + 1);
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

// A kept weight's tensors (checked by check_quant_gemm) as the kernels read them.
inline Weight weight_of(const at::Tensor& data, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t zero) {
  return Weight{data.data_ptr<uint8_t>(), data.size(1), scales.data_ptr(),
                mins.has_value() ? mins->data_ptr() : nullptr, scales.size(1),
                static_cast<float>(zero)};
}

// The instance Of<BITS, BLOCK, S, MIN>::entry of a kernel template (a function, or a table
// of them) for a weight's layout: u of 4 or 8 bits, blocks of 16, 32, 64 or 128, float16
// or float32 scales, mins or a zero point. GGUF's types use blocks of 16 and 32
// (gguf_blocks.FORMATS); the group-quantized formats (AWQ, GPTQ, compressed-tensors) blocks
// of their group size, or of 128 with a scale repeated for larger groups and per-channel
// scales.
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
auto pick_kept(int64_t bits, int64_t block, bool half, bool min) {
  return bits == 4 ? pick_block<Of, 4>(block, half, min) : pick_block<Of, 8>(block, half, min);
}

constexpr int kItemRows = 16;  // rows of W per item of a thread's work
constexpr int64_t kTokenBlock = 192;  // tokens whose quantized x a thread keeps in L2

// Where run_item stores its products: rows ldo apart of bfloat16, or of float32 for logits,
// each token's row then the sum of its two rows of x (quantize_x's two_levels).
struct OutRows {
  void* data;
  int64_t ldo;
  bool logits;
};
constexpr int kTokens = 4;  // tokens of x per tile

}  // namespace
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace {

// Scales and mins of up to 16 blocks as float32.
inline __m512 load16(const at::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

constexpr int kRows = 4;  // rows of W per tile (or 1, at the end of W); 4 tiles an item

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

using Tile = void (*)(const Weight&, const std::vector<Group>&, int64_t, const QuantizedX&,
                      int64_t, __m512*, int);

// [prefetch][rows == 4][tokens == 4]: full tiles, and single rows or tokens for the edges.
template <int BITS, int BLOCK, typename S, bool MIN>
struct Tiles {
  static constexpr Tile entry[2][2][2] = {
      {{&tile<BITS, BLOCK, S, MIN, 1, 1, false>, &tile<BITS, BLOCK, S, MIN, 1, kTokens, false>},
       {&tile<BITS, BLOCK, S, MIN, kRows, 1, false>, &tile<BITS, BLOCK, S, MIN, kRows, kTokens, false>}},
      {{&tile<BITS, BLOCK, S, MIN, 1, 1, true>, &tile<BITS, BLOCK, S, MIN, 1, kTokens, true>},
       {&tile<BITS, BLOCK, S, MIN, kRows, 1, true>, &tile<BITS, BLOCK, S, MIN, kRows, kTokens, true>}}};
};

using Kernels = const Tile (*)[2][2];

Kernels pick(int64_t bits, int64_t block, bool half, bool min) {
  return pick_kept<Tiles>(bits, block, half, min);
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
inline void run_item(const Weight& w, const std::vector<Group>& groups, Kernels tiles,
                     const QuantizedX& xq, int64_t n, int64_t item, int64_t tb, int64_t te,
                     const c10::BFloat16* bp, const OutRows& out) {
  __m512 sums[kTokens * kItemRows];  // [token][row]
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
    if (out.logits) {  // (t0 even: tokens come in pairs)
      for (int t = 0; t < tokens; t += 2)
        _mm512_mask_storeu_ps(static_cast<float*>(out.data) + (t0 + t) / 2 * out.ldo + r0,
                              row_mask, _mm512_add_ps(_mm512_add_ps(
                                  reduce16(sums + t * kItemRows),
                                  reduce16(sums + (t + 1) * kItemRows)), b));
      continue;
    }
    for (int t = 0; t < tokens; ++t)
      _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(out.data) + (t0 + t) * out.ldo + r0,
                               row_mask,
                               to_bf16(_mm512_add_ps(reduce16(sums + t * kItemRows), b)));
  }
}

}  // namespace

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ----- the same layouts on AVX2, without VNNI -----
//
// A lane's four u8 x s8 products are summed by VPMADDUBSW (pairs into int16) and VPMADDWD
// (pairs of pairs into int32): what one VNNI instruction does. A pair of 4-bit u by x is at
// most 2 * 15 * 127 and fits int16, but 8-bit u could saturate it, so those multiply as
// q = u - 128 instead (|q| by x with q's sign: at most 2 * 128 * 127), and the 128 dx
// sum(q_x) that this leaves out joins each block's min term. A step's 64 bytes are two
// 256-bit halves, of 8 lanes each. A thread runs a row at a time over 4 tokens at a time,
// so that each step's u is unpacked once for the 4.
namespace {

// Scales and mins of 8 blocks as float32.
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Lanes [0, count) set; and the scales or mins of count blocks (a last group's: 1, 2, 4 or
// 8), zero past them, read with no byte past them (nor through a store, which would stall
// the load behind it).
inline __m256i first_lanes(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 load_first(const at::Half* p, int count) {
  if (count == 1) return _mm256_setr_ps(static_cast<float>(p[0]), 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
  const __m128i pairs = _mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                           _mm256_castsi256_si128(first_lanes(count / 2)));
  return _mm256_cvtph_ps(pairs);
}
inline __m256 load_first(const float* p, int count) {
  return _mm256_maskload_ps(p, first_lanes(count));
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// acc + the sums of a lane's four products of u (unsigned, or signed q where SIGNED) by x
template <bool SIGNED>
inline __m256i dot4(__m256i acc, __m256i u, const int8_t* x) {
  const __m256i xv = load32(x);
  const __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(xv, u))
                               : _mm256_maddubs_epi16(u, xv);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The 64 u of step j of group g of a row (as q = u - 128 for 8 bits), in two halves.
template <int BITS>
inline void step_u(const uint8_t* row, const Group& g, int j, __m256i& lo, __m256i& hi) {
  const int lanes = g.blocks * g.lanes_per_block;
  const uint8_t* p = row + g.weight_offset;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  // 4 bytes a lane from src; a group of fewer than 16 lanes by masked loads, zero past it
  auto load_lanes = [&](const uint8_t* src) {
    if (lanes == 16) {
      lo = load32(src);
      hi = load32(src + 32);
      return;
    }
    const int* words = reinterpret_cast<const int*>(src);
    lo = _mm256_maskload_epi32(words, first_lanes(std::min(lanes, 8)));
    hi = _mm256_maskload_epi32(words + 8, first_lanes(std::max(lanes - 8, 0)));
  };
  if (BITS == 8) {
    load_lanes(p + j * 4 * lanes);
    lo = _mm256_xor_si256(lo, _mm256_set1_epi8(static_cast<char>(0x80)));
    hi = _mm256_xor_si256(hi, _mm256_set1_epi8(static_cast<char>(0x80)));
  } else if (g.steps >= 2) {  // steps 2i and 2i + 1 share bytes, 2i in the low halves
    load_lanes(p + (j / 2) * 4 * lanes);
    lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(lo, 4) : lo, nibble);
    hi = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(hi, 4) : hi, nibble);
  } else if (lanes == 16) {  // one step: bytes i and i + 32 share byte i
    const __m256i raw = load32(p);
    lo = _mm256_and_si256(raw, nibble);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  } else {  // one u a byte
    load_lanes(p);
  }
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// res[t] = row `row` of W by token t0 + t of x, for T tokens.
template <int BITS, int BLOCK, typename S, bool MIN, int T>
void row_dots(const Weight& w, const std::vector<Group>& groups, int64_t row,
              const QuantizedX& x, int64_t t0, float* res) {
  constexpr bool kSigned = BITS == 8;
  const uint8_t* wrow = w.data + row * w.row_bytes;
  const S* scales = static_cast<const S*>(w.scales) + row * w.blocks;
  const S* mins = static_cast<const S*>(w.mins) + (MIN ? row * w.blocks : 0);
  // A block's min term from its scales s and its stored mins: m, or -zero s; with 8 bits,
  // + 128 s for the q = u - 128 products.
  const __m256 offset = _mm256_set1_ps(kSigned ? 128.f : 0.f);
  const __m256 minus_zero = _mm256_set1_ps(kSigned ? 128.f - w.zero : -w.zero);
  auto min_term = [&](__m256 s, __m256 stored) {
    return MIN ? _mm256_fmadd_ps(s, offset, stored) : _mm256_mul_ps(s, minus_zero);
  };
  const int8_t* xq[T];
  const float *xs[T], *xsum[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = x.q.data() + (t0 + t) * x.q_stride;
    xs[t] = x.scale.data() + (t0 + t) * x.block_stride;
    xsum[t] = x.sum.data() + (t0 + t) * x.block_stride;
  }
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (const Group& g : groups) {
    __m256i dot[T][2];
    for (int t = 0; t < T; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
    const int64_t b0 = g.first_block;
    if (g.blocks == 16) {  // one block a lane, BLOCK / 4 steps: nearly all of a row
      const uint8_t* p = wrow + g.weight_offset;
      if constexpr (BITS == 4) {
        // A step's pairs of 4-bit products (at most 2 * 15 * 127) add up in int16 over up
        // to 8 steps (at most 30480) before one VPMADDWD widens them: half the multiplies.
        for (int j0 = 0; j0 < BLOCK / 4; j0 += 8) {
          __m256i pairs[T][2];
          for (int t = 0; t < T; ++t) pairs[t][0] = pairs[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int j = j0; j < j0 + std::min(8, BLOCK / 4); ++j) {
            const uint8_t* pair = p + (j / 2) * 64;
            const __m256i lo = _mm256_and_si256(
                j % 2 ? _mm256_srli_epi16(load32(pair), 4) : load32(pair), _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(
                j % 2 ? _mm256_srli_epi16(load32(pair + 32), 4) : load32(pair + 32),
                _mm256_set1_epi8(0x0F));
            for (int t = 0; t < T; ++t) {
              const int8_t* xj = xq[t] + g.x_offset + j * 64;
              pairs[t][0] = _mm256_add_epi16(pairs[t][0], _mm256_maddubs_epi16(lo, load32(xj)));
              pairs[t][1] = _mm256_add_epi16(pairs[t][1], _mm256_maddubs_epi16(hi, load32(xj + 32)));
            }
          }
          for (int t = 0; t < T; ++t)
            for (int h = 0; h < 2; ++h)
              dot[t][h] = _mm256_add_epi32(dot[t][h], _mm256_madd_epi16(pairs[t][h], _mm256_set1_epi16(1)));
        }
      } else {
#pragma GCC unroll 8
        for (int j = 0; j < BLOCK / 4; ++j) {
          const __m256i lo = _mm256_xor_si256(load32(p + j * 64), _mm256_set1_epi8(static_cast<char>(0x80)));
          const __m256i hi = _mm256_xor_si256(load32(p + j * 64 + 32), _mm256_set1_epi8(static_cast<char>(0x80)));
          for (int t = 0; t < T; ++t) {
            const int8_t* xj = xq[t] + g.x_offset + j * 64;
            dot[t][0] = dot4<true>(dot[t][0], lo, xj);
            dot[t][1] = dot4<true>(dot[t][1], hi, xj + 32);
          }
        }
      }
      // s dx dot + (m or -zero s) dx sum(q), 8 blocks a half
      for (int h = 0; h < 2; ++h) {
        const __m256 s = load8(scales + b0 + 8 * h);
        const __m256 m = min_term(s, MIN ? load8(mins + b0 + 8 * h) : s);
        for (int t = 0; t < T; ++t) {
          const __m256 scale = _mm256_mul_ps(s, _mm256_loadu_ps(xs[t] + b0 + 8 * h));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]), scale,
                                   _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum[t] + b0 + 8 * h), acc[t]));
        }
      }
      continue;
    }
    // One of a row's last groups (at most 8 blocks, over 2 to 16 lanes each): each lane's
    // sum meets its block's scale, spread to its lanes.
    for (int j = 0; j < g.steps; ++j) {
      __m256i lo, hi;
      step_u<BITS>(wrow, g, j, lo, hi);
      for (int t = 0; t < T; ++t) {
        const int8_t* xj = xq[t] + g.x_offset + j * 64;
        dot[t][0] = dot4<kSigned>(dot[t][0], lo, xj);
        dot[t][1] = dot4<kSigned>(dot[t][1], hi, xj + 32);
      }
    }
    const int shift = __builtin_ctz(static_cast<unsigned>(g.lanes_per_block));
    const __m256i spread[2] = {
        _mm256_srli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), shift),
        _mm256_srli_epi32(_mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15), shift)};
    const __m256i in_group = first_lanes(g.blocks);
    const __m256 s = load_first(scales + b0, g.blocks);
    const __m256 m = min_term(s, MIN ? load_first(mins + b0, g.blocks) : s);
    for (int t = 0; t < T; ++t) {
      const __m256 scale = _mm256_mul_ps(s, _mm256_maskload_ps(xs[t] + b0, in_group));
      for (int h = 0; h < 2; ++h)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]),
                                 _mm256_permutevar8x32_ps(scale, spread[h]), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_maskload_ps(xsum[t] + b0, in_group), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) res[t] = hsum8(acc[t]);
}

using RowDots = void (*)(const Weight&, const std::vector<Group>&, int64_t, const QuantizedX&,
                         int64_t, float*);

// [tokens == 4]
template <int BITS, int BLOCK, typename S, bool MIN>
struct RowDotsOf {
  static constexpr RowDots entry[2] = {&row_dots<BITS, BLOCK, S, MIN, 1>,
                                       &row_dots<BITS, BLOCK, S, MIN, kTokens>};
};

using Kernels = const RowDots*;

Kernels pick(int64_t bits, int64_t block, bool half, bool min) {
  return pick_kept<RowDotsOf>(bits, block, half, min);
}

// Rows [16 item, 16 item + 16) of W (n rows) with tokens [tb, te) of x, stored into out
// (leading dimension ldo) with the bias bp (or none).
inline void run_item(const Weight& w, const std::vector<Group>& groups, Kernels dots,
                     const QuantizedX& xq, int64_t n, int64_t item, int64_t tb, int64_t te,
                     const c10::BFloat16* bp, const OutRows& out) {
  const int64_t r0 = item * kItemRows, r1 = std::min<int64_t>(n, r0 + kItemRows);
  for (int64_t t0 = tb; t0 < te; t0 += kTokens) {
    const int tokens = static_cast<int>(std::min<int64_t>(kTokens, te - t0));
    for (int64_t r = r0; r < r1; ++r) {
      float res[kTokens];
      if (tokens == kTokens) {
        dots[1](w, groups, r, xq, t0, res);
      } else {
        for (int t = 0; t < tokens; ++t) dots[0](w, groups, r, xq, t0 + t, res + t);
      }
      const float b = bp != nullptr ? static_cast<float>(bp[r]) : 0.f;
      if (out.logits) {  // (t0 even: tokens come in pairs)
        for (int t = 0; t < tokens; t += 2)
          static_cast<float*>(out.data)[(t0 + t) / 2 * out.ldo + r] = res[t] + res[t + 1] + b;
      } else {
        for (int t = 0; t < tokens; ++t)
          static_cast<c10::BFloat16*>(out.data)[(t0 + t) * out.ldo + r] =
              c10::BFloat16(res[t] + b);
      }
    }
  }
}

}  // namespace
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The arguments' checks, shared by the kernels; the layout of a row of W. silu_mul: out
// holds silu(gate) * up of W's two halves, n / 2 columns.
static const RowLayout& check_quant_gemm(const at::Tensor& out, const at::Tensor& x,
                                         const at::Tensor& data, const at::Tensor& scales,
                                         const c10::optional<at::Tensor>& mins, int64_t bits,
                                         int64_t block, const c10::optional<at::Tensor>& bias,
                                         bool silu_mul = false) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 &&
              (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "quant_gemm: bfloat16 x, bfloat16 or float32 (logits) out expected");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && scales.is_contiguous(),
              "quant_gemm: uint8 data and contiguous scales expected");
  TORCH_CHECK((bits == 4 || bits == 8) && (block == 16 || block == 32 || block == 64 || block == 128),
              "quant_gemm: bits 4 or 8, blocks of 16, 32, 64 or 128");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
              "quant_gemm: float16 or float32 scales");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  TORCH_CHECK(k % block == 0 && k > 0 && scales.size(0) == n && scales.size(1) == k / block &&
              x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == m &&
              out.size(1) == (silu_mul ? n / 2 : n), "quant_gemm: shapes do not match");
  const RowLayout& layout =
      layout_of(k / block, static_cast<int>(block), static_cast<int>(bits));
  const Group& last = layout.groups.back();
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
  return layout;
}

void quant_gemm(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                c10::optional<at::Tensor> mins, int64_t bits, int64_t block, int64_t zero,
                c10::optional<at::Tensor> bias) {
  const int64_t m = x.size(0), n = data.size(0);
  const std::vector<Group>& groups =
      check_quant_gemm(out, x, data, scales, mins, bits, block, bias).groups;
  if (m == 0) return;

  // float32 out (logits): x in two levels, rows 2t and 2t + 1 of xq for token t
  const bool logits = out.scalar_type() == at::kFloat;
  const QuantizedX xq = quantize_x(x, block, groups, logits);
  const int64_t rows = logits ? 2 * m : m;
  const Weight w = weight_of(data, scales, mins, zero);
  const Kernels kernels = pick(bits, block, scales.scalar_type() == at::kHalf, mins.has_value());
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const OutRows op{out.data_ptr(), out.stride(0), logits};
  const int64_t items = (n + kItemRows - 1) / kItemRows;
  // Each thread takes a run of 16-row items; for many tokens it walks them a block of
  // tokens at a time, so that their quantized x stays in L2 while its weights stream past
  // (the first pass over an item prefetches the next item's weights).
  at::parallel_for(0, items, std::max<int64_t>(1, 16 / std::min<int64_t>(rows, 16)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t tb = 0; tb < rows; tb += kTokenBlock) {
      const int64_t te = std::min(rows, tb + kTokenBlock);
      for (int64_t item = begin; item < end; ++item)
        run_item(w, groups, kernels, xq, n, item, tb, te, bp, op);
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
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, "quant_gemm_grouped: bfloat16 out expected");
  auto mins_of = [&](int64_t g) {
    return mins.empty() ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(mins[g]);
  };
  const RowLayout* layout = nullptr;
  for (int64_t g = 0; g < weights; ++g) {
    TORCH_CHECK(offsets[g] <= offsets[g + 1] && data[g].sizes() == data[0].sizes() &&
                scales[g].scalar_type() == scales[0].scalar_type(),
                "quant_gemm_grouped: weights of one shape and layout expected");
    layout = &check_quant_gemm(out, x, data[g], scales[g], mins_of(g), bits, block,
                               biases.empty() ? c10::optional<at::Tensor>() : biases[g]);
  }
  const std::vector<Group>& groups = layout->groups;
  const int64_t m = x.size(0), n = data[0].size(0);
  if (m == 0) return;
  const QuantizedX xq = quantize_x(x, block, groups);
  const Kernels kernels = pick(bits, block, scales[0].scalar_type() == at::kHalf, !mins.empty());
  const OutRows op{out.data_ptr(), out.stride(0), false};
  const int64_t items = (n + kItemRows - 1) / kItemRows;
  // Every (weight, 16-row item) is one unit of a single parallel loop; each runs over its
  // weight's tokens.
  at::parallel_for(0, weights * items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t g = unit / items, item = unit % items;
      const Weight w = weight_of(data[g], scales[g], mins_of(g), zero);
      const c10::BFloat16* bp = biases.empty() ? nullptr : biases[g].data_ptr<c10::BFloat16>();
      for (int64_t tb = offsets[g]; tb < offsets[g + 1]; tb += kTokenBlock)
        run_item(w, groups, kernels, xq, n, item, tb, std::min(offsets[g + 1], tb + kTokenBlock),
                 bp, op);
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

// The bias of each panel's 32 columns: with silu_mul, a panel is 16 rows of gate and the
// same 16 of up, and its bias too.
c10::optional<at::Tensor> panel_bias(const c10::optional<at::Tensor>& bias, int64_t n,
                                     bool silu_mul) {
  if (!silu_mul || !bias.has_value()) return bias;
  return bias->view({2, n / 32, 16}).transpose(0, 1).contiguous();
}

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
// (pairs_of_chunks, above): the dequantization is shifts, masks, conversions and FMAs, with
// one interleave per 32 weights.

// The index of a word permutation: words (2 l, 2 l + 1) <- words (l, l + 16).
inline __m512i pair_halves() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

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
// 0-15) and, if TWO, x1 (16-31), over chunks chunks; work() after each chunk's products. Tiles
// (amx.h): tmm0-3 the sums, tmm4-5 x, tmm6-7 W.
template <bool TWO, typename Work>
__attribute__((target("amx-tile,amx-bf16"))) void rows_tile_product(
    const int32_t* w, const __m512i* x0, const __m512i* x1, int64_t chunks, float* acc,
    Work&& work) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(6, w + c * 512, 64);
    _tile_loadd(7, w + c * 512 + 256, 64);
    _tile_loadd(4, x0 + c * 16, 64);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 7, 4);
    if (TWO) {
      _tile_loadd(5, x1 + c * 16, 64);
      _tile_dpbf16ps(2, 6, 5);
      _tile_dpbf16ps(3, 7, 5);
    }
    work();
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16 * 32, 128);
  if (TWO) {
    _tile_stored(2, acc + 16, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
  }
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

// ----- 8-bit weights with one scale per row, on AMX-INT8 tiles -----
//
// Per-channel INT8 (W8A8's weights: u = q + 128, one scale per row of W) laid out as AMX-INT8
// B tiles at load time: [n / 16][k / 64][16][64], tile row i holding k = 64 j + 4 i .. + 3 of
// each of 16 rows of W (quantization/kept.py, AmxInt8Weight). x is quantized per token (W8A8's
// dynamic scheme: dx = max |x| / 127 over the token), in order, so its rows are the A tiles
// as they lie, and the product of a token and a row of W over all of K is one chain of
// TDPBSUD, scaled once at the end:
//     y[t][r] = dx[t] s[r] (sum_k q[t][k] u[r][k] - 128 sum_k q[t][k]) + bias[r]
// Tiles: 4 sums (32 tokens x 32 rows of W), 2 of x, 2 of W; each step of 64 k loads 4 tiles
// for 4 tile products. Up to 8 tokens (a decode step) read the same tiles on AVX-512 VNNI.
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
// next, next + wtile), so that the token tiles over a block share its prefetch. Tiles
// (amx.h): tmm0-3 the sums (token tile tt, row tile wr: 2 tt + wr), tmm4-5 x, tmm6-7 W.
template <int TT, int WR>
__attribute__((target("amx-tile,amx-int8"))) void int8_tile_product(
    const int8_t* a, int64_t lda, const uint8_t* w, int64_t wtile, int64_t steps,
    const uint8_t* next, int line0, int line1, int32_t* acc) {
  _tile_zero(0);
  if (WR == 2) _tile_zero(1);
  if (TT == 2) _tile_zero(2);
  if (TT == 2 && WR == 2) _tile_zero(3);
  for (int64_t j = 0; j < steps; ++j) {
    if (next != nullptr)
      for (int line = line0; line < line1; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + (line / 16) * wtile + j * 1024 +
                                                   (line % 16) * 64), _MM_HINT_T1);
    _tile_loadd(6, w + j * 1024, 64);
    if (WR == 2) _tile_loadd(7, w + wtile + j * 1024, 64);
    _tile_loadd(4, a + j * 64, lda);
    _tile_dpbsud(0, 4, 6);
    if (WR == 2) _tile_dpbsud(1, 4, 7);
    if (TT == 2) {
      _tile_loadd(5, a + 16 * lda + j * 64, lda);
      _tile_dpbsud(2, 5, 6);
      if (WR == 2) _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 128);
  if (WR == 2) _tile_stored(1, acc + 16, 128);
  if (TT == 2) _tile_stored(2, acc + 16 * 32, 128);
  if (TT == 2 && WR == 2) _tile_stored(3, acc + 16 * 32 + 16, 128);
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

// ----- the same blocks laid out in 16-row tiles -----
//
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
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  auto quantize = [&](const auto* row, int64_t t) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t total = 0;
      const float d = quantize_span(row + b * block, block, out.q.data() + t * k + b * block,
                                    total);
      out.scale[t * blocks + b] = d;
      out.sum[t * blocks + b] = d * static_cast<float>(total);
    }
  };
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> remainder(two_levels ? k : 0);
    for (int64_t t = begin; t < end; ++t) {
      const c10::BFloat16* row = xp + t * x.stride(0);
      quantize(row, t * per_token);
      if (two_levels) {
        remainder_row(row, k, block, remainder.data());
        quantize(remainder.data(), 2 * t + 1);
      }
    }
  });
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
  float* const fo = logits ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* const op = logits ? nullptr : out.data_ptr<c10::BFloat16>();
  // an item: 4 rows of xq by a set of two groups, g0 and g0 + apart (with silu_mul, 16 rows
  // of gate and their 16 of up); for one token, of one group (one stream of W an item, which
  // keeps up with memory better than two)
  const int64_t per = !silu_mul && m == 1 ? 1 : 2;
  const int64_t sets = silu_mul ? groups / 2 : (groups + per - 1) / per;
  const int64_t apart = silu_mul ? groups / 2 : 1;
  const int64_t quads = (rows + kTiledTokens - 1) / kTiledTokens;
  const int64_t block_quads = std::min<int64_t>(quads, kTiledBlockRows / kTiledTokens);
  const int64_t ldo = out.stride(0);
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
      if (logits) {
        for (int t = 0; t < tokens; t += 2) {
          float* row = fo + (t0 + t) / 2 * ldo;
          for (int g = 0; g < gs; ++g) {
            const int64_t r = 16 * (g0 + g);
            const __m512 sum = _mm512_add_ps(acc[t * gs + g], acc[(t + 1) * gs + g]);
            _mm512_storeu_ps(row + r, bp ? _mm512_add_ps(sum, bf16x16_load(bp + r)) : sum);
          }
        }
        continue;
      }
      for (int t = 0; t < tokens; ++t) {
        const __m512* sums = acc + t * gs;
        c10::BFloat16* row = op + (t0 + t) * ldo;
        if (silu_mul) {
          const __m512 gate = bp ? _mm512_add_ps(sums[0], bf16x16_load(bp + 16 * g0)) : sums[0];
          const __m512 up = bp ? _mm512_add_ps(sums[1], bf16x16_load(bp + 16 * (g0 + apart)))
                               : sums[1];
          bf16x16_store(row + 16 * set, silu_mul16(gate, up));
          continue;
        }
        for (int g = 0; g < gs; ++g) {
          const int64_t r = 16 * (g0 + g);
          bf16x16_store(row + r, bp ? _mm512_add_ps(sums[g], bf16x16_load(bp + r)) : sums[g]);
        }
      }
    }
  });
}

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
