"""``cpullm bench serve``: load any OpenAI-compatible server (cpullm's or vLLM's) and report
TTFT, TPOT, ITL and end-to-end latency, and throughput, the way ``vllm bench serve`` does."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from cpullm.benchmarks.datasets import BenchRequest, add_dataset_args, sample_requests


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's address")
    parser.add_argument("--backend", choices=list(_BACKENDS), default="openai",
                        help="request shape: openai (completions, prompts as token ids), "
                        "openai-chat (chat completions, prompts as one user message), "
                        "openai-responses (/v1/responses, the prompt as input), "
                        "anthropic-messages (/v1/messages, one user message) or "
                        "openai-embeddings (/v1/embeddings, inputs as token ids); vllm is "
                        "openai, as vLLM's bench names it")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate max_tokens whatever the model says (so every request "
                        "makes the same work)")
    parser.add_argument("--endpoint", default=None,
                        help="path of the API route (default: the backend's, "
                        "/v1/completions or /v1/chat/completions)")
    parser.add_argument("--model", default=None,
                        help="model name sent to the server; unset: its first model")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters the server serves: each request's model is one "
                        "of them, picked at random (--seed)")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer folder or GGUF file; unset: the default model's")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once; unset: all of them")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer key sent to the server (default: $OPENAI_API_KEY)")
    parser.add_argument("--save-result", action="store_true",
                        help="write the figures to a JSON file")
    parser.add_argument("--result-dir", default=".", help="folder of the JSON file")
    parser.add_argument("--result-filename", default=None,
                        help="name of the JSON file (default: cpullm-serve-<time>.json)")
    add_dataset_args(parser, num_prompts=200)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _completion_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {"model": model, "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len}


def _chat_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {"model": model, "max_completion_tokens": request.output_len,
            "messages": [{"role": "user", "content": request.prompt}]}


def _responses_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {"model": model, "max_output_tokens": request.output_len, "input": request.prompt}


def _messages_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {"model": model, "max_tokens": request.output_len,
            "messages": [{"role": "user", "content": request.prompt}]}


def _embeddings_body(model: str, request: BenchRequest) -> dict[str, Any]:
    return {"model": model, "input": request.prompt_token_ids}


# A streamed event's reading: (whether it carries tokens, the prompt's tokens and the
# output's, where the event counts them)
Reading = tuple[bool, int | None, int | None]


def _read_openai(event: dict[str, Any]) -> Reading:
    """Completions and chat completions: every chunk with choices is a token event (as
    vLLM's client counts them); the last chunk has the usage."""
    usage = event.get("usage") or {}
    return bool(event.get("choices")), usage.get("prompt_tokens"), \
        usage.get("completion_tokens")


def _read_responses(event: dict[str, Any]) -> Reading:
    if event.get("type") == "response.completed":
        usage = event["response"]["usage"]
        return False, usage["input_tokens"], usage["output_tokens"]
    return event.get("type") == "response.output_text.delta", None, None


def _read_messages(event: dict[str, Any]) -> Reading:
    kind = event.get("type")
    if kind == "message_start":
        return False, event["message"]["usage"]["input_tokens"], None
    if kind == "message_delta":
        return False, None, event["usage"]["output_tokens"]
    return kind == "content_block_delta", None, None


@dataclass(frozen=True)
class Backend:
    endpoint: str  # the default route
    body: Callable[[str, BenchRequest], dict[str, Any]]
    read: Callable[[dict[str, Any]], Reading] = _read_openai
    # what a streamed request adds to the body (the usage, where the API needs asking)
    stream_fields: tuple[tuple[str, Any], ...] = (("stream_options", {"include_usage": True}),)


_BACKENDS: dict[str, Backend] = {
    "openai": Backend("/v1/completions", _completion_body),
    "openai-chat": Backend("/v1/chat/completions", _chat_body),
    "openai-responses": Backend("/v1/responses", _responses_body, _read_responses, ()),
    "anthropic-messages": Backend("/v1/messages", _messages_body, _read_messages, ()),
    "openai-embeddings": Backend("/v1/embeddings", _embeddings_body),
    "vllm": Backend("/v1/completions", _completion_body),  # vLLM bench's name for completions
}


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, split where SSE ends a line (CR, LF, CRLF)
    only: httpx's aiter_lines also splits at U+2028, U+0085, ..., which a server may leave
    unescaped inside an event's JSON."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int,
               headers: dict[str, str], ignore_eos: bool = True,
               backend: Backend = _BACKENDS["openai"]) -> RequestResult:
    """One streamed request: its first token event gives the TTFT, the others the
    inter-token latencies."""
    result = RequestResult(prompt_len=prompt_len)
    body = {**body, "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
            **dict(backend.stream_fields)}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")
                return result
            async for line in sse_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                tokens, prompt, output = backend.read(json.loads(line[6:]))
                now = time.perf_counter()
                # the server's counts: chat prompts include the template
                if prompt is not None:
                    result.prompt_len = prompt
                if output is not None:
                    result.output_tokens = output
                if tokens:
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = repr(e)
    return result


