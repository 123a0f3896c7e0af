"""The server's guards: the API key on every route that touches the model, a request body
limit, CORS only when asked for, chat templates in a sandbox, no pickle weights."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest
import torch
from server_utils import RemoteServer

KEY = {"Authorization": "Bearer sekret"}
ORIGIN = "https://app.example"
# A template that reaches from a string to Python's internals, as a hostile one would.
HOSTILE_TEMPLATE = "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ messages[0]['content'] }}"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "hostile.jinja"
    template.write_text(HOSTILE_TEMPLATE)
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len", "512",
                        "--api-key", "sekret", "--max-request-body-bytes", "4096",
                        "--allowed-origins", json.dumps([ORIGIN]),
                        "--chat-template", str(template)])
    yield srv
    srv.stop()


def test_api_key_guards_the_model_routes_only(server):
    for method, path, body in (("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("GET", "/v1/models", None),
                               ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [1, 2]})):
        denied = httpx.request(method, f"{server.url}{path}", json=body)
        assert denied.status_code == 401, path
        allowed = httpx.request(method, f"{server.url}{path}", json=body, headers=KEY)
        assert allowed.status_code == 200, (path, allowed.text)
    for path in ("/health", "/metrics", "/version"):  # open, as documented
        assert httpx.get(f"{server.url}{path}").status_code == 200


def test_request_body_limit(server):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=big, headers=KEY)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the limit holds as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'", "max_tokens": 1}'

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                          headers={**KEY, "Content-Type": "application/json"})
    assert response.status_code == 413
    small = httpx.post(f"{server.url}/v1/completions", headers=KEY,
                       json={"prompt": "x" * 100, "max_tokens": 1})
    assert small.status_code == 200


def test_cors_only_for_the_allowed_origins(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    response = httpx.options(f"{server.url}/v1/completions", headers=preflight)
    assert response.headers.get("access-control-allow-origin") == ORIGIN
    response = httpx.options(f"{server.url}/v1/completions",
                             headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


def test_cors_is_off_by_default(tiny_model):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len", "512"])
    try:
        response = httpx.post(f"{srv.url}/v1/completions", headers={"Origin": ORIGIN},
                              json={"prompt": "x", "max_tokens": 1})
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers
    finally:
        srv.stop()


def test_a_hostile_chat_template_fails_cleanly(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=KEY, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "chat template failed" in error["message"]
    assert "is unsafe" in error["message"]  # the sandbox refused the attribute
    assert "Traceback" not in response.text and "/site-packages/" not in response.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_pickle_weights_are_refused(tiny_model, tmp_path):
    from cpullm.engine_args import EngineArgs

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model("llama"), folder)
    for weights in folder.glob("*.safetensors"):
        weights.rename(weights.with_name("pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"only as PyTorch pickle files \(pytorch_model.bin\)"):
        EngineArgs(model=str(folder), dtype="float32").create_engine_config()


class _RunsCode:
    """What a hostile pickle carries: unpickling it calls ``Path.touch`` on a marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_pickle_weights_load_only_when_asked_and_only_as_tensors(tiny_model, tmp_path):
    """--load-format pt loads a folder's pytorch_model.bin (the tokens of its safetensors);
    a pickle that carries code is refused by the weights-only unpickler, and its code
    never runs."""
    from safetensors.torch import load_file

    from cpullm import LLM, SamplingParams
    from cpullm.engine_args import EngineArgs

    source = tiny_model("llama")
    folder = tmp_path / "pickled"
    shutil.copytree(source, folder)
    state = {}
    for weights in folder.glob("*.safetensors"):
        state.update(load_file(weights))
        weights.unlink()
    torch.save(state, folder / "pytorch_model.bin")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    def tokens(model: str, **kwargs) -> list[int]:
        llm = LLM(model, dtype="float32", max_model_len=256, **kwargs)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    assert tokens(str(folder), load_format="pt") == tokens(str(source))
    with pytest.raises(ValueError, match="has no PyTorch pickle files"):
        EngineArgs(model=str(source), load_format="pt").create_engine_config()
    with pytest.raises(ValueError, match="--load-format gguf does not match"):
        EngineArgs(model=str(source), load_format="gguf").create_engine_config()

    marker = tmp_path / "code-ran"
    torch.save({"model.embed_tokens.weight": _RunsCode(str(marker))},
               folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot load pytorch_model.bin as weights only"):
        LLM(str(folder), dtype="float32", max_model_len=256, load_format="pt")
    assert not marker.exists()


def test_overload_is_refused_at_once_with_503(tiny_model):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len", "512",
                        "--max-num-seqs", "2", "--max-waiting-requests", "1"])
    try:
        responses: list[httpx.Response] = []

        def post() -> None:
            responses.append(httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
                "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}))

        clients = [threading.Thread(target=post) for _ in range(8)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        refused = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(served) >= 3 and refused and len(served) + len(refused) == 8
        for response in refused:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == 503
            assert "at capacity" in response.json()["error"]["message"]
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in served)
        metrics = srv.wait_idle()
        assert metrics["cpullm:requests_rejected_overload_total"] == len(refused)
        assert httpx.post(f"{srv.url}/v1/completions", timeout=30,
                          json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_ends_every_open_request_cleanly(tiny_model, sig):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32",
                        "--max-model-len", "1024"])
    ends: list[str] = []
    running = threading.Semaphore(0)  # released by each stream at its first event

    def stream() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60, json={
                "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}) as response:
            chunks = response.iter_text()
            first = next(chunks)
            running.release()
            ends.append(first + "".join(chunks))

    clients = [threading.Thread(target=stream) for _ in range(16)]
    for client in clients:
        client.start()
    for _ in clients:  # every stream has begun and has ~1000 tokens to go
        assert running.acquire(timeout=60)
    start = time.monotonic()
    assert srv.stop(getattr(signal, sig)) == 0
    assert time.monotonic() - start < 10
    for client in clients:
        client.join()
    assert len(ends) == 16
    for text in ends:  # every stream ended with an error event (or had finished), then [DONE]
        assert text.rstrip().endswith("data: [DONE]")
        assert '"finish_reason": "length"' in text or "the server is shutting down" in text
    assert any("the server is shutting down" in text for text in ends)
    assert "Traceback" not in srv.log()


def test_shutdown_timeout_lets_running_requests_finish(tiny_model):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32",
                        "--max-model-len", "512", "--shutdown-timeout", "30"])
    results: list[httpx.Response] = []
    started = threading.Event()

    def post() -> None:
        started.set()
        results.append(httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 300, "ignore_eos": True}))

    client = threading.Thread(target=post)
    client.start()
    started.wait()
    time.sleep(0.3)  # the request is running
    assert srv.stop(signal.SIGTERM) == 0
    client.join()
    assert results[0].status_code == 200
    assert results[0].json()["usage"]["completion_tokens"] == 300


def test_a_stalled_request_body_is_timed_out(tiny_model):
    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len", "512",
                        "--request-body-timeout", "1"])
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"prompt": ')  # ... and nothing more
            start = time.monotonic()
            answer = conn.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408")
        assert 0.5 < time.monotonic() - start < 5
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()
