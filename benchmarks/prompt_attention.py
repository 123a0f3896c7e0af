"""Prompt attention of one step's fresh prompts, one layer: the fused kernel against the
batched path it replaces where the CPU has no AMX (two bfloat16 batched matmuls around
prefill_softmax_bf16, then the copy back), in turn, medians of their runs.
docs/benchmarks-log.md quotes it.

    python benchmarks/prompt_attention.py             # 32 prompts of 128, SmolLM2's heads
    python benchmarks/prompt_attention.py --heads 32 --kv-heads 8 --prompts 8 --len 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpullm.model_executor.layers.ops import load_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    ops = load_ops()
    if ops is None or ops.prefill_attention_bf16 is None:
        raise SystemExit("the fused prompt attention is not in this CPU's kernel build")
    torch.manual_seed(0)
    prompts, length, kv, dim = args.prompts, args.len, args.kv_heads, args.head_dim
    group = args.heads // kv
    blocks_per_prompt = -(-length // args.block_size)
    shape = (prompts * blocks_per_prompt, args.block_size, kv, dim)
    key_cache, value_cache = torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16()
    tables = torch.arange(shape[0]).view(prompts, blocks_per_prompt)
    starts = torch.zeros(prompts, dtype=torch.long)
    lens = torch.full((prompts,), length)
    # q, k, v as the model passes them: views into one fused QKV row per token
    qkv = torch.randn(prompts * length, args.heads + 2 * kv, dim).bfloat16()
    q, k, v = qkv[:, :args.heads], qkv[:, args.heads:args.heads + kv], qkv[:, args.heads + kv:]
    slots = (tables[:, :, None] * args.block_size
             + torch.arange(args.block_size)).view(prompts, -1)[:, :length].reshape(-1)
    ops.cache_kv(key_cache.view(-1, kv, dim), value_cache.view(-1, kv, dim), k, v, slots)
    out = torch.empty(prompts * length, args.heads, dim).bfloat16()
    scale = dim ** -0.5

    def fused() -> None:
        ops.prefill_attention_bf16(out, q, key_cache, value_cache, tables, starts, lens, scale, 0)

    def batched() -> None:  # PagedAttention._attend_bf16 on fresh prompts
        batch = prompts * kv
        keys_t = k.view(prompts, length, kv, dim).permute(0, 2, 3, 1).reshape(batch, dim, -1)
        values = v.view(prompts, length, kv, dim).transpose(1, 2).reshape(batch, -1, dim)
        query = q.view(prompts, length, kv, group, dim).permute(0, 2, 3, 1, 4)
        scores = torch.bmm(query.reshape(batch, group * length, dim), keys_t)
        ops.prefill_softmax_bf16(scores, starts, lens, kv, length, scale, 0, 0.0, None)
        result = torch.bmm(scores, values).view(prompts, kv, group, length, dim)
        out.view(prompts, length, kv, group, dim).copy_(result.permute(0, 3, 1, 2, 4))

    def median_ms(run) -> float:
        run()
        samples = []
        for _ in range(args.runs):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    # Each side's runs back to back (the step's q, k and v stay in cache, as after the QKV
    # projection), the sides in turn, three rounds.
    fused_ms, batched_ms = [], []
    for _ in range(3):
        fused_ms.append(median_ms(fused))
        batched_ms.append(median_ms(batched))
    print(f"{prompts} prompts of {length} tokens, {args.heads} heads / {kv} KV heads of "
          f"{dim}, {torch.get_num_threads()} threads, medians of {args.runs} runs:")
    print("  fused   " + ", ".join(f"{t:.2f}" for t in fused_ms) + " ms")
    print("  batched " + ", ".join(f"{t:.2f}" for t in batched_ms) + " ms")

if __name__ == "__main__":
    main()
