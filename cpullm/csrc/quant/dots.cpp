// quant_gemm and quant_gemm_grouped: the int8 dot products on the groups layout (kept.h),
// on AVX-512 VNNI where the library has it, else on AVX2.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "dots_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "dots_avx2.h"
#endif

namespace cpullm {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using namespace quant;

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

}  // namespace cpullm
