// The bfloat16 GEMM on weights packed in 32-column panels.
#include "gemm_tiles.h"
#include "ops.h"

namespace cpullm {

#if defined(__AVX512BF16__)
// bfloat16 x @ W.T for any number of rows, with W packed once into panels of 32 output
// columns: panels[p][kk][c][j] = W[32p + c][2kk + j]. One 128-byte row of a panel holds the
// (k, k+1) pairs of 32 columns, what two dpbf16 instructions multiply with a broadcast pair
// of x. Each thread takes a contiguous run of panels; for each it walks the rows of x in
// tiles of up to 12 (24 accumulators), and while it computes the first tile it prefetches
// its next panel into L2, so weights that come from memory (every decode step reads them
// all once) stream in behind the arithmetic instead of stalling it.
//
// With silu_mul, each panel holds 16 gate columns then the 16 matching up columns (the
// caller interleaves a merged gate-up weight so), and the store writes
// silu(gate) * up, rounded where silu_and_mul_bf16 rounds, into an output half as wide.
//
// out may be float32 (the LM head's logits): the same sums, stored unrounded.
namespace {
template <typename O>
void gemm_bf16_as(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                  const c10::optional<at::Tensor>& bias, bool silu_mul) {
  const int64_t m = x.size(0), k2 = panels.size(1), n = panels.size(0) * 32;
  const int64_t width = silu_mul ? n / 2 : n, panel_width = silu_mul ? 16 : 32;
  using Rows = std::make_integer_sequence<int, kGemmRows>;
  static const GemmTiles<O> tables[2][2] = {
      {gemm_tiles<false, false, O>(Rows{}), gemm_tiles<false, true, O>(Rows{})},
      {gemm_tiles<true, false, O>(Rows{}), gemm_tiles<true, true, O>(Rows{})}};
  const at::Tensor xs = rows_apart(x);
  const c10::BFloat16* xp = xs.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = panels.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  O* op = out.data_ptr<O>();
  const int64_t ldx = xs.stride(0), panel_size = k2 * 64;
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kGemmBlockRows) {
      const int64_t r1 = std::min(m, r0 + kGemmBlockRows);
      for (int64_t p = begin; p < end; ++p) {
        const c10::BFloat16* panel = wp + p * panel_size;
        const char* next = reinterpret_cast<const char*>(panel + panel_size);
        const c10::BFloat16* pb = bp != nullptr ? bp + p * 32 : nullptr;
        for (int64_t r = r0; r < r1; r += kGemmRows) {
          const int64_t rows = std::min<int64_t>(kGemmRows, r1 - r);
          const GemmTiles<O>& table = tables[r == 0 && p + 1 < end][silu_mul];
          table[rows - 1](xp + r * ldx, ldx, panel, k2, pb, op + r * width + p * panel_width,
                          width, next);
        }
      }
    }
  });
}
}  // namespace

void gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias,
               bool silu_mul) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16,
              "gemm_bf16: bfloat16 x and panels expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 2 == 0 && out.is_contiguous() &&
              panels.is_contiguous() && panels.dim() == 4 && panels.size(2) == 32 &&
              panels.size(3) == 2, "gemm_bf16: rows of x, packed panels [N/32, K/2, 32, 2]");
  const int64_t n = panels.size(0) * 32;
  TORCH_CHECK(x.size(1) == 2 * panels.size(1) && out.size(0) == x.size(0) &&
              out.size(1) == (silu_mul ? n / 2 : n), "gemm_bf16: shapes do not match");
  with_out_type(out, "gemm_bf16", [&](auto o) {
    gemm_bf16_as<decltype(o)>(out, x, panels, bias, silu_mul);
  });
}

