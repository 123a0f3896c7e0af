// AMX tiles: the OS permission and the one tile configuration that the AMX kernels share
// (gemm_amx.cpp, attention/, quant/). Only for code compiled with AVX-512 BF16, run only where
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

}  // namespace cpullm
