"""The real server on loopback, driven by the official openai client."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import time

import httpx
import openai
import pytest
from server_utils import RemoteServer

from cpullm import LLM, SamplingParams

SERVER_ARGS = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
               "--seed", "0"]
PROMPTS = ["Hello, my name is", "The capital of France is", "In a hole in the ground",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RemoteServer([model_dir, *SERVER_ARGS])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline_llm(model_dir):
    return LLM(model_dir, dtype="float32", block_size=32, max_model_len=512)


@pytest.fixture(scope="module")
def offline(offline_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return {o.prompt: o.outputs[0] for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)}


def test_models(client, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [model_dir]


def test_completion_equals_offline_generate(client, model_dir, offline):
    for prompt in PROMPTS:
        result = client.completions.create(model=model_dir, prompt=prompt, max_tokens=24,
                                           temperature=0, extra_body={"ignore_eos": True})
        choice = result.choices[0]
        assert choice.text == offline[prompt].text
        assert choice.finish_reason == "length"
        assert result.usage.completion_tokens == 24
        assert result.usage.prompt_tokens == len(offline_prompt_ids(client, prompt))
        assert result.usage.total_tokens == result.usage.prompt_tokens + 24


def offline_prompt_ids(client, prompt):
    response = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                          json={"prompt": prompt})
    return response.json()["tokens"]


def test_streaming_is_incremental_and_matches(client, server, model_dir, offline):
    prompt = PROMPTS[1]
    stream = client.completions.create(model=model_dir, prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        pieces.extend(c.text for c in chunk.choices)
    assert len(pieces) > 10
    assert "".join(pieces) == offline[prompt].text
    assert usage.completion_tokens == 24

    # The first chunk arrives while the request is still running.
    long = client.completions.create(model=model_dir, prompt=prompt, max_tokens=400,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    first = next(iter(long))
    assert first.choices[0].text
    assert server.metrics()["vllm:num_requests_running"] == 1
    long.close()
    server.wait_idle()


def test_chat_stream_matches_non_stream(client, model_dir):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    full = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=20,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_dir, messages=messages, max_tokens=20,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_seed_logprobs_stop(client, model_dir, offline):
    kwargs = dict(model=model_dir, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=3,
                  n=3, logprobs=2, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    logprobs = first.choices[0].logprobs
    assert len(logprobs.tokens) == 12 and len(logprobs.top_logprobs[0]) == 2
    assert all(lp <= 0 for lp in logprobs.token_logprobs)

    text = offline[PROMPTS[2]].text
    stop = text[6:10]
    result = client.completions.create(model=model_dir, prompt=PROMPTS[2], max_tokens=24,
                                       temperature=0, stop=[stop])
    assert result.choices[0].text == text[:text.index(stop)]
    assert result.choices[0].finish_reason == "stop"

    chat = client.chat.completions.create(
        model=model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)


def test_32_concurrent_streams(server, model_dir, offline):
    async def one(client, prompt):
        stream = await client.completions.create(
            model=model_dir, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % 4]) for i in range(32)))

    for prompt, text in asyncio.run(run()):
        assert text == offline[prompt].text
    server.wait_idle()


def test_client_disconnects_free_blocks(server, model_dir):
    before = server.finished_by_reason()
    body = {"model": model_dir, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # Non-streaming: the client hangs up while its request is running.
    payload = json.dumps({**body, "stream": False, "n": 4}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(payload), payload))
        deadline = time.monotonic() + 10
        while server.metrics()["vllm:num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    m = server.wait_idle()
    after = server.finished_by_reason()  # aborted, not finished: vLLM's "abort" reason
    assert after["abort"] == before["abort"] + 2
    assert +(after - before) == collections.Counter({"abort": 2})
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    ok = httpx.post(f"{server.url}/v1/completions",
                    json={"model": model_dir, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200


BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", {"prompt": 5, "max_tokens": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"prompt": "hi " * 600, "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 30}, 400),
    ("/v1/no-such-route", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_input_gets_openai_error(server, model_dir, path, body, status):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = httpx.post(f"{server.url}{path}", headers={"content-type": "application/json"},
                          timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    ok = httpx.post(f"{server.url}/v1/completions",
                    json={"model": model_dir, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_tokenize_detokenize_version(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    assert httpx.get(f"{server.url}/version").json()["version"]
    metrics = server.metrics()
    assert metrics["vllm:generation_tokens_total"] > 0
    assert metrics["vllm:time_to_first_token_seconds_count"] > 0


def test_api_key_and_graceful_shutdown(model_dir):
    # vLLM's flags: several keys, and request logging switched on
    srv = RemoteServer([model_dir, *SERVER_ARGS, "--enable-log-requests",
                        "--api-key", "sekret", "other"])
    try:
        denied = httpx.get(f"{srv.url}/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"},
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        for key in ("sekret", "other"):
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
            assert client.models.list().data[0].id == model_dir
        assert client.completions.create(model=model_dir, prompt="x", max_tokens=1).choices
        assert httpx.get(f"{srv.url}/health").status_code == 200  # not under /v1
    finally:
        assert srv.stop() == 0
    assert "completion request: n=1 max_tokens=1" in srv.log()
    with socket.socket() as s:  # no listener holds the port (as a new server would bind it)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", srv.port))
        s.listen()


def test_cache_salt_keeps_tenants_prefixes_apart(server, client, model_dir):
    prompt = [(7 * i) % 500 + 1 for i in range(100)]  # three full 32-token blocks

    def hits_after(salt: str | None) -> float:
        before = server.metrics()["vllm:prefix_cache_hits_total"]
        extra = {} if salt is None else {"cache_salt": salt}
        client.completions.create(model=model_dir, prompt=prompt, max_tokens=1,
                                  extra_body=extra)
        return server.metrics()["vllm:prefix_cache_hits_total"] - before

    hits_after("tenant-a")  # computes and caches the prompt under tenant a's salt
    assert hits_after("tenant-b") == 0  # another tenant finds nothing
    assert hits_after(None) == 0  # nor does a request without a salt
    assert hits_after("tenant-a") == 96  # the same tenant finds its three blocks
    assert hits_after(None) == 96  # unsalted requests share among themselves
    for bad in ("", "x" * 1025, 5):
        response = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": model_dir, "prompt": "hi", "max_tokens": 1, "cache_salt": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "cache_salt"
    chat = client.chat.completions.create(
        model=model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"cache_salt": "tenant-a"})
    assert chat.choices[0].finish_reason == "length"


def test_streamed_events_stay_one_line_for_naive_clients(server, model_dir):
    """Text with U+2028, U+2029 or U+0085 (JSON leaves them as they are) is escaped in the
    stream, so that a client splitting lines as str.splitlines does (httpx's iter_lines)
    still reads every event whole."""
    prompt = "Line\u2028separator, paragraph\u2029separator and next\x85line"
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
            "model": model_dir, "prompt": prompt, "echo": True, "max_tokens": 2,
            "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]  # each line is a whole event
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(prompt)
