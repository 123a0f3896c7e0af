"""``cpullm bench gemm``: the bfloat16 GEMMs of one decoder layer, on every path this CPU
runs, and the peak they reach.

For a model's layer shapes (fused QKV, output projection, fused gate-up, down projection;
the default model's when none is named) it times each GEMM path the engine can pick here
(AVX-512 BF16 dot products, AMX tiles, oneDNN's matmul on its own blocked copy) at several
row counts, on the threads the engine would use, and prints GMAC/s (multiply-adds per
second). The highest figure at the largest row count is the bf16 GEMM peak that the prompt
step is compared against (``--prompt-tokens``: one prompt step of that many tokens through
the real engine, as a fraction of that peak).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_ROWS = (1, 16, 128, 4096)


def add_gemm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model whose decoder-layer shapes to time (default: the default "
                        "model)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(_ROWS),
                        help="rows of x (tokens in a step) to time")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per case (median)")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="also run one prompt step of this many tokens through the "
                        "engine and report its multiply-adds per second against the peak")
    parser.add_argument("--output-json", default=None, help="write the figures here")


def layer_shapes(config: Any) -> list[tuple[str, int, int]]:
    """(name, output size, input size) of the dense GEMMs of one Llama-like decoder layer."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
            ("o", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter)]


def gemm_paths(ops: Any, weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], Any]]:
    """Each path this CPU and build run for ``weight`` [n, k], as a call on x."""
    from cpullm.model_executor.layers.packed_gemm import panels_of

    n, k = weight.shape
    paths: dict[str, Callable[[torch.Tensor], Any]] = {}
    panels = None
    if ops is not None and ops.gemm_bf16 is not None and n % 32 == 0 and k % 2 == 0:
        panels = panels_of(weight)

        def avx512(x: torch.Tensor) -> None:
            ops.gemm_bf16(x.new_empty(x.shape[0], n), x, panels, None, False)

        paths["avx512_bf16"] = avx512
        if ops.gemm_bf16_amx is not None and k % 32 == 0:
            def amx(x: torch.Tensor) -> None:
                ops.gemm_bf16_amx(x.new_empty(x.shape[0], n), x, panels, None, False)

            paths["amx"] = amx
    if torch.backends.mkldnn.is_available():
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, 128)
        paths["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, blocked, None, "none", [], "")
    return paths


def _median_seconds(call: Callable[[], Any], iters: int) -> float:
    call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_layer(ops: Any, shapes: list[tuple[str, int, int]], rows: list[int],
               iters: int) -> dict[str, dict[int, float]]:
    """GMAC/s of the whole layer's GEMMs, per path and row count (paths every shape has)."""
    torch.manual_seed(0)
    weights = [torch.randn(n, k).mul_(k ** -0.5).to(torch.bfloat16) for _, n, k in shapes]
    per_shape = [gemm_paths(ops, w) for w in weights]
    names = [p for p in per_shape[0] if all(p in paths for paths in per_shape)]
    result: dict[str, dict[int, float]] = {name: {} for name in names}
    for m in rows:
        xs = [torch.randn(m, k).to(torch.bfloat16) for _, _, k in shapes]
        macs = sum(m * n * k for _, n, k in shapes)
        for name in names:
            seconds = sum(_median_seconds(lambda p=paths[name], x=x: p(x), iters)
                          for paths, x in zip(per_shape, xs, strict=True))
            result[name][m] = macs / seconds / 1e9
    return result


def prompt_step(model: str | None, tokens: int, config: Any) -> float:
    """Multiply-adds per second of one prompt step of ``tokens`` tokens (prompts of 128)
    through the engine, counting the decoder layers' GEMMs and one LM-head row per prompt."""
    from cpullm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", max_num_batched_tokens=max(tokens, 2048))
    prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 30000 for j in range(128)]}
               for i in range(tokens // 128)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    per_token = sum(n * k for _, n, k in layer_shapes(config)) * config.num_hidden_layers
    macs = per_token * len(prompts) * 128 + config.hidden_size * config.vocab_size * len(prompts)
    return macs / seconds / 1e9


def run_gemm(args: argparse.Namespace) -> dict[str, Any]:
    from cpullm.model_executor.layers.ops import load_ops
    from cpullm.platform import cpu_info
    from cpullm.transformers_utils import load_hf_config, resolve_model

    config = load_hf_config(resolve_model(args.model))
    shapes = layer_shapes(config)
    ops = load_ops()
    info = cpu_info()
    print(f"CPU: {info.model_name}; threads: {torch.get_num_threads()}; "
          f"AMX: {'yes' if 'amx_bf16' in info.flags else 'no'}")
    print("layer: " + ", ".join(f"{name} {n}x{k}" for name, n, k in shapes))
    figures = time_layer(ops, shapes, args.rows, args.iters)
    print(f"{'rows':>6} " + " ".join(f"{name:>12}" for name in figures) + "   (GMAC/s)")
    for m in args.rows:
        print(f"{m:>6} " + " ".join(f"{figures[name][m]:>12.0f}" for name in figures))
    top = max(args.rows)
    peak = max(figures[name][top] for name in figures)
    print(f"peak at {top} rows: {peak:.0f} GMAC/s")
    out: dict[str, Any] = {"cpu": info.model_name, "shapes": shapes, "gmacs": figures,
                           "peak_gmacs": peak}
    if args.prompt_tokens:
        step = prompt_step(args.model, args.prompt_tokens, config)
        print(f"prompt step of {args.prompt_tokens} tokens: {step:.0f} GMAC/s, "
              f"{100 * step / peak:.0f}% of the peak")
        out["prompt_step_gmacs"] = step
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out
