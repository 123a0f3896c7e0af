"""``cpullm bench soak``: many streaming clients for a long time, a share of them vanishing
mid-stream, against a running server; then the server must be whole: no errors for the
clients that stayed, every KV block free again (read from /metrics), resident memory flat
after the warm-up (read from /proc for ``--server-pid`` and its children)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from cpullm.benchmarks.serve import sse_lines


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's address")
    parser.add_argument("--model", default=None,
                        help="model name sent to the server; unset: its first model")
    parser.add_argument("--clients", type=int, default=256, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds during which clients start new requests")
    parser.add_argument("--disconnect-fraction", type=float, default=1 / 3,
                        help="share of requests whose client goes away mid-stream")
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 128),
                        metavar=("MIN", "MAX"), help="range of max_tokens per request")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="the server's pid, for its resident memory (same machine)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds after which memory must stay flat (default: a tenth "
                             "of the duration)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the clients' prompts, lengths and disconnects")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer key sent to the server (default: $OPENAI_API_KEY)")
    parser.add_argument("--result-file", default=None, help="write the figures as JSON")


@dataclass
class SoakResult:
    requests: int = 0  # streams that ran to their end
    disconnects: int = 0  # streams the client left on purpose
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)


def process_tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{current}/task/{current}/children") as f:
                stack.extend(int(p) for p in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


async def _stream_once(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       leave_after: int | None, result: SoakResult) -> None:
    start = time.perf_counter()
    times: list[float] = []
    done = False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.errors.append(f"HTTP {response.status_code}: "
                                     f"{(await response.aread())[:200]!r}")
                return
            async for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.errors.append(f"error event: {chunk['error']}")
                    return
                times.append(time.perf_counter())
                if leave_after is not None and len(times) >= leave_after:
                    result.disconnects += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        result.errors.append(f"{type(e).__name__}: {e}")
        return
    if not done:
        result.errors.append("stream ended without [DONE]")
        return
    result.requests += 1
    if times:
        result.ttft.append(times[0] - start)
        if len(times) > 1:
            result.tpot.append((times[-1] - times[0]) / (len(times) - 1))


async def soak(base_url: str, model: str, clients: int, duration: float,
               disconnect_fraction: float, max_tokens: tuple[int, int], seed: int = 0,
               server_pid: int | None = None, headers: dict[str, str] | None = None
               ) -> SoakResult:
    """Run the soak; the loops are bounded by ``duration`` (each client finishes the
    request it is in)."""
    result = SoakResult()
    url = f"{base_url}/v1/completions"
    deadline = time.monotonic() + duration
    started = time.monotonic()
    words = ["cpu", "token", "stream", "cache", "block", "model", "serve", "core", "soak"]

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 100003 + index)
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:
            while time.monotonic() < deadline:
                tokens = rng.randint(*max_tokens)
                prompt = " ".join(rng.choice(words) for _ in range(rng.randint(4, 64)))
                body = {"model": model, "prompt": prompt, "max_tokens": tokens,
                        "ignore_eos": True, "stream": True, "temperature": 1.0,
                        "seed": rng.randint(0, 1 << 30)}
                leave = rng.randint(1, tokens) if rng.random() < disconnect_fraction else None
                await _stream_once(client, url, body, leave, result)

    async def sample_memory() -> None:
        while time.monotonic() < deadline + 5:
            result.rss.append((time.monotonic() - started, process_tree_rss(server_pid)))
            await asyncio.sleep(1.0)

    tasks = [asyncio.create_task(client_loop(i)) for i in range(clients)]
    sampler = asyncio.create_task(sample_memory()) if server_pid is not None else None
    await asyncio.gather(*tasks)
    if sampler is not None:
        sampler.cancel()
        result.rss.append((time.monotonic() - started, process_tree_rss(server_pid)))
    return result


def kv_blocks_leaked(base_url: str, headers: dict[str, str] | None = None,
                     timeout: float = 30.0) -> int:
    """KV blocks still held once no request runs or waits (0 when all came back)."""
    deadline = time.monotonic() + timeout
    while True:
        values: dict[str, float] = {}
        for line in httpx.get(f"{base_url}/metrics", headers=headers).text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
        idle = values["vllm:num_requests_running"] == 0 and \
            values["vllm:num_requests_waiting"] == 0
        leaked = int(values["cpullm:kv_cache_total_blocks"] - values["cpullm:kv_cache_free_blocks"])
        if (idle and leaked == 0) or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


def summarize(result: SoakResult, leaked: int, warmup: float) -> dict[str, Any]:
    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q) * 1e3) if values else float("nan")

    after = [rss for t, rss in result.rss if t >= warmup]
    return {
        "requests": result.requests, "disconnects": result.disconnects,
        "errors": len(result.errors), "first_errors": result.errors[:5],
        "kv_blocks_leaked": leaked,
        "rss_start_mb": result.rss[0][1] / 1e6 if result.rss else None,
        "rss_after_warmup_mb": after[0] / 1e6 if after else None,
        "rss_max_after_warmup_mb": max(after) / 1e6 if after else None,
        "rss_end_mb": result.rss[-1][1] / 1e6 if result.rss else None,
        "ttft_p50_ms": pct(result.ttft, 50), "ttft_p99_ms": pct(result.ttft, 99),
        "tpot_p50_ms": pct(result.tpot, 50), "tpot_p99_ms": pct(result.tpot, 99),
        "rss_mb_by_second": [(round(t), round(rss / 1e6)) for t, rss in result.rss]}


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    model = args.model or httpx.get(f"{args.base_url}/v1/models",
                                    headers=headers).json()["data"][0]["id"]
    result = asyncio.run(soak(args.base_url, model, args.clients, args.duration,
                              args.disconnect_fraction, tuple(args.max_tokens), args.seed,
                              args.server_pid, headers))
    warmup = args.warmup if args.warmup is not None else args.duration / 10
    figures = summarize(result, kv_blocks_leaked(args.base_url, headers), warmup)
    for name, value in figures.items():
        if name != "rss_mb_by_second":
            print(f"{name:<26}{value}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(figures, f, indent=2)
    return figures
