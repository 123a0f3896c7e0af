"""``cpullm bench throughput`` and ``cpullm bench latency``: the offline engine, measured."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping

import numpy as np
from tqdm.auto import tqdm

from cpullm.benchmarks.datasets import add_dataset_args, sample_requests
from cpullm.engine_args import OFFLINE_DEFAULTS, EngineArgs
from cpullm.entrypoints.llm import LLM
from cpullm.logger import logging_to_tqdm
from cpullm.platform.memory import read_bandwidth
from cpullm.sampling_params import SamplingParams


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser, with_seed=False)
    parser.add_argument("--output-json", default=None,
                        help="write the figures to this JSON file")
    EngineArgs.add_cli_args(parser, **OFFLINE_DEFAULTS)


def run_throughput(args: argparse.Namespace) -> dict[str, float]:
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    engine = llm.llm_engine
    requests = sample_requests(args, llm.get_tokenizer(), engine.config.model.max_model_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    if engine.config.model.is_pooling:
        return _pooling_throughput(args, llm, prompts)
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
              for r in requests]
    kv = engine.scheduler.kv_cache_manager
    queries, hits = kv.num_queries, kv.num_hits
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "prefix_cache_hit_rate": ((kv.num_hits - hits) / max(1, kv.num_queries - queries)),
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens: {prompt_tokens}\nTotal num output tokens: {output_tokens}\n"
          f"Prefix cache hit rate: {100 * result['prefix_cache_hit_rate']:.1f}%")
    _write_json(args.output_json, result)
    return result


def _pooling_throughput(args: argparse.Namespace, llm: LLM,
                        prompts: list[dict[str, list[int]]]) -> dict[str, float]:
    """A pooling model's throughput: every input embedded (or scored) at once."""
    start = time.perf_counter()
    outputs = llm.encode(prompts, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result = {"elapsed_time": elapsed, "num_requests": len(outputs),
              "total_num_tokens": tokens, "requests_per_second": len(outputs) / elapsed,
              "tokens_per_second": tokens / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} texts/s, "
          f"{result['tokens_per_second']:.2f} tokens/s ({tokens} tokens in "
          f"{len(outputs)} texts, {elapsed:.2f} s)")
    _write_json(args.output_json, result)
    return result


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128,
                        help="generated tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--prompts", choices=["random", "code-edit"], default="random",
                        help="random: random token ids, sampled at temperature 1 (vLLM's); "
                        "code-edit: a chat request to fix the bug in about --input-len "
                        "tokens of Python source from the standard library, decoded "
                        "greedily (an input-grounded task, where n-gram speculation pays)")
    parser.add_argument("--num-iters-warmup", type=int, default=10,
                        help="untimed iterations first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    parser.add_argument("--output-json", default=None,
                        help="write the figures to this JSON file")
    EngineArgs.add_cli_args(parser, **OFFLINE_DEFAULTS)


