// The Python module of the kernels: one entry per kernel in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL: the server's threads go on while a step computes,
  // and two threads may run kernels at once.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  // the instruction sets it was compiled for, as the library levels name them
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  m.attr("isa") = "avx512_bf16";
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.attr("isa") = "avx512";
#elif defined(__AVX2__)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "generic";
#endif
  m.def("decode_attention", &cpullm::decode_attention,
        "paged attention, one query per sequence", nogil);
  m.def("cache_kv_quant", &cpullm::cache_kv_quant,
        "write a step's keys and values into a quantized cache (int8 or fp8)", nogil);
  m.def("decode_attention_quant", &cpullm::decode_attention_quant,
        "decode_attention on a quantized cache, its bytes read in place", nogil);
  m.def("bind_threads", &cpullm::bind_threads, "pin intra-op threads, one per CPU", nogil);
#if defined(__AVX512BF16__)
  m.def("rms_norm_bf16", &cpullm::rms_norm_bf16,
        "bfloat16 RMSNorm, optionally fused with the residual add", nogil);
  m.def("silu_and_mul_bf16", &cpullm::silu_and_mul_bf16, "bfloat16 silu(gate) * up", nogil);
  m.def("gemm_bf16", &cpullm::gemm_bf16, "bfloat16 x @ w.T with w packed in 32-column panels, "
        "optionally silu(gate) * up of interleaved gate and up panels", nogil);
  m.def("gemm_bf16_grouped", &cpullm::gemm_bf16_grouped,
        "gemm_bf16 for several packed weights, each on its own run of rows, in one call", nogil);
  m.def("embedding_from_panels", &cpullm::embedding_from_panels,
        "rows of a table packed as gemm_bf16's panels (an embedding tied to the LM head)", nogil);
  m.def("amx_bf16_ready", &cpullm::amx_bf16_ready,
        "whether this process may use AMX tiles (asks the OS once); only where the CPU has them",
        nogil);
  m.def("decode_attention_amx", &cpullm::decode_attention_amx,
        "decode_attention with the scores on AMX tiles; only where amx_bf16_ready()", nogil);
  m.def("gemm_bf16_amx", &cpullm::gemm_bf16_amx,
        "gemm_bf16 on AMX tiles, on the same packed panels; K a multiple of 32", nogil);
  m.def("prefill_softmax_bf16", &cpullm::prefill_softmax_bf16,
        "causal softmax of prompt-chunk attention scores, in place", nogil);
  m.def("prefill_attention_bf16", &cpullm::prefill_attention_bf16,
        "causal attention of prompt chunks on the paged bfloat16 caches, fused", nogil);
  m.def("prefill_attention_quant", &cpullm::prefill_attention_quant,
        "prefill_attention_bf16 on a quantized cache (int8, fp8)", nogil);
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  m.def("quant_gemm_tiled_int8", &cpullm::quant_gemm_tiled_int8,
        "x @ w.T with w kept quantized in 16-row tiles, on int8 dot products of x quantized "
        "per block", nogil);
  m.def("quant_gemm_tiled_grouped", &cpullm::quant_gemm_tiled_grouped,
        "quant_gemm_tiled_int8 for several tiled weights of one layout, each on its own run "
        "of rows, in one call", nogil);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  m.def("quant_gemm_tiled_bf16", &cpullm::quant_gemm_tiled_bf16,
        "x @ w.T with w kept quantized in 16-row tiles, dequantized into the bf16 GEMM's panels",
        nogil);
  m.def("quant_gemm_tiled_amx", &cpullm::quant_gemm_tiled_amx,
        "x @ w.T with w kept quantized in 16-row tiles, dequantized into AMX tiles' panels "
        "(K a multiple of 32); only where amx_bf16_ready()", nogil);
  m.def("quant_gemm_int8_amx", &cpullm::quant_gemm_int8_amx,
        "x @ w.T for per-channel INT8 weights laid out as AMX-INT8 tiles, x quantized per "
        "token; only where amx_bf16_ready()", nogil);
#endif
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
  m.def("fp8_gemm_bf16", &cpullm::fp8_gemm_bf16,
        "x @ w.T with w kept in FP8 (e4m3), dequantized 32 rows at a time into the bf16 GEMM",
        nogil);
  m.def("fp8_gemm_bf16_amx", &cpullm::fp8_gemm_bf16_amx,
        "fp8_gemm_bf16's panels on AMX tiles (K a multiple of 32); only where amx_bf16_ready()",
        nogil);
#endif
  m.def("rotary_embedding", &cpullm::rotary_embedding,
        "rotate-half rotary embedding, in place", nogil);
  m.def("cache_kv", &cpullm::cache_kv,
        "write a step's keys and values into their cache slots", nogil);
#if defined(__AVX512F__)
  m.def("sample_from_logits", &cpullm::sample_from_logits,
        "one inverse-CDF draw per row of logits", nogil);
#endif
}