async def _one_embedding(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         prompt_len: int, headers: dict[str, str]) -> RequestResult:
    """One embedding request: its latency, end to end."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            result.error = response.text
            return result
        result.prompt_len = response.json()["usage"]["prompt_tokens"]
        result.e2e = result.ttft = time.perf_counter() - start
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = repr(e)
    return result


async def _run(args: argparse.Namespace, requests: list[BenchRequest], model: str
               ) -> tuple[list[RequestResult], float]:
    backend = _BACKENDS[args.backend]
    url = args.base_url.rstrip("/") + (args.endpoint or backend.endpoint)
    headers = _headers(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    rng = random.Random(args.seed)
    models = [rng.choice(args.lora_modules) for _ in requests] if args.lora_modules \
        else [model] * len(requests)
    bar = tqdm(total=len(requests), desc="Requests")

    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        async def limited(request: BenchRequest, model: str) -> RequestResult:
            body = backend.body(model, request)
            async with limit:
                if args.backend == "openai-embeddings":
                    result = await _one_embedding(client, url, body,
                                                  len(request.prompt_token_ids), headers)
                else:
                    result = await _one(client, url, body, len(request.prompt_token_ids),
                                        headers, args.ignore_eos, backend)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request, request_model in zip(requests, models, strict=True):
            tasks.append(asyncio.create_task(limited(request, request_model)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.array(values_s) * 1000 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    from cpullm.transformers_utils import load_tokenizer, resolve_model

    model = args.model or httpx.get(args.base_url.rstrip("/") + "/v1/models",
                                    headers=_headers(args)).json()["data"][0]["id"]
    embeddings = args.backend == "openai-embeddings"
    tokenizer = load_tokenizer(resolve_model(args.tokenizer, pooling=embeddings))
    requests = sample_requests(args, tokenizer)
    spec_before = _spec_counters(args)
    results, duration = asyncio.run(_run(args, requests, model))
    ok = [r for r in results if r.success]
    if not ok:
        raise RuntimeError(f"every request failed; first error: {results[0].error}")
    if embeddings:
        return _embeddings_result(args, ok, len(results), duration)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    result: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        **_stats("ttft", [r.ttft for r in ok]), **_stats("tpot", tpots),
        **_stats("itl", [x for r in ok for x in r.itl]), **_stats("e2el", [r.e2e for r in ok]),
    }
    print(f"{' Serving Benchmark Result ':=^60}")
    for label, key in (("Successful requests", "completed"), ("Failed requests", "failed"),
                       ("Benchmark duration (s)", "duration"),
                       ("Total input tokens", "total_input_tokens"),
                       ("Total generated tokens", "total_output_tokens"),
                       ("Request throughput (req/s)", "request_throughput"),
                       ("Output token throughput (tok/s)", "output_throughput"),
                       ("Total token throughput (tok/s)", "total_token_throughput")):
        value = result[key]
        print(f"{label:<45}{value:>15.2f}" if isinstance(value, float)
              else f"{label:<45}{value:>15}")
    for metric, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ' ' + metric.upper() + ' (ms):':<45}"
                  f"{result[f'{stat}_{metric}_ms']:>15.2f}")
    spec_after = _spec_counters(args)
    if spec_before is not None and spec_after is not None:
        result.update(_spec_result(spec_before, spec_after))
    _save(args, result)
    return result


_SPEC_PREFIX = "vllm:spec_decode_num_"


def _spec_counters(args: argparse.Namespace) -> dict[str, float] | None:
    """The server's speculative-decoding counters (summed over its engines; by position
    for the accepted ones), or None where it exports none."""
    try:
        text = httpx.get(args.base_url.rstrip("/") + "/metrics", headers=_headers(args),
                         timeout=10).text
    except httpx.HTTPError:
        return None
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_SPEC_PREFIX):
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{")[0].removeprefix(_SPEC_PREFIX).removesuffix("_total")
        position = re.search(r'position="(\d+)"', name)
        if position:
            key += position.group(1)
        counters[key] = counters.get(key, 0.0) + float(value)
    return counters or None


def _spec_result(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """vLLM's speculative-decoding section: acceptance over the run, from the counters."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    drafts, proposed = delta.get("drafts", 0.0), delta.get("draft_tokens", 0.0)
    accepted = delta.get("accepted_tokens", 0.0)
    positions = sorted(int(k.removeprefix("accepted_tokens_per_pos"))
                       for k in delta if k.startswith("accepted_tokens_per_pos"))
    result = {"spec_decode_acceptance_rate": 100 * accepted / proposed if proposed else 0.0,
              "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
              "spec_decode_num_drafts": int(drafts),
              "spec_decode_draft_tokens": int(proposed),
              "spec_decode_accepted_tokens": int(accepted),
              "spec_decode_per_position_acceptance_rate": [
                  100 * delta[f"accepted_tokens_per_pos{p}"] / drafts if drafts else 0.0
                  for p in positions]}
    print(f"{' Speculative Decoding ':-^60}")
    print(f"{'Acceptance rate (%):':<45}{result['spec_decode_acceptance_rate']:>15.2f}")
    print(f"{'Acceptance length:':<45}{result['spec_decode_acceptance_length']:>15.2f}")
    print(f"{'Drafts:':<45}{int(drafts):>15}")
    print(f"{'Draft tokens:':<45}{int(proposed):>15}")
    print(f"{'Accepted tokens:':<45}{int(accepted):>15}")
    print("Per-position acceptance (%): " + ", ".join(
        f"{rate:.1f}" for rate in result["spec_decode_per_position_acceptance_rate"]))
    return result


