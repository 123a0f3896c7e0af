// The kernels cpullm's Python side calls (bound in bindings.cpp), one file per family:
// attention/, gemm.cpp, gemm_amx.cpp, quant/ (kept-quantized weights), fp8_gemm.cpp,
// pointwise.cpp (rotary, RMSNorm, SiLU-mul), sampling.cpp, threads.cpp. Kernels that need an
// instruction set exist only where it is compiled in.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace cpullm {

// attention/decode.cpp
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                      at::Tensor block_tables, at::Tensor seq_lens, double scale,
                      int64_t window, double softcap, c10::optional<at::Tensor> sinks);
#if defined(__AVX512BF16__)
void prefill_softmax_bf16(at::Tensor scores, at::Tensor starts, at::Tensor query_lens,
                          int64_t num_kv_heads, int64_t max_q, double scale, int64_t window,
                          double softcap, c10::optional<at::Tensor> sinks);
void prefill_attention_bf16(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_tables, at::Tensor starts,
                            at::Tensor query_lens, double scale, int64_t window);
void prefill_attention_quant(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                             at::Tensor value_cache, c10::optional<at::Tensor> key_scales,
                             c10::optional<at::Tensor> value_scales, double k_scale,
                             double v_scale, at::Tensor block_tables, at::Tensor starts,
                             at::Tensor query_lens, double scale, int64_t window);
#endif

// attention/kv_quant.cpp: the quantized KV cache (int8 rows with float16 scales [slots or
// blocks x block_size, kv_heads], or fp8 with one K and one V scale): the store, and
// decode_attention on it
void cache_kv_quant(at::Tensor key_cache, at::Tensor value_cache,
                    c10::optional<at::Tensor> key_scales, c10::optional<at::Tensor> value_scales,
                    at::Tensor k, at::Tensor v, at::Tensor slots, double k_scale, double v_scale);
void decode_attention_quant(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                            at::Tensor value_cache, c10::optional<at::Tensor> key_scales,
                            c10::optional<at::Tensor> value_scales, double k_scale,
                            double v_scale, at::Tensor block_tables, at::Tensor seq_lens,
                            double scale, int64_t window, double softcap,
                            c10::optional<at::Tensor> sinks);

// pointwise.cpp
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin);
void cache_kv(at::Tensor key_cache, at::Tensor value_cache, at::Tensor k, at::Tensor v,
              at::Tensor slots);
#if defined(__AVX512BF16__)
void rms_norm_bf16(at::Tensor out, at::Tensor x, c10::optional<at::Tensor> residual,
                   at::Tensor weight, double eps);
void silu_and_mul_bf16(at::Tensor out, at::Tensor x);

// gemm.cpp
void gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias,
               bool silu_mul);
void gemm_bf16_grouped(at::Tensor out, at::Tensor x, std::vector<at::Tensor> panels,
                       std::vector<int64_t> offsets, bool silu_mul);
void embedding_from_panels(at::Tensor out, at::Tensor ids, at::Tensor panels);

// gemm_amx.cpp: the same GEMM on AMX tiles (compiled for them, run only where the CPU has
// them: ask amx_bf16_ready() first)
bool amx_bf16_ready();
void gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias,
                   bool silu_mul);
// attention/decode.cpp: decode_attention with its scores on AMX tiles (as above, where
// amx_bf16_ready())
void decode_attention_amx(at::Tensor out, at::Tensor q, at::Tensor key_cache,
                          at::Tensor value_cache, at::Tensor block_tables, at::Tensor seq_lens,
                          double scale, int64_t window, double softcap,
                          c10::optional<at::Tensor> sinks);
#endif

// quant/: x @ W.T with W kept quantized (u, scales, mins or a zero point). out is bfloat16,
// or float32 for an LM head's logits, where the int8 dot products (quant_gemm_tiled_int8)
// quantize x in two levels and every kernel but the grouped one and quant_gemm_int8_amx
// stores its float32 sums unrounded; so do gemm_bf16 and gemm_bf16_amx.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Blocks laid out in 16-row tiles (data [n / 16, k * 2 bits], scales and mins
// [n / 16, blocks, 16], K a multiple of 32): int8 dot products of x quantized per block, for
// one weight, and for several of one shape (weight i over rows [offsets[i], offsets[i + 1])
// of x, a mixture's experts); on AVX-512 VNNI, or on AVX2's int8 multiply-adds. silu_mul
// (here and below; not on AVX2): W is gate and up stacked, and out [m, n / 2] gets
// silu(gate) * up.
void quant_gemm_tiled_int8(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                           c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                           int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul);
void quant_gemm_tiled_grouped(at::Tensor out, at::Tensor x, std::vector<at::Tensor> data,
                              std::vector<at::Tensor> scales, std::vector<at::Tensor> mins,
                              std::vector<at::Tensor> biases, std::vector<int64_t> offsets,
                              int64_t bits, int64_t block, int64_t zero);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// the 16-row tiles dequantized into the AVX-512 GEMM's panels or the AMX GEMM's (where
// amx_bf16_ready())
void quant_gemm_tiled_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                           c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                           int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul);
void quant_gemm_tiled_amx(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                          c10::optional<at::Tensor> mins, int64_t bits, int64_t block,
                          int64_t zero, c10::optional<at::Tensor> bias, bool silu_mul);
// per-channel INT8 laid out as AMX-INT8 tiles [n / 16, k / 64, 16, 64] (u = q + 128) with
// a float32 scale per row, by x quantized per token, on the tiles (where amx_bf16_ready())
void quant_gemm_int8_amx(at::Tensor out, at::Tensor x, at::Tensor tiles, at::Tensor row_scales,
                         c10::optional<at::Tensor> bias, bool silu_mul);
#endif

// fp8_gemm.cpp: x @ W.T with W kept in FP8 (e4m3 bytes, a float32 scale per row and block)
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
void fp8_gemm_bf16(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                   int64_t block, c10::optional<at::Tensor> bias, bool dot);
// its panels on AMX tiles (K a multiple of 32; where amx_bf16_ready())
void fp8_gemm_bf16_amx(at::Tensor out, at::Tensor x, at::Tensor data, at::Tensor scales,
                       int64_t block, c10::optional<at::Tensor> bias);
#endif

// sampling.cpp
#if defined(__AVX512F__)
at::Tensor sample_from_logits(at::Tensor logits, at::Tensor temperature, at::Tensor uniform);
#endif

// threads.cpp
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus);

}  // namespace cpullm