def run_latency(args: argparse.Namespace) -> dict[str, object]:
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    rng = np.random.default_rng(args.seed)
    vocab = llm.llm_engine.config.model.vocab_size
    params = SamplingParams(temperature=1.0 if args.prompts == "random" else 0.0, top_p=1.0,
                            ignore_eos=True, max_tokens=args.output_len)
    source = _library_source() if args.prompts == "code-edit" else []

    phases: list[tuple[float, float]] = []  # (prefill, decode) tokens/s of each timed batch

    def once(timed: bool = False) -> float:
        # Fresh prompts every iteration: the prefix cache must not hide the prompt's cost.
        prompts = [{"prompt_token_ids": _code_edit_prompt(llm, source, args.input_len, rng)
                    if source else rng.integers(100, vocab, args.input_len).tolist()}
                   for _ in range(args.batch_size)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if timed:
            phases.append(_phase_rates(outputs, args.input_len, args.output_len))
        return elapsed

    with logging_to_tqdm():
        for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
            once()
        latencies = np.array([once(timed=True) for _ in tqdm(range(args.num_iters),
                                                             desc="Profiling iterations")])
    percentiles = [10, 25, 50, 75, 90, 99]
    values = np.percentile(latencies, percentiles)
    print(f"Avg latency: {latencies.mean():.4f} seconds")
    for p, v in zip(percentiles, values, strict=True):
        print(f"{p}% percentile latency: {v:.4f} seconds")
    tokens = args.batch_size * args.output_len
    print(f"Decode throughput: {tokens / latencies.mean():.1f} output tokens/s")
    prefill, decode = (float(np.median([p[i] for p in phases])) for i in range(2))
    # llama-bench's pp and tg: the prompt step alone, and the tokens after the first
    print(f"Prefill: {prefill:.1f} prompt tokens/s, decode: {decode:.2f} tokens/s after the "
          "first (medians)")
    result: dict[str, object] = {
        "avg_latency": float(latencies.mean()), "latencies": latencies.tolist(),
        "percentiles": {str(p): float(v) for p, v in zip(percentiles, values, strict=True)},
        "output_tokens_per_second": tokens / float(latencies.mean()),
        "prefill_tokens_per_second": prefill, "decode_tokens_per_second": decode}
    result.update(_rooflines(llm, args, prefill, decode))
    result.update(_speculation(llm))
    _write_json(args.output_json, result)
    return result


def _library_source() -> list[str]:
    """Lines of Python source that every installation has (argparse's module)."""
    import argparse as module
    import inspect

    return inspect.getsource(module).splitlines(keepends=True)


def _code_edit_prompt(llm: LLM, source: list[str], input_len: int,
                      rng: np.random.Generator) -> list[int]:
    """A chat prompt of about ``input_len`` tokens asking to fix the bug in a run of
    ``source`` lines from a random place (fresh each time, past the prefix cache)."""
    tokenizer = llm.get_tokenizer()
    start = int(rng.integers(0, len(source) // 2))
    code: list[str] = []
    ids: list[int] = []
    for line in source[start:]:
        code.append(line)
        if len(code) % 8:
            continue
        messages = [{"role": "user", "content": "Fix the bug in this Python code. Reply "
                     "with the corrected code only.\n\n```python\n" + "".join(code) + "```"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= input_len:
            break
    return list(ids)


def _speculation(llm: LLM) -> dict[str, float]:
    """Speculative decoding's acceptance over the run, where it is on (in-process)."""
    if llm.llm_engine.config.scheduler.speculative is None:
        return {}
    try:
        stats = llm.llm_engine.scheduler.spec_stats
    except AttributeError:  # (the engine core in its own process)
        return {}
    rate = stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)
    length = 1 + stats.num_accepted_tokens / max(stats.num_drafts, 1)  # (vLLM's measure)
    print(f"Speculative decoding: {100 * rate:.1f} % of {stats.num_draft_tokens} proposed "
          f"tokens accepted; mean acceptance length {length:.2f} (tokens a verifying step)")
    return {"spec_acceptance_rate": rate, "spec_mean_acceptance_length": length}


def _rooflines(llm: LLM, args: argparse.Namespace, prefill: float, decode: float
               ) -> dict[str, float]:
    """What the rates come to against the machine: the bytes a decode step reads (the
    weights once, each sequence's K and V) per second, beside a plain read of as many
    bytes on the same threads; and the linear layers' GFLOP/s in the prompt step. Only
    for a dense model run in this process (a mixture reads just its chosen experts)."""
    import torch

    from cpullm.model_executor.layers.linear import LinearBase
    from cpullm.model_executor.loader import weight_bytes

    try:
        model = llm.llm_engine.model_runner.model
    except AttributeError:
        return {}
    if any(name.endswith("experts") for name, _ in model.named_modules()) or decode <= 0:
        return {}
    weights = weight_bytes(model)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and not getattr(model, "tie_word_embeddings", False):
        weights -= weight_bytes(embed)  # a step reads only its tokens' rows
    context = args.input_len + args.output_len / 2  # on average over the decode steps
    kv = args.batch_size * context * llm.llm_engine.config.model.kv_bytes_per_token()
    step = weights + kv
    rate = step * decode / args.batch_size / 1e9  # decode / batch_size: steps a second
    plain = read_bandwidth(int(step)) / 1e9
    linear = sum(m.input_size * m.output_size for name, m in model.named_modules()
                 if isinstance(m, LinearBase) and not name.endswith("lm_head"))
    gflops = 2 * linear * prefill / 1e9
    print(f"Decode reads {weights / 1e6:.0f} MB of weights and {kv / 1e6:.0f} MB of KV a "
          f"step: {rate:.1f} GB/s; a plain read of as many bytes on "
          f"{torch.get_num_threads()} threads: {plain:.1f} GB/s ({100 * rate / plain:.0f} %)")
    print(f"Prefill: {gflops:.1f} GFLOP/s in the linear layers ({2 * linear / 1e9:.2f} "
          "GFLOP a token; `cpullm bench gemm` measures the peak)")
    return {"decode_read_gb_per_second": rate, "plain_read_gb_per_second": plain,
            "prefill_linear_gflops": gflops}


def _phase_rates(outputs: list, input_len: int, output_len: int) -> tuple[float, float]:
    """A batch's prompt tokens/s (first scheduled to its last first token) and decode
    tokens/s after each request's first token (the earliest first token to the last
    token), from the requests' times."""
    times = [o.metrics for o in outputs]
    first = max(t["first_token_time"] for t in times)
    prefill = len(times) * input_len / (first - min(t["scheduled_time"] for t in times))
    decode_span = max(t["last_token_time"] for t in times) - \
        min(t["first_token_time"] for t in times)
    decode = len(times) * (output_len - 1) / decode_span if output_len > 1 else 0.0
    return prefill, decode


def _write_json(path: str | None, result: Mapping[str, object]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=4)
