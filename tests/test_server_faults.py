"""An engine failure answers 500 and shows in /health instead of hanging the server."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from server_utils import free_port

from cpullm.engine.async_engine import AsyncEngine
from cpullm.engine.llm_engine import LLMEngine
from cpullm.engine_args import EngineArgs
from cpullm.entrypoints.openai.api_server import build_app


def test_engine_failure_fails_requests_and_health(tiny_model):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model("llama")), dtype="float32", block_size=32, max_model_len=512))

    def broken_forward(scheduler_output):  # fault injection into the real engine
        raise RuntimeError("injected fault")

    engine.model_runner.execute = broken_forward
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(AsyncEngine(engine), "m"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
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
    finally:
        server.should_exit = True
        thread.join(timeout=10)
