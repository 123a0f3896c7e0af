// The bfloat16 GEMM on AMX tiles, on the same 32-column panels as gemm_bf16 (gemm.cpp).
//
// A panel's 128-byte row holds the (k, k+1) pairs of 32 output columns, so 16 of its rows
// at a stride of 128 bytes are exactly the B operand of TDPBF16PS for 16 columns and 32 k
// (the first 64 bytes of each row) or for the next 16 columns (the second 64 bytes). The
// A operand, 16 rows of x by 32 k, is read from x as it lies. So one packed copy of a
// weight serves both GEMMs, and the CPU needs no second, blocked copy for oneDNN.
//
// Tiles: 4 accumulators (32 rows x 32 columns, float32), 2 of x, 2 of the panel; each
// k-step of 32 loads 4 tiles for 4 tile products. A thread takes a contiguous run of
// (row block, panel) items; a row block is as many rows of x as stay in L2 (at least 32),
// and the panel a thread takes next is prefetched while the first rows run over this one.
// The float32 accumulators leave through a small buffer into the same stores as gemm_bf16
// (bias, silu(gate) * up), so both GEMMs round their outputs alike.
#include "amx.h"
#include "gemm_tiles.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <functional>
#include <vector>

namespace cpullm {

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t kAmxBlockBytes = 1 << 20;  // the rows of x a row block keeps in L2
constexpr int64_t kAmxDeepK = 1024;  // above: K in slices (see gemm_bf16_amx)
constexpr int64_t kAmxSliceK = 2048;

// Tiles (amx.h): tmm0-3 the accumulators, tmm4-5 x, tmm6-7 the panel.

// acc [32][32] float32 = tiles of x (a0: rows 0-15, a1: rows 16-31, each with its own
// stride in bytes) times one panel, over k2 pairs of k (a multiple of 16). TWO: both row
// tiles; else a0's alone. next: a panel to prefetch into L2 as this one runs, or null:
// lines [line0, line1) of each k-step's 2 KiB (32 lines) of it, so that the row tiles of a
// panel share its prefetch evenly. accumulate: add to what acc holds (a product over the
// k before these) instead of starting from zero. work(): after each k-step's products, as
// the tiles compute (the next panel's dequantization, a part at a time).
template <bool TWO, typename Work = NoWork>
void amx_panel(const c10::BFloat16* a0, int64_t lda0, const c10::BFloat16* a1, int64_t lda1,
               const c10::BFloat16* panel, int64_t k2, const char* next, int line0, int line1,
               float* acc, bool accumulate = false, Work work = Work{}) {
  // a k-step: 32 k of x's rows (64 bytes), 16 rows of the panel's 128-byte pairs
  const TileSource a{{a0, a1}, {lda0, lda1}, 64}, b{{panel, panel + 32}, {128, 128}, 2048};
  auto prefetch = [&](int64_t s) {
    if (next != nullptr)
      for (int line = line0; line < line1; ++line)
        _mm_prefetch(next + s * 2048 + line * 64, _MM_HINT_T1);
  };
  tile_products<TileOp::kBF16, TWO ? 2 : 1, 2>(a, b, k2 / 16, acc, accumulate, prefetch, work);
}

// x's rows as A operands: rows [r, r + 16) where they lie; the last rows past a multiple
// of 16 copied into a zero-padded whole tile, since a tile load reads 16 rows and there may
// be no memory after x's last row.
class RowTiles {
 public:
  RowTiles(const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t k)
      : x_(x), ldx_(ldx), k_(k), full_(m - m % 16), tail_(m % 16 ? 16 * k : 0) {
    for (int64_t r = full_; r < m; ++r)
      std::memcpy(tail_.data() + (r - full_) * k, x + r * ldx, k * sizeof(c10::BFloat16));
  }

  // Rows [r, r + 16) (r a multiple of 16); stride: bytes between them.
  const c10::BFloat16* at(int64_t r, int64_t& stride) const {
    stride = r < full_ ? ldx_ * 2 : k_ * 2;
    return r < full_ ? x_ + r * ldx_ : tail_.data();
  }

