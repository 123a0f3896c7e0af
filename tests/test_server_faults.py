"""An engine failure answers 500 and shows in /health instead of hanging the server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from server_utils import free_port

from cpullm.engine.async_engine import AsyncEngine
from cpullm.engine.llm_engine import Frontend
from cpullm.engine_args import EngineArgs
from cpullm.entrypoints.openai.api_server import build_app


@contextlib.contextmanager
def serving(engine) -> Iterator[str]:
    """The real app over ``engine``, on uvicorn in a thread of this process (so that faults
    can be injected into the engine); yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "m"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def engine_on_a_thread(tiny_model) -> AsyncEngine:
    """The engine core on a thread of this process, where faults can be injected."""
    config = EngineArgs(model=str(tiny_model("llama")), dtype="float32", block_size=32,
                        max_model_len=512).create_engine_config()
    return AsyncEngine(config, Frontend(config), multiprocess=False)


def test_engine_failure_fails_requests_and_health(tiny_model):
    engine = engine_on_a_thread(tiny_model)

    def broken_forward(scheduler_output):  # fault injection into the real engine
        raise RuntimeError("injected fault")

    engine.cores[0].core.executor.model_runner.execute = broken_forward
    with serving(engine) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        # A stream's headers go out before the failure: its error comes as an SSE event.
        response = httpx.post(f"{url}/v1/completions", timeout=10,
                              json={"prompt": "hi", "max_tokens": 3, "stream": True})
        assert response.status_code == 200
        assert '"code": 500' in response.text and "injected fault" in response.text
        assert response.text.endswith("data: [DONE]\n\n")
        # Later requests, streaming or not, are refused at once with a 500.
        for stream in (False, True):
            response = httpx.post(f"{url}/v1/completions", timeout=10,
                                  json={"prompt": "hi", "max_tokens": 3, "stream": stream})
            assert response.status_code == 500
            assert "injected fault" in response.json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 500 and "injected fault" in health.text


def assert_one_request_fails(engine, bad: dict, message: str) -> None:
    """Four concurrent requests, two with the ``bad`` fields (one streaming): those get a
    500 naming ``message`` (an SSE error event once the stream's headers are out), the
    good ones their 20 tokens; /health passes and every KV block comes back."""
    with serving(engine) as url:
        results: dict[str, httpx.Response] = {}

        def post(name: str, body: dict) -> None:
            results[name] = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "prompt": "Hello there", "max_tokens": 20, "ignore_eos": True, **body})

        posts = [threading.Thread(target=post, args=a) for a in (
            ("good", {}), ("bad", bad), ("bad_stream", {**bad, "stream": True}),
            ("good_stream", {"stream": True}))]
        for p in posts:
            p.start()
        for p in posts:
            p.join()
        assert results["bad"].status_code == 500
        assert message in results["bad"].json()["error"]["message"]
        assert results["bad_stream"].status_code == 200  # headers went out before the fault
        assert '"code": 500' in results["bad_stream"].text
        assert results["good"].status_code == 200
        assert results["good"].json()["usage"]["completion_tokens"] == 20
        assert results["good_stream"].text.count('"text"') >= 20
        assert httpx.get(f"{url}/health").status_code == 200
        deadline = time.monotonic() + 10  # the failed requests' KV blocks come back
        while True:
            stats = engine.stats
            if stats.num_free_blocks == stats.num_blocks and stats.num_running == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)


@pytest.mark.parametrize("engine_kind", ["thread", "process"])
def test_a_fault_in_one_request_fails_that_request_only(tiny_model, monkeypatch, engine_kind):
    """A detokenizer that raises for one request: that request gets a 500 (an SSE error
    event when streaming); the other requests, /health and the KV pool are unharmed."""
    from cpullm.engine import detokenizer

    update = detokenizer.IncrementalDetokenizer.update

    def faulty_update(self, new_token_ids, skip_last):  # fault injection: one request's
        if "BOOM" in self.stop:
            raise RuntimeError("injected detokenizer fault")
        return update(self, new_token_ids, skip_last)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", faulty_update)
    config = EngineArgs(model=str(tiny_model("llama")), dtype="float32", block_size=32,
                        max_model_len=512).create_engine_config()
    engine = AsyncEngine(config, Frontend(config), multiprocess=engine_kind == "process")
    assert_one_request_fails(engine, {"stop": ["BOOM"]}, "injected detokenizer fault")


def test_a_fault_in_one_requests_sampling_fails_that_request_only(tiny_model, monkeypatch):
    """The sampler raising inside the engine step for one request (of a batch of four):
    that request gets a 500 (an SSE error event when streaming), the others their tokens;
    /health and the KV pool are unharmed."""
    from cpullm.worker import sampler

    penalties = sampler.Sampler._apply_penalties

    def faulty_penalties(self, logits, batch):  # fault injection: one request's sampling
        if any(p.presence_penalty == 1.5 for p in batch.params):
            raise RuntimeError("injected sampler fault")
        return penalties(self, logits, batch)

    monkeypatch.setattr(sampler.Sampler, "_apply_penalties", faulty_penalties)
    engine = engine_on_a_thread(tiny_model)
    assert_one_request_fails(engine, {"presence_penalty": 1.5}, "injected sampler fault")
