"""Decode attention of one model shape over many layers, from caches that do not fit the
CPU's caches (or do: --layers 1): the compiled kernel alone, median of its runs.
docs/benchmarks-log.md quotes it.

    python benchmarks/decode_attention.py                          # SmolLM2-135M's shape
    python benchmarks/decode_attention.py --heads 32 --kv-heads 8 --layers 16   # a 1B Llama
    python benchmarks/decode_attention.py --kernel decode_attention   # the AVX-512 path
    python benchmarks/decode_attention.py --kv-cache-dtype int8     # the quantized cache

Each run is one decode step's attention for every layer: --seqs sequences of
context/2..context tokens, their blocks in random order in the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpullm.model_executor.layers.ops import load_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--kernel", default="decode_attention_amx",
                        choices=["decode_attention_amx", "decode_attention"])
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                        help="a quantized cache: decode_attention_quant (--kernel unused)")
    args = parser.parse_args()
    ops = load_ops()
    quantized = args.kv_cache_dtype != "auto"
    if quantized:
        args.kernel = "decode_attention_quant"
    kernel = getattr(ops, args.kernel) if ops is not None else None
    if kernel is None:
        raise SystemExit(f"{args.kernel} is not in this CPU's kernel build")
    torch.manual_seed(0)
    blocks_per_seq = -(-args.context // args.block_size)
    blocks = args.seqs * blocks_per_seq
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    storage = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}.get(args.kv_cache_dtype, torch.bfloat16)
    row_scales = args.kv_cache_dtype == "int8"

    def cache() -> torch.Tensor:
        x = torch.randn(shape)
        return (x * 40).round().clamp(-127, 127).to(storage) if row_scales else x.to(storage)

    def scales() -> torch.Tensor | None:
        return torch.rand(shape[:-1]).half() / 40 if row_scales else None

    caches = [(cache(), cache(), scales(), scales()) for _ in range(args.layers)]
    tables = torch.randperm(blocks).view(args.seqs, blocks_per_seq)
    lens = torch.randint(args.context // 2, args.context + 1, (args.seqs,))
    q = torch.randn(args.seqs, args.heads, args.head_dim).bfloat16()
    out = torch.empty_like(q)
    scale = args.head_dim ** -0.5

    def step() -> float:
        start = time.perf_counter()
        for keys, values, key_rows, value_rows in caches:
            if quantized:
                kernel(out, q, keys, values, key_rows, value_rows, 1.0, 1.0, tables, lens,
                       scale, 0, 0.0, None)
            else:
                kernel(out, q, keys, values, tables, lens, scale, 0, 0.0, None)
        return time.perf_counter() - start

    step()
    times = sorted(step() for _ in range(args.runs))
    row = args.head_dim * storage.itemsize + (2 if row_scales else 0)
    read = sum(int(n) for n in lens) * args.kv_heads * row * 2 * args.layers
    median = statistics.median(times)
    print(f"{args.kernel} ({args.kv_cache_dtype}): {args.layers} layers, {args.seqs} sequences: "
          f"median {median * 1e3:.2f} ms (min {times[0] * 1e3:.2f}, max {times[-1] * 1e3:.2f}), "
          f"{read / median / 1e9:.1f} GB/s of keys and values")


if __name__ == "__main__":
    main()
