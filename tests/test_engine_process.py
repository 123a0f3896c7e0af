"""The server's engine core runs in its own process: its death fails requests and /health
at once, and stopping the server leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_utils import RemoteServer

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"),
                                reason="reads child processes from /proc (Linux)")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie is gone but for its entry
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _engine_core(server: RemoteServer) -> int:
    cores = [p for p in _children(server.proc.pid) if "spawn_main" in _cmdline(p)]
    assert len(cores) == 1, f"one engine-core process expected, children: {cores}"
    return cores[0]


def test_server_runs_the_engine_core_in_a_process_and_sigterm_stops_it(tiny_model):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len", "512"])
    try:
        core = _engine_core(srv)
        response = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                              json={"prompt": "Hello", "max_tokens": 5, "temperature": 0})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 5
        children = _children(srv.proc.pid)
        assert core in children
    finally:
        assert srv.stop() == 0
    assert _wait_gone(children, 10) == [], "processes left after SIGTERM of the server"
    assert "spawn_main" not in _cmdline(core)


def test_engine_core_death_fails_requests_and_health(tiny_model):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32",
                        "--max-model-len", "1024"])
    try:
        core = _engine_core(srv)
        # A long stream is running when the engine core is killed: its headers went out, so
        # the failure comes as an SSE error event, and the stream ends.
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30, json={
                "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            killed = time.monotonic()
            os.kill(core, signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"code": 500' in rest and "exit code -9" in rest
        assert rest.rstrip().endswith("data: [DONE]")
        assert time.monotonic() - killed < 10
        health = httpx.get(f"{srv.url}/health", timeout=5)
        assert health.status_code == 500 and "exit code -9" in health.text
        # New requests are refused at once, with the reason.
        for stream in (False, True):
            response = httpx.post(f"{srv.url}/v1/completions", timeout=10,
                                  json={"prompt": "hi", "max_tokens": 3, "stream": stream})
            assert response.status_code == 500
            assert "exit code -9" in response.json()["error"]["message"]
    finally:
        children = _children(srv.proc.pid)
        assert srv.stop() == 0
    assert _wait_gone(children, 10) == []


def _per_engine(server: RemoteServer, name: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{") and 'engine="' in line:
            engine = line.split('engine="')[1].split('"')[0]
            values[engine] = float(line.rsplit(" ", 1)[1])
    return values


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core per replica")
def test_data_parallel_replicas_give_the_results_of_one(tiny_model):
    import asyncio

    import openai

    model = str(tiny_model("llama"))
    args = [model, "--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
    prompts = [f"Request {i}: the numbers {' '.join(str(i * j) for j in range(i % 7 + 1))}"
               for i in range(32)]

    async def run_all(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        responses = await asyncio.gather(*[
            client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0)
            for p in prompts])
        await client.close()
        return [r.choices[0].text for r in responses]

    results = {}
    for size in (1, 2):
        srv = RemoteServer([*args, "--data-parallel-size", str(size)])
        try:
            if size == 2:
                assert "rank 0: CPUs 0; rank 1: CPUs 1" in srv.log()
                assert len([p for p in _children(srv.proc.pid)
                            if "spawn_main" in _cmdline(p)]) == 2
            results[size] = asyncio.run(run_all(srv.url))
            if size == 2:  # both replicas looked up prompts, so both received work
                queries = _per_engine(srv, "vllm:prefix_cache_queries_total")
                assert set(queries) == {"0", "1"} and min(queries.values()) > 0, queries
                # and the request-level metrics count each request under its replica
                finished = _per_engine(srv, "vllm:e2e_request_latency_seconds_count")
                assert set(finished) == {"0", "1"} and min(finished.values()) > 0, finished
                assert sum(finished.values()) == len(prompts)
                srv.wait_idle()
                # One replica dies: the server says so, naming it, within seconds.
                cores = sorted(p for p in _children(srv.proc.pid) if "spawn_main" in _cmdline(p))
                os.kill(cores[1], signal.SIGKILL)
                deadline = time.monotonic() + 10
                while httpx.get(f"{srv.url}/health").status_code == 200:
                    assert time.monotonic() < deadline, "/health still OK"
                    time.sleep(0.1)
                health = httpx.get(f"{srv.url}/health").text
                assert "(replica " in health and "exit code -9" in health
        finally:
            children = _children(srv.proc.pid)
            assert srv.stop() == 0
        assert _wait_gone(children, 10) == []
    assert results[2] == results[1]


def test_llm_with_the_engine_core_in_a_process_gives_the_same_outputs(tiny_model, monkeypatch):
    from cpullm import LLM, SamplingParams

    model = str(tiny_model("llama"))
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=12, stop=[" the", "a"])]

    def run() -> list[tuple]:
        llm = LLM(model, dtype="float32", max_model_len=256, seed=0)
        try:
            # The request that ends on a stop string runs on its own: the process steps on
            # while the front end finds the string, so in a shared batch it would change
            # the others' batch shapes, and with them the last bits of their logits.
            outputs = (llm.generate(prompts[:2], params[:2], use_tqdm=False)
                       + llm.generate(prompts[2:], params[2:], use_tqdm=False))
            return [(o.request_id, [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                     None if c.logprobs is None else
                                     [sorted(e) for e in c.logprobs]) for c in o.outputs])
                    for o in outputs]
        finally:
            llm.llm_engine.shutdown()

    def first_step_tokens() -> tuple[int, int]:
        """Tokens in the first step after three prompts are added, and in the prompts."""
        llm = LLM(model, dtype="float32", max_model_len=256, seed=0)
        engine = llm.llm_engine
        try:
            ids = []
            for prompt in prompts:
                ids.append(engine.add_request(None, prompt, SamplingParams(max_tokens=4)))
                time.sleep(0.2)  # as if a long prompt took that long to tokenize
            engine.step()
            engine.abort_request(ids)
            return (engine.last_step_num_tokens,
                    sum(len(engine.tokenize_prompt(p)[1]) for p in prompts))
        finally:
            engine.shutdown()

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    in_process = run()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert run() == in_process
    # Requests added between two steps reach the process together: one first batch.
    stepped, prompt_tokens = first_step_tokens()
    assert stepped == prompt_tokens
    # shutdown() stopped the engine-core process
    cores = [p for p in _children(os.getpid()) if "spawn_main" in _cmdline(p)]
    assert _wait_gone(cores, 10) == []
