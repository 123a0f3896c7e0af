// What the int8 dot products on the groups layout share across their ISA variants
// (dots_avx512.h, dots_avx2.h): x in the weights' steps, and the rows of work.
#pragma once

#include "kept.h"

namespace cpullm {
namespace quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// x as int8 in the weights' steps, per token (lanes past a group's end zero), dx and
// dx * sum(q) per block.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  int64_t q_stride, block_stride;
};

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
inline QuantizedX quantize_x(const at::Tensor& x, int64_t block,
                             const std::vector<Group>& groups, bool two_levels = false) {
  const int64_t k = x.size(1), blocks = k / block, per_token = two_levels ? 2 : 1;
  const int64_t m = x.size(0) * per_token;
  const Group& last = groups.back();
  const int64_t q_stride = last.x_offset + 64 * last.steps;
  QuantizedX out{std::vector<int8_t>(m * q_stride, 0), std::vector<float>(m * blocks),
                 std::vector<float>(m * blocks), q_stride, blocks};
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
  quantize_levels(x, block, two_levels, 16, quantize);
  return out;
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

#endif

}  // namespace quant
}  // namespace cpullm
