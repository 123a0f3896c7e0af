// The rows' layouts of the groups layout (kept.h), and the kernels' checks of their
// arguments.
#include "kept.h"

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace cpullm {
namespace quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
namespace {

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

}  // namespace

const RowLayout& layout_of(int64_t blocks, int block, int bits) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int, int>, std::unique_ptr<const RowLayout>> layouts;
  const std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<const RowLayout>& layout = layouts[{blocks, block, bits}];
  if (!layout) {
    auto made = std::make_unique<RowLayout>();
    made->groups = groups_of(blocks, block, bits);
    layout = std::move(made);
  }
  return *layout;
}

const RowLayout& check_quant_gemm(const at::Tensor& out, const at::Tensor& x,
                                  const at::Tensor& data, const at::Tensor& scales,
                                  const c10::optional<at::Tensor>& mins, int64_t bits,
                                  int64_t block, const c10::optional<at::Tensor>& bias) {
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
              out.size(1) == n, "quant_gemm: shapes do not match");
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
#endif

}  // namespace quant
}  // namespace cpullm