def _embeddings_result(args: argparse.Namespace, ok: list[RequestResult], sent: int,
                       duration: float) -> dict[str, Any]:
    """An embedding server's figures: texts and tokens per second, and the latency."""
    tokens = sum(r.prompt_len for r in ok)
    result: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": sent - len(ok),
        "total_input_tokens": tokens, "request_throughput": len(ok) / duration,
        "total_token_throughput": tokens / duration, "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate, **_stats("e2el", [r.e2e for r in ok])}
    print(f"{' Embedding Serving Benchmark Result ':=^60}")
    for label, key in (("Successful requests", "completed"), ("Failed requests", "failed"),
                       ("Benchmark duration (s)", "duration"),
                       ("Total input tokens", "total_input_tokens"),
                       ("Request throughput (texts/s)", "request_throughput"),
                       ("Total token throughput (tok/s)", "total_token_throughput"),
                       ("Mean E2EL (ms)", "mean_e2el_ms"), ("Median E2EL (ms)", "median_e2el_ms"),
                       ("P99 E2EL (ms)", "p99_e2el_ms")):
        value = result[key]
        print(f"{label:<45}{value:>15.2f}" if isinstance(value, float)
              else f"{label:<45}{value:>15}")
    _save(args, result)
    return result


def _save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.save_result:
        name = args.result_filename or f"cpullm-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        with open(os.path.join(args.result_dir, name), "w") as f:
            json.dump(result, f, indent=4)
