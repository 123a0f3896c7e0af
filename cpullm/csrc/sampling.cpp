// The sampler's fused inverse-CDF draw.
#include "ops.h"
#include "vec.h"

#include <utility>
#include <vector>

namespace cpullm {

#if defined(__AVX512F__)
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return bf16x16_load(p); }

// One draw per row from softmax(logits[r] / temperature[r]): the first token whose
// cumulative weight exceeds uniform[r] times the total (inverse-CDF sampling, as
// searchsorted over a cumulative sum does it, without materializing either).
template <typename T>
void draw_rows(const T* lp, int64_t stride, int64_t rows, int64_t vocab, const float* tp,
               const float* up, int64_t* out) {
  // Weights are summed per span of 256 tokens in a vector (one horizontal sum a span, not
  // one per 16 tokens); the scan skips whole spans, then walks the one it lands in.
  constexpr int64_t kSpan = 256;
  const int64_t chunks = vocab / 16;  // full 16-wide chunks; the tail is scalar
  const int64_t spans = (chunks * 16 + kSpan - 1) / kSpan;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab), span_sums(spans + 1);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = lp + r * stride;
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < chunks; ++c) vmax = _mm512_max_ps(vmax, load16(x + 16 * c));
      float mx = _mm512_reduce_max_ps(vmax);
      for (int64_t i = chunks * 16; i < vocab; ++i) mx = std::max(mx, to_f(x[i]));
      const float inv_t = 1.f / tp[r];
      const __m512 vm = _mm512_set1_ps(mx), vinv = _mm512_set1_ps(inv_t);
      const __m512 vninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      // weights and per-span sums; the total is the sum of the span sums, in order, so
      // the scan below reaches it exactly where it skips whole spans.
      float total = 0.f;
      for (int64_t sp = 0; sp < spans; ++sp) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = sp * kSpan / 16; c < std::min(chunks, (sp + 1) * kSpan / 16); ++c) {
          const __m512 xv = load16(x + 16 * c);
          // exp16 clamps its input, so masked tokens (-inf) are zeroed explicitly.
          const __m512 e = _mm512_maskz_mov_ps(
              _mm512_cmp_ps_mask(xv, vninf, _CMP_NEQ_UQ),
              exp16(_mm512_mul_ps(_mm512_sub_ps(xv, vm), vinv)));
          _mm512_storeu_ps(weights.data() + 16 * c, e);
          sum = _mm512_add_ps(sum, e);
        }
        span_sums[sp] = _mm512_reduce_add_ps(sum);
        total += span_sums[sp];
      }
      float tail = 0.f;
      for (int64_t i = chunks * 16; i < vocab; ++i) {
        weights[i] = std::exp((to_f(x[i]) - mx) * inv_t);
        tail += weights[i];
      }
      span_sums[spans] = tail;
      total += tail;
      const float target = up[r] * total;
      int64_t token = -1, last_span = 0;
      float running = 0.f;
      const auto span_range = [&](int64_t sp) {  // [lo, hi) of span sp; the tail is the last
        const int64_t lo = sp < spans ? sp * kSpan : chunks * 16;
        return std::pair<int64_t, int64_t>{lo, sp < spans ? std::min(chunks * 16, lo + kSpan)
                                                           : vocab};
      };
      for (int64_t sp = 0; sp <= spans && token < 0; ++sp) {
        if (span_sums[sp] <= 0.f) continue;
        last_span = sp;
        if (running + span_sums[sp] <= target && sp < spans) {
          running += span_sums[sp];
          continue;
        }
        const auto [lo, hi] = span_range(sp);
        for (int64_t i = lo; i < hi; ++i) {
          running += weights[i];
          if (weights[i] > 0.f && running > target) { token = i; break; }
        }
      }
      // Rounding can leave the scan just short: the last token with any weight is then the
      // draw.
      if (token < 0) {
        const auto [lo, hi] = span_range(last_span);
        for (int64_t i = hi - 1; i >= lo && token < 0; --i)
          if (weights[i] > 0.f) token = i;
      }
      out[r] = std::max<int64_t>(token, 0);
    }
  });
}

}  // namespace

// logits: [rows, vocab] float32 or bfloat16 (widened as read: the same draws as from
// their float32 copy); temperature, uniform: [rows] float32; returns [rows] int64.
at::Tensor sample_from_logits(at::Tensor logits, at::Tensor temperature, at::Tensor uniform) {
  TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
              temperature.scalar_type() == at::kFloat && uniform.scalar_type() == at::kFloat &&
              logits.stride(1) == 1 && temperature.is_contiguous() && uniform.is_contiguous(),
              "sample_from_logits: float32 or bfloat16 rows expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor tokens = at::empty({rows}, at::kLong);
  const float* tp = temperature.data_ptr<float>();
  const float* up = uniform.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat)
    draw_rows(logits.data_ptr<float>(), stride, rows, vocab, tp, up, out);
  else
    draw_rows(logits.data_ptr<c10::BFloat16>(), stride, rows, vocab, tp, up, out);
  return tokens;
}
#endif

}  // namespace cpullm
