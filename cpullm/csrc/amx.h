// AMX tiles: the OS permission, the one tile configuration and the tile loop that the AMX
// kernels share (gemm_amx.cpp, attention/, quant/). Only for code compiled with AVX-512 BF16, run only where
// the CPU has AMX: ask amx_permitted() first.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace cpullm {

// Linux gives a process the AMX tile state only on request (arch_prctl, XTILEDATA).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows of 64 bytes (what a TDPBF16PS of 16 x 32 by 32 x 16 takes).
__attribute__((target("amx-tile,amx-bf16"))) inline void load_tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  // ldtilecfg reads the 64 bytes, which the compiler does not see: keep them in memory.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// One operand of tile_products: its tile i (0 or 1) of step s at base[i] + s * step bytes,
// the tile's 16 rows stride[i] bytes apart.
struct TileSource {
  const void* base[2];
  int64_t stride[2];
  int64_t step;
  const void* at(int i, int64_t s) const {
    return static_cast<const char*>(base[i]) + s * step;
  }
};

enum class TileOp { kBF16, kS8U8 };  // TDPBF16PS (float32 sums), TDPBSUD (int32 sums)

// The tile loop of every AMX GEMM: sums[32][32] (float32 or int32, 128 bytes a row) = NA
// tiles of a (its rows 0-15, 16-31) by NB tiles of b (columns 0-15, 16-31), over steps.
// Sum (i, j) is tile 2 i + j (tmm0-3), a's tiles tmm4-5, b's tmm6-7. accumulate: add to what
// sums holds; before(s) runs ahead of step s's loads (prefetch), after() once its products
// are issued (work for the vector units while the tiles compute).
template <TileOp OP, int NA, int NB, typename Before, typename After>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void tile_products(
    const TileSource& a, const TileSource& b, int64_t steps, void* sums, bool accumulate,
    Before&& before, After&& after) {
// The tile numbers reach the assembler as text: literals, not template arguments.
#define CPULLM_TILE_DOT(C, A, B)                 \
  do {                                           \
    if constexpr (OP == TileOp::kBF16)           \
      _tile_dpbf16ps(C, A, B);                   \
    else                                         \
      _tile_dpbsud(C, A, B);                     \
  } while (0)
  char* c = static_cast<char*>(sums);
  if (accumulate) {
    _tile_loadd(0, c, 128);
    if (NB == 2) _tile_loadd(1, c + 64, 128);
    if (NA == 2) _tile_loadd(2, c + 16 * 128, 128);
    if (NA == 2 && NB == 2) _tile_loadd(3, c + 16 * 128 + 64, 128);
  } else {
    _tile_zero(0);
    if (NB == 2) _tile_zero(1);
    if (NA == 2) _tile_zero(2);
    if (NA == 2 && NB == 2) _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    before(s);
    _tile_loadd(6, b.at(0, s), b.stride[0]);
    if (NB == 2) _tile_loadd(7, b.at(1, s), b.stride[1]);
    _tile_loadd(4, a.at(0, s), a.stride[0]);
    CPULLM_TILE_DOT(0, 4, 6);
    if (NB == 2) CPULLM_TILE_DOT(1, 4, 7);
    if (NA == 2) {
      _tile_loadd(5, a.at(1, s), a.stride[1]);
      CPULLM_TILE_DOT(2, 5, 6);
      if (NB == 2) CPULLM_TILE_DOT(3, 5, 7);
    }
    after();
  }
  _tile_stored(0, c, 128);
  if (NB == 2) _tile_stored(1, c + 64, 128);
  if (NA == 2) _tile_stored(2, c + 16 * 128, 128);
  if (NA == 2 && NB == 2) _tile_stored(3, c + 16 * 128 + 64, 128);
#undef CPULLM_TILE_DOT
}

struct NoWork {
  void operator()() const {}
};

}  // namespace cpullm