 private:
  const c10::BFloat16* x_;
  int64_t ldx_, k_, full_;
  std::vector<c10::BFloat16> tail_;
};

// rows rows of a panel's float32 product (32 columns a row) stored as bfloat16 (or float32)
// rows ldo apart, with the panel's 32 bias values (or none) added; silu_mul: 16 gate and 16
// up columns become 16 of silu(gate) * up.
template <typename O>
void store_product(const float* acc, int64_t rows, const c10::BFloat16* bias, bool silu_mul,
                   O* out, int64_t ldo) {
  __m512 bias_lo = _mm512_setzero_ps(), bias_hi = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias_lo = bf16x16_load(bias);
    bias_hi = bf16x16_load(bias + 16);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 lo = _mm512_loadu_ps(acc + i * 32), hi = _mm512_loadu_ps(acc + i * 32 + 16);
    if (silu_mul)
      store_panel_row<true>(out + i * ldo, lo, hi, bias_lo, bias_hi);
    else
      store_panel_row<false>(out + i * ldo, lo, hi, bias_lo, bias_hi);
  }
}

}  // namespace

bool amx_bf16_ready() { return amx_permitted(); }

// gemm_on_panels (gemm_tiles.h) on AMX tiles: each thread dequantizes its panels into the
// packed layout, which is the tiles' B operand as it lies, and runs each row block of x (as
// many rows as stay in L2) over them. Two panels at a time: while a row block runs over one,
// the next is dequantized into the other, a part after some of its k-steps, so that the
// vector units work as the tiles do. A thread with one panel dequantizes it once; with
// several, once per row block.
void gemm_on_panels_amx(at::Tensor& out, const at::Tensor& x, int64_t n,
                        const c10::optional<at::Tensor>& bias, const PanelParts& dequantize,
                        int64_t parts, bool silu_mul) {
  TORCH_CHECK(amx_permitted(), "gemm_on_panels_amx: the OS gives this process no AMX tiles");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "gemm_on_panels_amx: K must be a multiple of 32 (the tile depth)");
  if (m == 0) return;
  const RowTiles tiles(x.data_ptr<c10::BFloat16>(), x.stride(0), m, k);
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t ldo = out.stride(0), width = silu_mul ? 16 : 32;
  const int64_t max_rows = std::max<int64_t>(32, kAmxBlockBytes / (2 * k) / 32 * 32);
  const int64_t num_blocks = (m + max_rows - 1) / max_rows;
  const int64_t block_rows = ((m + num_blocks - 1) / num_blocks + 31) / 32 * 32;
  with_out_type(out, "gemm_on_panels_amx", [&](auto o) {
    auto* op = out.data_ptr<decltype(o)>();
    at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
      load_tile_config();
      thread_local std::vector<int32_t> buffer;  // two panels [k / 2][32] of pairs, kept
      if (static_cast<int64_t>(buffer.size()) < 32 * k) buffer.resize(32 * k);
      int32_t* panels[2] = {buffer.data(), buffer.data() + 16 * k};
      const int64_t count = end - begin, items = num_blocks * count;  // (row block, panel)
      dequantize(begin, panels[0], 0, parts);
      alignas(64) float acc[32 * 32];
      for (int64_t item = 0; item < items; ++item) {
        const int64_t p = begin + item % count, r0 = item / count * block_rows;
        const int64_t r1 = std::min(m, r0 + block_rows);
        const auto* pp = reinterpret_cast<const c10::BFloat16*>(panels[item % 2 * (count > 1)]);
        int32_t* next = panels[(item + 1) % 2];
        const int64_t calls = (r1 - r0 + 31) / 32 * (k / 32);  // k-steps this item takes
        int64_t call = 0, done = item + 1 < items && count > 1 ? 0 : parts;
        auto work = [&]() {
          const int64_t target = (++call * parts + calls - 1) / calls;
          if (target > done) {
            dequantize(begin + (item + 1) % count, next, done, target);
            done = target;
          }
        };
        for (int64_t r = r0; r < r1; r += 32) {
          const int64_t rows = std::min<int64_t>(32, r1 - r);
          int64_t lda0 = 0, lda1 = 0;
          const c10::BFloat16* a0 = tiles.at(r, lda0);
          if (rows > 16) {
            const c10::BFloat16* a1 = tiles.at(r + 16, lda1);
            amx_panel<true>(a0, lda0, a1, lda1, pp, k / 2, nullptr, 0, 0, acc, false, work);
          } else {
            amx_panel<false>(a0, lda0, nullptr, 0, pp, k / 2, nullptr, 0, 0, acc, false, work);
          }
          store_product(acc, rows, bp != nullptr ? bp + 32 * p : nullptr, silu_mul,
                        op + r * ldo + width * p, ldo);
        }
      }
      release_tiles();
    });
  });
}