// Several packed weights of one shape, each with its own run of rows of x (the experts of
// a mixture and the tokens routed to each): rows [offsets[g], offsets[g + 1]) of out are
// those rows of x times weight g, as gemm_bf16 computes them (the same tiles, so the same
// bits). Every (weight, panel) of the call is one item of a single parallel loop: a decode
// step's few rows per expert keep every thread busy across experts, with one call from
// Python per projection instead of one per expert. x and out may be views of wider rows:
// the caller lays rows that would lie a multiple of 4 KiB apart 64 bytes further apart, as
// rows_apart (gemm_tiles.h) copies the x of gemm_bf16, but without the copy.
void gemm_bf16_grouped(at::Tensor out, at::Tensor x, std::vector<at::Tensor> panels,
                       std::vector<int64_t> offsets, bool silu_mul) {
  const int64_t groups = static_cast<int64_t>(panels.size());
  TORCH_CHECK(groups > 0 && static_cast<int64_t>(offsets.size()) == groups + 1 &&
              offsets[0] == 0 && offsets[groups] == x.size(0),
              "gemm_bf16_grouped: offsets [0, ..., rows] expected, one more than weights");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 2 == 0 && out.dim() == 2 &&
              out.stride(1) == 1, "gemm_bf16_grouped: bfloat16 rows of x and of out expected");
  const at::Tensor& first = panels[0];
  for (const at::Tensor& w : panels)
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 4 &&
                w.sizes() == first.sizes() && w.size(2) == 32 && w.size(3) == 2,
                "gemm_bf16_grouped: packed panels [N/32, K/2, 32, 2] of one shape expected");
  const int64_t k2 = first.size(1), n = first.size(0) * 32, num_panels = first.size(0);
  const int64_t width = silu_mul ? n / 2 : n, panel_width = silu_mul ? 16 : 32;
  TORCH_CHECK(x.size(1) == 2 * k2 && out.size(0) == x.size(0) && out.size(1) == width,
              "gemm_bf16_grouped: shapes do not match");
  using Rows = std::make_integer_sequence<int, kGemmRows>;
  using B = c10::BFloat16;
  static const GemmTiles<B> tables[2][2] = {
      {gemm_tiles<false, false, B>(Rows{}), gemm_tiles<false, true, B>(Rows{})},
      {gemm_tiles<true, false, B>(Rows{}), gemm_tiles<true, true, B>(Rows{})}};
  std::vector<const c10::BFloat16*> weights(groups);
  for (int64_t g = 0; g < groups; ++g) weights[g] = panels[g].data_ptr<c10::BFloat16>();
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), panel_size = k2 * 64;
  at::parallel_for(0, groups * num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / num_panels, p = item % num_panels;
      const c10::BFloat16* panel = weights[g] + p * panel_size;
      // the panel this thread takes next, prefetched while this one is used
      const bool more = item + 1 < end;
      const char* next = more ? reinterpret_cast<const char*>(
          weights[(item + 1) / num_panels] + (item + 1) % num_panels * panel_size) : nullptr;
      for (int64_t r = offsets[g]; r < offsets[g + 1]; r += kGemmRows) {
        const int64_t rows = std::min<int64_t>(kGemmRows, offsets[g + 1] - r);
        const GemmTiles<B>& table = tables[r == offsets[g] && more][silu_mul];
        table[rows - 1](xp + r * ldx, ldx, panel, k2, nullptr,
                        op + r * ldo + p * panel_width, ldo, next);
      }
    }
  });
}

// Rows ids of the table W that panels hold (gemm_bf16's layout) into out [T, K]: the lookup
// of an embedding table tied to a packed LM head, read from the head's panels so that the
// table is kept once. Row i's pairs (2kk, 2kk + 1) are dwords 128 bytes apart, gathered 16
// at a time.
void embedding_from_panels(at::Tensor out, at::Tensor ids, at::Tensor panels) {
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
              ids.scalar_type() == at::kLong && panels.is_contiguous() && panels.dim() == 4 &&
              panels.size(2) == 32 && panels.size(3) == 2 && ids.dim() == 1 &&
              ids.is_contiguous() && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == ids.size(0) && out.size(1) == 2 * panels.size(1),
              "embedding_from_panels: out [T, K] bfloat16, ids [T] int64, panels [N/32, K/2, 32, 2]");
  const int64_t t = ids.size(0), k2 = panels.size(1), n = panels.size(0) * 32;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "embedding_from_panels: token id ", idp[i],
                " outside the table's ", n, " rows");
  const int32_t* wp = reinterpret_cast<const int32_t*>(panels.data_ptr<c10::BFloat16>());
  int32_t* op = reinterpret_cast<int32_t*>(out.data_ptr<c10::BFloat16>());
  const __m512i stride = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(32));
  at::parallel_for(0, t, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int32_t* row = wp + idp[i] / 32 * k2 * 32 + idp[i] % 32;
      int32_t* o = op + i * k2;
      int64_t kk = 0;
      for (; kk + 16 <= k2; kk += 16)
        _mm512_storeu_si512(o + kk, _mm512_i32gather_epi32(stride, row + kk * 32, 4));
      for (; kk < k2; ++kk) o[kk] = row[kk * 32];
    }
  });
}
#endif

}  // namespace cpullm
