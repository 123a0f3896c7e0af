// Rotary embedding, bfloat16 RMSNorm (fused with the residual add), SiLU-mul, and the
// write of a step's keys and values into the KV cache.
#include "ops.h"
#include "vec.h"

#include <cstring>
#include <vector>

namespace cpullm {

namespace {

// In place, rotate-half layout: x = x * cos + rotate_half(x) * sin, per head, over the
// first rotary_dim values of each head (the rest pass through). cos/sin: [max_position,
// rotary_dim] float32; x: [num_tokens, num_heads, head_dim].
// Rotates one head's first rotary_dim values; c and s are the token's table rows.
template <typename T>
inline void rotate_head(T* v, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
    // Products rounded as the unfused ops round them, then added.
    const T a = static_cast<T>(x1 * to_f(static_cast<T>(c[i])));
    const T b = static_cast<T>(-x2 * to_f(static_cast<T>(s[i])));
    const T e = static_cast<T>(x2 * to_f(static_cast<T>(c[i + half])));
    const T f = static_cast<T>(x1 * to_f(static_cast<T>(s[i + half])));
    v[i] = static_cast<T>(to_f(a) + to_f(b));
    v[i + half] = static_cast<T>(to_f(e) + to_f(f));
  }
}

#if defined(__AVX512BF16__)
// The same in 16 lanes for bfloat16, rounding at the same places (-round(p) is
// round(-p) under round-to-nearest-even, so the negated product is subtracted).
template <>
inline void rotate_head<c10::BFloat16>(c10::BFloat16* v, const float* c, const float* s,
                                       int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (half - i)) - 1);
    const auto load = [m](const c10::BFloat16* p) {
      const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    };
    const auto table = [m](const float* p) { return bf16_round(_mm512_maskz_loadu_ps(m, p)); };
    const auto store = [m](c10::BFloat16* p, __m512 x) {
      _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
    };
    const __m512 x1 = load(v + i), x2 = load(v + i + half);
    const __m512 a = bf16_round(_mm512_mul_ps(x1, table(c + i)));
    const __m512 b = bf16_round(_mm512_mul_ps(x2, table(s + i)));
    const __m512 e = bf16_round(_mm512_mul_ps(x2, table(c + i + half)));
    const __m512 f = bf16_round(_mm512_mul_ps(x1, table(s + i + half)));
    store(v + i, _mm512_sub_ps(a, b));
    store(v + i + half, _mm512_add_ps(e, f));
  }
}
#endif

// In place, rotate-half layout: x = x * cos + rotate_half(x) * sin, per head, over the
// first rotary_dim values of each head (the rest pass through), for q and k of each token
// in one parallel region. cos/sin: [max_position, rotary_dim] float32; q, k: [num_tokens,
// heads, head_dim].
template <typename T>
void rotary_both(T* q, T* k, int64_t q_stride, int64_t k_stride, int64_t q_heads,
                 int64_t k_heads, int64_t head_dim, const int64_t* positions, const float* cos,
                 const float* sin, int64_t tokens, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, grain_for((q_heads + k_heads) * head_dim),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * rotary_dim;
      const float* s = sin + positions[t] * rotary_dim;
      for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + t * q_stride + h * head_dim, c, s, half);
      for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + t * k_stride + h * head_dim, c, s, half);
    }
  });
}

}  // namespace

void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin) {
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2),
                "rotary_embedding: heads must be contiguous within a token");
  TORCH_CHECK(positions.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: contiguous tables expected");
  const int64_t rotary_dim = cos.size(1);
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= q.size(2) && sin.sizes() == cos.sizes(),
              "rotary_embedding: tables of an even width up to the head size expected");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.size(0) == q.size(0) &&
              k.size(2) == q.size(2) && positions.numel() == q.size(0),
              "rotary_embedding: q and k of the same tokens, dtype and head size expected");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotary_both<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), q.stride(0),
                          k.stride(0), q.size(1), k.size(1), q.size(2),
                          positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), q.size(0), rotary_dim);
  });
}


#if defined(__AVX512BF16__)

// bfloat16 RMSNorm: with a residual, residual = x + residual and x = norm(residual) * w,
// in place; without, out = norm(x) * w. Rounds where the unfused torch ops round.
void rms_norm_bf16(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual,
                   at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && out.is_contiguous() &&
              weight.is_contiguous(), "rms_norm_bf16: contiguous bfloat16 tensors expected");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(dim % 16 == 0, "rms_norm_bf16: hidden size must be a multiple of 16");
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  c10::BFloat16* rp = residual.has_value() ? residual->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, grain_for(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      __m512 sq = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        __m512 v = bf16x16_load(xp + r * dim + d);
        if (rp != nullptr) {
          v = bf16_round(_mm512_add_ps(v, bf16x16_load(rp + r * dim + d)));
          bf16x16_store(rp + r * dim + d, v);
        }
        _mm512_storeu_ps(buf.data() + d, v);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(dim) +
                                        static_cast<float>(eps));
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 normed = bf16_round(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + d), vinv));
        bf16x16_store(op + r * dim + d, _mm512_mul_ps(bf16x16_load(wp + d), normed));
      }
    }
  });
}

// bfloat16 out[r, :d] = silu(x[r, :d]) * x[r, d:], rounding like silu() then mul.
void silu_and_mul_bf16(at::Tensor out, at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && out.is_contiguous(),
              "silu_and_mul_bf16: contiguous bfloat16 tensors expected");
  const int64_t d = out.size(-1), rows = out.numel() / d;
  TORCH_CHECK(d % 16 == 0, "silu_and_mul_bf16: width must be a multiple of 16");
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, grain_for(3 * d), [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 g = bf16x16_load(xp + r * 2 * d + i);
        const __m512 u = bf16x16_load(xp + r * 2 * d + d + i);
        const __m512 act = bf16_round(
            _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        bf16x16_store(op + r * d + i, _mm512_mul_ps(act, u));
      }
    }
  });
}
#endif

// key_cache[slots[t]] = k[t], value_cache[slots[t]] = v[t] for each token t of the step:
// one call for both, in place of two index_copy_ calls per layer (each a TensorIterator
// set up for a few hundred rows). The caches are [slots, kv_heads, head_dim] views of the
// blocks; k and v are rows of kv_heads * head_dim contiguous values (views into the fused
// QKV output).
void cache_kv(at::Tensor key_cache, at::Tensor value_cache, at::Tensor k, at::Tensor v,
              at::Tensor slots) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 3 &&
              slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "cache_kv: contiguous caches [slots, kv_heads, head_dim], int64 slots");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == slots.numel() &&
              k.size(1) == key_cache.size(1) && k.size(2) == key_cache.size(2) &&
              k.scalar_type() == key_cache.scalar_type() &&
              v.scalar_type() == key_cache.scalar_type() && k.stride(2) == 1 &&
              v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "cache_kv: k and v must be [tokens, kv_heads, head_dim] rows of the cache's "
              "dtype");
  const int64_t tokens = k.size(0), num_slots = key_cache.size(0);
  const int64_t width = k.size(1) * k.size(2), item = k.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "cache_kv: slot ", sp[t], " out of range");
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t row = width * item, ks = k.stride(0) * item, vs = v.stride(0) * item;
  at::parallel_for(0, tokens, grain_for(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * ks, row);
      std::memcpy(vc + sp[t] * row, vp + t * vs, row);
    }
  });
}

}  // namespace cpullm