namespace {
// gemm_bf16_amx for out of type O (bfloat16, or float32 logits).
template <typename O>
void gemm_bf16_amx_as(at::Tensor& out, const at::Tensor& x, const at::Tensor& panels,
                      const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() && panels.is_contiguous() &&
              panels.dim() == 4 && panels.size(2) == 32 && panels.size(3) == 2,
              "gemm_bf16_amx: rows of x, packed panels [N/32, K/2, 32, 2]");
  const int64_t m = x.size(0), k2 = panels.size(1), k = 2 * k2, n = panels.size(0) * 32;
  const int64_t width = silu_mul ? n / 2 : n, panel_width = silu_mul ? 16 : 32;
  TORCH_CHECK(x.size(1) == k && k % 32 == 0 && out.size(0) == m && out.size(1) == width,
              "gemm_bf16_amx: shapes do not match (K must be a multiple of 32)");
  if (m == 0) return;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = panels.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  O* op = out.data_ptr<O>();
  const int64_t ldx = x.stride(0), panel_size = k2 * 64, num_panels = n / 32;
  const RowTiles tiles(xp, ldx, m, k);
  auto row_tile = [&](int64_t r, int64_t& stride) { return tiles.at(r, stride); };
  auto store_rows = [&](const float* acc, int64_t rows, int64_t p, O* o) {
    store_product(acc, rows, bp != nullptr ? bp + p * 32 : nullptr, silu_mul, o, width);
  };
  // The 32-row tiles of rows [r0, r1) over k pairs [kc, kc + depth) of a panel (panel: at
  // pair kc): tile r's float32 product goes to acc_of(r), added to what it holds if
  // accumulate, then done(r, rows, acc) runs. The tiles share the prefetch of next (the
  // panel a thread takes next, at the same pairs), each its share of every k-step's lines.
  auto run_rows = [&](int64_t r0, int64_t r1, const c10::BFloat16* panel, int64_t kc,
                      int64_t depth, const char* next, bool accumulate, auto&& acc_of,
                      auto&& done) {
    const int64_t tiles = (r1 - r0 + 31) / 32;
    const int share = static_cast<int>((32 + tiles - 1) / tiles);
    for (int64_t r = r0; r < r1; r += 32) {
      const int64_t rows = std::min<int64_t>(32, r1 - r);
      float* acc = acc_of(r);
      int64_t lda0 = 0, lda1 = 0;
      const c10::BFloat16* a0 = row_tile(r, lda0) + 2 * kc;
      const int line0 = std::min<int>(32, static_cast<int>((r - r0) / 32) * share);
      const int line1 = std::min<int>(32, line0 + share);
      const char* prefetch = line0 < line1 ? next : nullptr;
      if (rows > 16) {
        const c10::BFloat16* a1 = row_tile(r + 16, lda1) + 2 * kc;
        amx_panel<true>(a0, lda0, a1, lda1, panel, depth, prefetch, line0, line1, acc,
                        accumulate);
      } else {
        amx_panel<false>(a0, lda0, nullptr, 0, panel, depth, prefetch, line0, line1, acc,
                         accumulate);
      }
      done(r, rows, acc);
    }
  };
  if (k > kAmxDeepK && m > 32 && num_panels >= 4 * at::get_num_threads()) {
    // A deep K (a down projection of a large MLP): a panel is too big to be reused by enough
    // rows that share L2 with it. K is cut into slices of kAmxSliceK: each thread runs a
    // block of rows' slice of x (in L2) over each of its panels' slices, adding into float32
    // accumulators of its panels' columns, and stores them after the last slice.
    const int64_t slice2 = kAmxSliceK / 2;
    const int64_t rows_per_block = std::max<int64_t>(32, kAmxBlockBytes / (2 * kAmxSliceK));
    const int64_t blocks = (m + rows_per_block - 1) / rows_per_block;
    const int64_t block_rows = ((m + blocks - 1) / blocks + 31) / 32 * 32;
    at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
      load_tile_config();
      std::vector<float> accs((end - begin) * block_rows * 32);
      for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
        const int64_t r1 = std::min(m, r0 + block_rows);
        for (int64_t kc = 0; kc < k2; kc += slice2) {
          const int64_t depth = std::min(slice2, k2 - kc);
          for (int64_t p = begin; p < end; ++p) {
            const c10::BFloat16* panel = wp + p * panel_size + kc * 64;
            const char* next = p + 1 < end
                ? reinterpret_cast<const char*>(panel + panel_size) : nullptr;
            float* panel_acc = accs.data() + (p - begin) * block_rows * 32;
            run_rows(r0, r1, panel, kc, depth, next, kc > 0,
                     [&](int64_t r) { return panel_acc + (r - r0) * 32; },
                     [](int64_t, int64_t, const float*) {});
          }
        }
        for (int64_t p = begin; p < end; ++p)
          store_rows(accs.data() + (p - begin) * block_rows * 32, r1 - r0, p,
                     op + r0 * width + p * panel_width);
      }
      release_tiles();
    });
    return;
  }
  // Row blocks of equal size (a multiple of 32), each at most what L2 keeps: the threads
  // split the (block, panel) items by count, so a short last block would leave one idle.
  const int64_t max_rows = std::max<int64_t>(32, kAmxBlockBytes / (2 * k) / 32 * 32);
  const int64_t num_blocks = (m + max_rows - 1) / max_rows;
  const int64_t block_rows = ((m + num_blocks - 1) / num_blocks + 31) / 32 * 32;
  at::parallel_for(0, num_blocks * num_panels, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) float acc[32 * 32];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = item / num_panels * block_rows, p = item % num_panels;
      const int64_t r1 = std::min(m, r0 + block_rows);
      const c10::BFloat16* panel = wp + p * panel_size;
      const char* next = item + 1 < end && p + 1 < num_panels
          ? reinterpret_cast<const char*>(panel + panel_size) : nullptr;
      run_rows(r0, r1, panel, 0, k2, next, false, [&](int64_t) { return acc; },
               [&](int64_t r, int64_t rows, const float* product) {
                 store_rows(product, rows, p, op + r * width + p * panel_width);
               });
    }
    release_tiles();
  });
}
}  // namespace

// gemm_bf16's product on AMX tiles: the same panels, bias and silu_mul, for any number of
// rows; K (twice the panels' second size) must be a multiple of 32.
void gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias,
                   bool silu_mul) {
  TORCH_CHECK(amx_permitted(), "gemm_bf16_amx: the OS gives this process no AMX tiles");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16,
              "gemm_bf16_amx: bfloat16 x and panels expected");
  with_out_type(out, "gemm_bf16_amx", [&](auto o) {
    gemm_bf16_amx_as<decltype(o)>(out, x, panels, bias, silu_mul);
  });
}

#endif

}  // namespace cpullm
