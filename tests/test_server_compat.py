"""What OpenAI and vLLM clients rely on beyond the basics: when the first streamed chunk
leaves, refused and ignored fields, echo without generation, vLLM's metric families."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import RemoteServer

from cpullm import LLM, SamplingParams

# Small steps: a long prompt then takes several of them, so its prefill time is far above
# the time it takes to send a chunk.
SERVER_ARGS = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
               "--seed", "0", "--max-num-batched-tokens", "32"]
USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RemoteServer(["--model", model_dir, *SERVER_ARGS])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_value(family, suffix: str) -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix)


def test_root_points_at_the_routes(server, model_dir):
    body = httpx.get(f"{server.url}/").json()
    assert body["model"] == model_dir
    assert {"/docs", "/v1/models", "/health"} <= set(body["routes"].values())


def test_chat_stream_first_chunk_carries_the_first_token(server, client, model_dir):
    full = client.chat.completions.create(model=model_dir, messages=USER, max_tokens=8,
                                          temperature=0, logprobs=True)
    first_token = full.choices[0].logprobs.content[0].token
    stream = client.chat.completions.create(model=model_dir, messages=USER, max_tokens=8,
                                            temperature=0, logprobs=True, stream=True)
    chunks = [c for c in stream if c.choices]
    head = chunks[0].choices[0]
    assert head.delta.role == "assistant"
    # The first chunk was sent after the first token was computed: it carries that token.
    assert [t.token for t in head.logprobs.content] == [first_token]
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content


def test_chat_stream_first_chunk_waits_for_the_prompt(server, model_dir):
    """A long prompt: the first chunk arrives no sooner than the engine's own prefill time
    of that request (the metric's sum grows by exactly that request's prefill)."""
    messages = [{"role": "user", "content": "word " * 440}]
    before = sample_value(families(server)["vllm:request_prefill_time_seconds"], "_sum")
    body = {"model": model_dir, "messages": messages, "max_tokens": 2, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = next(lines)
        first_chunk_s = time.perf_counter() - start
        rest = list(lines)
    assert '"role": "assistant"' in first and rest[-1] == "data: [DONE]"
    server.wait_idle()
    prefill_s = sample_value(families(server)["vllm:request_prefill_time_seconds"],
                             "_sum") - before
    assert prefill_s > 0
    assert first_chunk_s >= prefill_s


REFUSED = [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    # tools with "auto" (their default) on a server without --enable-auto-tool-choice
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {"suffix": "and so on"}, "suffix"),
]


@pytest.mark.parametrize("path,fields,name", REFUSED)
def test_unimplemented_fields_are_refused_by_name(server, model_dir, path, fields, name):
    body = {"model": model_dir, "max_tokens": 2, **fields,
            **({"messages": USER} if "chat" in path else {"prompt": "hi"})}
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and name in error["message"]


def test_servable_values_of_refused_fields_pass(client, model_dir):
    reply = client.chat.completions.create(
        model=model_dir, messages=USER, max_tokens=3, response_format={"type": "text"},
        tools=[], tool_choice="none")
    assert reply.choices[0].finish_reason == "length"


def test_images_to_a_text_model_and_other_parts_are_refused(server, model_dir):
    """An image part to a model that takes none, and a part of a kind no model here takes
    (audio): a 400 that says so."""
    for part, says in [({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        "takes no images"),
                       ({"type": "input_audio", "input_audio": {"data": "AAAA"}}, "input_audio")]:
        messages = [{"role": "user", "content": [part]}]
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                              json={"model": model_dir, "messages": messages})
        assert response.status_code == 400
        assert says in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def prompt_logprobs(model_dir):
    llm = LLM(model_dir, dtype="float32", block_size=32, max_model_len=512)
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs


def test_echo_with_max_tokens_0_returns_the_prompt_logprobs(client, model_dir,
                                                            prompt_logprobs):
    prompt = "The capital of France is"
    ids, expected = prompt_logprobs
    result = client.completions.create(model=model_dir, prompt=prompt, echo=True,
                                       max_tokens=0, logprobs=2)
    choice = result.choices[0]
    assert choice.text == prompt
    assert result.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [entry[token].logprob for token, entry in zip(ids[1:], expected[1:], strict=True)],
        abs=1e-5)
    assert [len(top) for top in lp.top_logprobs[1:]] == [2] * (len(ids) - 1)

    stream = client.completions.create(model=model_dir, prompt=prompt, echo=True,
                                       max_tokens=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == prompt


def test_continuous_usage_stats(client, model_dir):
    stream = client.completions.create(
        model=model_dir, prompt="Once upon a time", max_tokens=5, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 5


VLLM_FAMILIES = {
    # name: (type, a bucket bound that must be there, or None)
    "vllm:request_queue_time_seconds": ("histogram", "0.3"),
    "vllm:request_prefill_time_seconds": ("histogram", "0.3"),
    "vllm:request_decode_time_seconds": ("histogram", "0.3"),
    "vllm:request_inference_time_seconds": ("histogram", "0.3"),
    "vllm:e2e_request_latency_seconds": ("histogram", "7680.0"),
    "vllm:time_to_first_token_seconds": ("histogram", "0.001"),
    "vllm:inter_token_latency_seconds": ("histogram", "0.01"),
    "vllm:request_prompt_tokens": ("histogram", "500.0"),
    "vllm:request_generation_tokens": ("histogram", "500.0"),
    "vllm:request_params_n": ("histogram", "20.0"),
    "vllm:request_params_max_tokens": ("histogram", "500.0"),
    "vllm:iteration_tokens_total": ("histogram", "16384.0"),
    "vllm:cache_config_info": ("gauge", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:num_requests_running": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
}


def test_vllm_metric_families_parse_and_move(server, client, model_dir):
    before = families(server)
    for name, (kind, bucket) in VLLM_FAMILIES.items():
        family = before[name.removesuffix("_total") if kind == "counter" else name]
        assert family.type == kind, name
        if bucket is not None:
            assert bucket in {s.labels.get("le") for s in family.samples}, name
    info = before["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "32"
    assert info.labels["engine"] == "0"
    queue = before["vllm:request_queue_time_seconds"].samples[0]
    assert queue.labels["model_name"] == model_dir and queue.labels["engine"] == "0"

    prompt_ids = list(range(100, 130))
    client.completions.create(model=model_dir, prompt=prompt_ids, max_tokens=7, n=2,
                              extra_body={"ignore_eos": True})
    after = families(server)

    def grew(name: str, suffix: str) -> float:
        return sample_value(after[name], suffix) - sample_value(before[name], suffix)

    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_params_n",
                 "vllm:request_params_max_tokens"):
        assert grew(name, "_count") == 1, name
    assert grew("vllm:request_prompt_tokens", "_sum") == 30
    assert grew("vllm:request_generation_tokens", "_sum") == 14
    assert grew("vllm:request_params_n", "_sum") == 2
    assert grew("vllm:request_params_max_tokens", "_sum") == 7
    assert grew("vllm:request_decode_time_seconds", "_sum") > 0
    # one prompt step (30 tokens for one sample, 30 for the other) and six decode steps
    assert grew("vllm:iteration_tokens_total", "_count") >= 7
    assert grew("vllm:iteration_tokens_total", "_sum") == 30 * 2 + 6 * 2


def test_unknown_fields_are_served_and_named_once(server, model_dir):
    body = {"model": model_dir, "messages": USER, "max_tokens": 2, "frobnicate": True,
            "user": "someone"}
    for _ in range(2):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200
    deadline = time.monotonic() + 5
    while "frobnicate" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    warnings = [line for line in server.log().splitlines() if "frobnicate" in line]
    assert len(warnings) == 1, warnings
    assert "WARNING" in warnings[0] and "/v1/chat/completions" in warnings[0]


def test_prompt_logprobs_in_the_answer(server, client, model_dir, prompt_logprobs):
    ids, expected = prompt_logprobs
    result = client.completions.create(model=model_dir, prompt=ids, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2})
    got = result.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for token, entry, want in zip(ids[1:], got[1:], expected[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == want[token].rank
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": model_dir, "messages": USER, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 5
    streamed = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": model_dir, "prompt": "hi", "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


def test_docs_list_every_request_field():
    """docs/api.md names every field each route reads, refused ones included."""
    from pathlib import Path

    from cpullm.entrypoints.openai import protocol

    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    sections = {"completions": text.split("## POST /v1/completions")[1].split("\n## ")[0],
                "chat": text.split("## POST /v1/chat/completions")[1].split("\n## ")[0],
                "tokenize": text.split("## POST /tokenize")[1].split("\n## ")[0]}
    for section, models in (("completions", [protocol.CompletionRequest]),
                            ("chat", [protocol.ChatCompletionRequest, protocol.ChatMessage]),
                            ("tokenize", [protocol.TokenizeCompletionRequest,
                                          protocol.TokenizeChatRequest,
                                          protocol.DetokenizeRequest])):
        for model in models:
            for name in [*model.model_fields, *getattr(model, "REFUSED", {})]:
                assert f"`{name}`" in sections[section], (section, name)
