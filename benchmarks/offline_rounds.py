"""Offline throughput of several runs in one engine, after a short warm-up: what
`cpullm bench throughput` measures (random prompts, temperature 1, no early stop), with
the engine's first-run costs out of the figures. docs/benchmarks-log.md quotes it.

    python benchmarks/offline_rounds.py MODEL                       # 3 runs of 128 x 128/128
    CPULLM_COMPUTE_LANES=1 python benchmarks/offline_rounds.py MODEL   # lanes off

Prints each run's total tokens/s (prompt and output), and the steps each compute lane ran.
"""

from __future__ import annotations

import argparse
import time

import torch

from cpullm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype)
    vocab = llm.llm_engine.config.model.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (args.input_len,),
                                                  generator=generator).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    tokens = args.num_prompts * (args.input_len + args.output_len)
    try:
        for _ in range(args.rounds):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            print(f"{tokens / elapsed:.1f} total tokens/s, lane steps "
                  f"{llm.llm_engine.core.executor.lane_steps}", flush=True)
    finally:
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
