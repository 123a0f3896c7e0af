// What one core's AMX-BF16 tiles can do with and without tile loads, on random bfloat16
// data (constant data runs faster and misleads). docs/benchmarks.md quotes it.
//
//   g++ -O2 -mamx-tile -mamx-bf16 benchmarks/amx_tile_loads.cpp -o amx_tile_loads
//   ./amx_tile_loads 16     # operands cycled through 16 KiB (L1); 512 for L2
//
// Each line is one loop of k-steps as a GEMM's 2 x 2 block of tiles runs them: 4
// accumulators, 2 tiles of x and 2 of the weight, 4 tile products per step.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

#define LOAD(t, offset) _tile_loadd(t, p + (offset), 64)
#define PRODUCT(c, a, b) _tile_dpbf16ps(c, a, b)
#define RUN(name, products, body)                                                      \
  {                                                                                    \
    const auto start = std::chrono::steady_clock::now();                               \
    for (long r = 0; r < reps; ++r)                                                    \
      for (long j = 0; j < steps; ++j) {                                               \
        const char* p = base + j * 4096;                                               \
        body                                                                           \
      }                                                                                \
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); \
    std::printf("%-34s %6.0f GMAC/s  %5.1f ns a step\n", name,                         \
                reps * steps * (products) * 8192.0 / s / 1e9, s / reps / steps * 1e9);  \
  }

int main(int argc, char** argv) {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "the OS gives this process no AMX tiles\n");
    return 1;
  }
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  std::vector<uint16_t> buffer(32 << 20);
  for (auto& v : buffer)  // bfloat16 values in [0.5, 2), random signs
    v = static_cast<uint16_t>(0x3f40 + (std::rand() & 0x7f) + ((std::rand() & 1) << 15));
  const char* base = reinterpret_cast<const char*>(buffer.data());
  const long region = (argc > 1 ? std::atol(argv[1]) : 16) << 10, steps = region / 4096;
  const long reps = 4000000 / steps;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  {
    const char* p = base;
    LOAD(4, 0);
    LOAD(5, 1024);
    LOAD(6, 2048);
    LOAD(7, 3072);
  }
  RUN("tile products only", 4, (void)p; PRODUCT(0, 4, 6); PRODUCT(1, 4, 7);
      PRODUCT(2, 5, 6); PRODUCT(3, 5, 7);)
  RUN("4 tile loads only", 4, LOAD(4, 2048); LOAD(6, 0); LOAD(7, 1024); LOAD(5, 3072);)
  RUN("2 loads (x), 4 products", 4, LOAD(4, 2048); PRODUCT(0, 4, 6); PRODUCT(1, 4, 7);
      LOAD(5, 3072); PRODUCT(2, 5, 6); PRODUCT(3, 5, 7);)
  RUN("4 loads, 4 products (a GEMM step)", 4, LOAD(6, 0); LOAD(7, 1024); LOAD(4, 2048);
      PRODUCT(0, 4, 6); PRODUCT(1, 4, 7); LOAD(5, 3072); PRODUCT(2, 5, 6); PRODUCT(3, 5, 7);)
  alignas(64) float sink[256];
  _tile_stored(0, sink, 64);
  _tile_release();
  return sink[0] == 12345.f;
}
