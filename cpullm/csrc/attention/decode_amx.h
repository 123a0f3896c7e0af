// The decode kernel's scores on AMX tiles (decode.cpp).
#pragma once

#include "decode_bf16.h"

namespace cpullm {
namespace attn {
namespace {

// The query groups of kv consecutive KV heads as the B operands of TDPBF16PS, one set of
// chunks per KV head: for KV head h's 32 dimensions c, 16 rows (dimension pairs) of 16
// columns (query heads, zero but for h's group) of 32-bit pairs:
// words[h chunks + c][r][h group + g] = (q_hg[32c + 2r], q_hg[32c + 2r + 1]). Chunk after
// chunk, they meet a token's keys of those KV heads as they lie side by side in its row.
inline void query_tiles(int32_t* words, const c10::BFloat16* q, int64_t group, int64_t kv,
                        int64_t head_dim) {
  const int64_t chunks = head_dim / 32;
  std::fill(words, words + kv * chunks * 256, 0);
  for (int64_t col = 0; col < kv * group; ++col) {
    const auto* qg = reinterpret_cast<const int32_t*>(q + col * head_dim);
    int32_t* head = words + (col / group) * chunks * 256;
    for (int64_t w = 0; w < chunks * 16; ++w) head[(w / 16) * 256 + (w % 16) * 16 + col] = qg[w];
  }
}

// (the tile of an AMX instruction is part of its text: a constant C picks a case)
template <int C>
__attribute__((target("amx-tile,amx-bf16"))) inline void load_query_tile(const int32_t* words) {
  const int32_t* w = words + 256 * C;
  switch (C) {
    case 0: _tile_loadd(2, w, 64); break;
    case 1: _tile_loadd(3, w, 64); break;
    case 2: _tile_loadd(4, w, 64); break;
    case 3: _tile_loadd(5, w, 64); break;
    case 4: _tile_loadd(6, w, 64); break;
    case 5: _tile_loadd(7, w, 64); break;
  }
}

// tmm0 += a's 32-dimension chunk C (into tmm1; rows `stride` bytes apart) times the query's
// (kept in tmm2 + C for up to 6 chunks; past that, loaded into tmm2 for each).
template <int CH, int C>
__attribute__((target("amx-tile,amx-bf16"))) inline void chunk_scores(
    const c10::BFloat16* a, int64_t stride, const int32_t* words) {
  _tile_loadd(1, a + 32 * C, stride);
  if constexpr (CH > 6) {
    _tile_loadd(2, words + 256 * C, 64);
    _tile_dpbf16ps(0, 1, 2);
    return;
  }
  switch (C) {
    case 0: _tile_dpbf16ps(0, 1, 2); break;
    case 1: _tile_dpbf16ps(0, 1, 3); break;
    case 2: _tile_dpbf16ps(0, 1, 4); break;
    case 3: _tile_dpbf16ps(0, 1, 5); break;
    case 4: _tile_dpbf16ps(0, 1, 6); break;
    case 5: _tile_dpbf16ps(0, 1, 7); break;
  }
}

// tmm0 = the scores of 16 tokens (rows of a) against the query: 16 x 16 (tokens x query
// heads) float32.
template <int CH, int... C>
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_scores(
    const c10::BFloat16* a, int64_t stride, const int32_t* words,
    std::integer_sequence<int, C...>) {
  _tile_zero(0);
  (chunk_scores<CH, C>(a, stride, words), ...);
}

template <int... C>
__attribute__((target("amx-tile,amx-bf16"))) inline void load_query_tiles(
    const int32_t* words, std::integer_sequence<int, C...>) {
  (load_query_tile<C>(words), ...);
}

// paged_scores_bf16 on AMX tiles: a tile of 16 tokens' keys, read where they lie in their
// block, times the query tiles gives 16 x 16 scores (tokens x query heads) at once, with no
// reduction across lanes. A tile that would run past its block's end (a short block, a
// window's start) is copied first. The tile configuration must be loaded.
template <int CH>
__attribute__((target("amx-tile,amx-bf16"))) void paged_scores_amx(
    float* scores, const int32_t* words, int64_t group, float scale, const c10::BFloat16* kp,
    const c10::BFloat16* vp, const int64_t* bt, int64_t first, int64_t len, int64_t block_size,
    int64_t block_stride, int64_t token_stride, int64_t ahead, NextItemPrefetch& next_item) {
  using Chunks = std::make_integer_sequence<int, CH>;
  if constexpr (CH <= 6) load_query_tiles(words, Chunks{});
  alignas(64) float product[16 * 16];
  alignas(64) c10::BFloat16 staging[16 * CH * 32];
  const int64_t n = len - first;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                           192, 208, 224, 240);
  for (int64_t t = first; t < len;) {
    const int64_t off = t % block_size, run = std::min(len - t, block_size - off);
    const int64_t base = bt[t / block_size] * block_stride + off * token_stride;
    const c10::BFloat16* k = kp + base;
    const c10::BFloat16* v = vp + base;
    // the keys `ahead` tokens ahead on their way, as in paged_scores_bf16: a tile load from
    // memory waits for its 16 lines
    for (int64_t j = 0; j < std::min(run, ahead); ++j) prefetch_row(k + j * token_stride, CH * 64);
    for (int64_t i = 0; i < run; i += 16) {
      const int64_t m = std::min<int64_t>(16, run - i);
      next_item.step(m);
      for (int64_t j = i + ahead; j < std::min(run, i + m + ahead); ++j)
        prefetch_row(k + j * token_stride, CH * 64);
      for (int64_t j = i; j < i + m; ++j) prefetch_row(v + j * token_stride, CH * 64);
      const c10::BFloat16* a = k + i * token_stride;
      int64_t stride = token_stride * 2;
      if (off + i + 16 > block_size) {  // rows past m are read but their scores dropped
        for (int64_t j = 0; j < m; ++j)
          std::memcpy(staging + j * CH * 32, a + j * token_stride, CH * 64);
        a = staging;
        stride = CH * 64;
      }
      tile_scores<CH>(a, stride, words, Chunks{});
      _tile_stored(0, product, 64);
      const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
      float* row = scores + (t - first) + i;
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(row + g * n, valid,
                              _mm512_mul_ps(_mm512_i32gather_ps(column, product + g, 4), vscale));
    }
    t += run;
  }
}

}  // namespace
}  // namespace attn
}  // namespace cpullm
