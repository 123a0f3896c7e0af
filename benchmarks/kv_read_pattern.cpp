// How fast two threads read a paged KV cache in decode attention's two orders, with plain
// loads and nothing computed: one KV head of a sequence at a time (a slice of every token's
// row, once per KV head) or all its KV heads at once (each row whole). SmolLM2-135M's
// shape: 3 KV heads of 64, 128 sequences of 96-192 tokens, blocks of 128 tokens in random
// order, 30 layers. docs/benchmarks.md quotes it.
//
//   g++ -O2 -march=native -fopenmp benchmarks/kv_read_pattern.cpp -o kv_read_pattern
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=true ./kv_read_pattern heads 16   # by KV head, L1
//                                                                     # prefetch 16 rows ahead
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=true ./kv_read_pattern rows 0     # whole rows, none
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s heads|rows [prefetch rows ahead]\n", argv[0]);
    return 1;
  }
  const bool by_head = std::strcmp(argv[1], "heads") == 0;
  const int ahead = argc > 2 ? std::atoi(argv[2]) : 16;
  constexpr int kSeqs = 128, kKvHeads = 3, kDim = 64, kBlock = 128, kLayers = 30, kContext = 192;
  constexpr int kBlocksPerSeq = (kContext + kBlock - 1) / kBlock, kBlocks = kSeqs * kBlocksPerSeq;
  constexpr size_t kRow = kKvHeads * kDim;  // bfloat16 values of a token's row
  constexpr size_t kBlockValues = kBlock * kRow;
  std::vector<uint16_t*> keys(kLayers), values(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    keys[l] = static_cast<uint16_t*>(std::aligned_alloc(64, kBlocks * kBlockValues * 2));
    values[l] = static_cast<uint16_t*>(std::aligned_alloc(64, kBlocks * kBlockValues * 2));
    std::memset(keys[l], 1, kBlocks * kBlockValues * 2);
    std::memset(values[l], 1, kBlocks * kBlockValues * 2);
  }
  std::vector<int> table(kBlocks);
  for (int i = 0; i < kBlocks; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), std::mt19937(0));
  std::vector<int> lens(kSeqs);
  std::mt19937 rng(1);
  for (int& len : lens) len = kContext / 2 + static_cast<int>(rng() % (kContext / 2 + 1));

  const int items = by_head ? kSeqs * kKvHeads : kSeqs;
  const int width = by_head ? kDim : static_cast<int>(kRow);  // values read per row
  double best = 1e30;
  float sink = 0;
  for (int run = 0; run < 10; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int l = 0; l < kLayers; ++l) {
#pragma omp parallel for schedule(static) reduction(+ : sink)
      for (int item = 0; item < items; ++item) {
        const int s = by_head ? item / kKvHeads : item, h = by_head ? item % kKvHeads : 0;
        auto row_of = [&](const uint16_t* cache, int t) {
          return cache + table[s * kBlocksPerSeq + t / kBlock] * kBlockValues +
                 (t % kBlock) * kRow + h * kDim;
        };
        __m512 acc = _mm512_setzero_ps();
        for (const uint16_t* cache : {keys[l], values[l]})
          for (int t = 0; t < lens[s]; ++t) {
            if (ahead > 0 && t + ahead < lens[s]) {
              const char* next = reinterpret_cast<const char*>(row_of(cache, t + ahead));
              for (int b = 0; b < width * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            }
            const uint16_t* row = row_of(cache, t);
            for (int c = 0; c < width; c += 32)
              acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_loadu_si512(row + c)));
          }
        sink += _mm512_reduce_add_ps(acc);
      }
    }
    best = std::min(best, std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - start).count());
  }
  size_t bytes = 0;
  for (int len : lens) bytes += static_cast<size_t>(len) * kRow * 2 * 2 * kLayers;
  std::printf("%s, prefetch %d rows ahead: %.2f ms, %.1f GB/s (%g)\n",
              by_head ? "one KV head at a time" : "whole rows", ahead, best * 1e3,
              bytes / best / 1e9, sink);
  return 0;
}
