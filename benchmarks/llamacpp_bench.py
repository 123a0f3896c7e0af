"""llama.cpp's prompt and generation speed on a GGUF file, as llama-bench measures them (pp:
a prompt of N tokens in one batch; tg: M tokens generated one at a time after a prompt of
P tokens), through llama-cpp-python, in its own venv:

    python benchmarks/llamacpp_bench.py MODEL.gguf [--threads 2] [--pp 512] [--tg 128]
                                        [--context 128] [--reps 3] [--json OUT]

Random token ids (fixed seed), each phase timed around llama.cpp's evaluation;
prints each run and the medians. The cpullm side: `cpullm bench latency --batch-size 1`
prints the same two rates ("Prefill", "decode").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    import llama_cpp
    from llama_cpp import Llama

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pp", type=int, default=512, help="prompt tokens of the pp runs")
    parser.add_argument("--tg", type=int, default=128, help="tokens generated in the tg runs")
    parser.add_argument("--context", type=int, default=128,
                        help="prompt tokens before the tg runs' generation")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=max(args.pp, args.context + args.tg) + 8,
                n_batch=args.pp, n_ubatch=args.pp, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    load = time.perf_counter() - start
    vocab = min(llm.n_vocab(), 49152)  # the ids a tokenizer of the cpullm folders has
    rng = np.random.default_rng(0)
    ctx = llm._ctx.ctx

    def run(prompt: int, generate: int) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) of one run on an empty cache."""
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        start = time.perf_counter()
        llm.eval(rng.integers(100, vocab, prompt).tolist())
        middle = time.perf_counter()
        for _ in range(generate):
            llm.eval([int(rng.integers(100, vocab))])  # one token a step, as tg does
        end = time.perf_counter()
        return prompt / (middle - start), generate / (end - middle) if generate else 0.0

    run(16, 4)  # warm-up
    pps = [run(args.pp, 0)[0] for _ in range(args.reps)]
    tgs = [run(args.context, args.tg)[1] for _ in range(args.reps)]
    result = {"load_s": load, "pp": pps, "tg": tgs, "pp_median": statistics.median(pps),
              "tg_median": statistics.median(tgs), "threads": args.threads}
    print(f"load {load:.2f} s; pp{args.pp} {' / '.join(f'{v:.1f}' for v in pps)} tok/s; "
          f"tg{args.tg} (after {args.context}) {' / '.join(f'{v:.2f}' for v in tgs)} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
