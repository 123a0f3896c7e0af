// What the decode and prompt attention kernels share: the split of items over threads by
// cost, the sink logits, soft-capping.
#pragma once

#include "../amx.h"
#include "../ops.h"
#include "../vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace cpullm {
namespace attn {

constexpr float kNoSink = -std::numeric_limits<float>::infinity();

// Runs body(begin, end) over contiguous ranges of items [0, n), one range per thread, of
// about equal cost, where at::parallel_for would split by count: a decode item's cost is its
// sequence's context, and a thread holding the long ones keeps the others waiting.
// cost(i) >= 0 is item i's.
template <typename Cost, typename Body>
void parallel_by_cost(int64_t n, Cost&& cost, Body&& body) {
  std::vector<int64_t> prefix(n + 1, 0);  // prefix[i]: the cost of items [0, i)
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  auto start = [&](int64_t t) {  // the first item of thread t's range
    if (t == 0 || t == threads) return t == 0 ? int64_t{0} : n;
    return static_cast<int64_t>(
        std::lower_bound(prefix.begin(), prefix.end(), prefix[n] * t / threads) -
        prefix.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = start(t), end = start(t + 1);
      if (begin < end) body(begin, end);
    }
  });
}

// A decode item's (a sequence's KV head) cost: the tokens it reads, plus about 16 tokens'
// worth of setup.
inline int64_t decode_cost(const int64_t* lens, int64_t item, int64_t num_kv_heads,
                           int64_t window) {
  const int64_t len = lens[item / num_kv_heads];
  return (window > 0 ? std::min(len, window) : len) + 16;
}

// The first key a decode query at position len - 1 reads: the last `window` (> 0), or all.
inline int64_t window_first(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// The sink logits of attention sinks, one float32 per query head, or nullptr.
inline const float* sink_logits(const c10::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
              sinks->numel() == num_heads, "attention sinks: ", num_heads,
              " contiguous float32 logits expected");
  return sinks->data_ptr<float>();
}

// Attention logit soft-capping (Gemma 2): each score s becomes cap * tanh(s / cap).
inline void soft_cap(float* scores, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

#if defined(__AVX512BF16__)
// Two accumulators of BF16 dot products on rows interleaved by unpacklo/hi of 16-bit words
// (each 128-bit lane's dimensions 0-3 in lo, 4-7 in hi) -> dimensions 0-15 and 16-31.
inline void interleaved_in_order(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i first_order =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_order =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  first = _mm512_permutex2var_ps(lo, first_order, hi);
  second = _mm512_permutex2var_ps(lo, second_order, hi);
}
#endif

}  // namespace attn
}  // namespace cpullm
