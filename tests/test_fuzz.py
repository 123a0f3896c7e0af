"""The server's own OpenAPI schema, fuzzed by schemathesis against a live `cpullm serve`:
whatever the schema allows (and much it does not), no 5xx and no hang, and every 4xx in
OpenAI's error shape."""

from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_utils import RemoteServer

MAX_EXAMPLES = 40  # per operation: the whole run stays near a minute


@pytest.fixture(scope="module")
def fuzzed_server(tiny_model):
    server = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len",
                           "256", "--max-num-seqs", "8", "--block-size", "32"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


def check_error(response) -> None:
    """A 4xx body is the route's API's error object: Anthropic's on /v1/messages, else
    OpenAI's, with the status as its code."""
    if httpx.URL(str(response.request.url)).path.startswith("/v1/messages"):
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
        return
    check_openai_error(response)


def check_openai_error(response) -> None:
    """A 4xx body is OpenAI's error object, with the status as its code."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error.get("message"), str) and error["message"], body
    assert isinstance(error.get("type"), str) and error.get("code") == response.status_code, body
    assert "Traceback" not in error["message"]


OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
              "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /tokenize",
              "POST /detokenize", "GET /v1/models", "GET /health", "GET /version", "GET /"]
# routes that translate to another's request: fewer examples each
TRANSLATED = ("POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens")


CASES = [(label, mode) for label in OPERATIONS for mode in ("positive", "negative")
         if mode == "positive" or label.startswith("POST")]  # GETs take no input to break


@pytest.mark.parametrize("label,mode", CASES)
def test_fuzzed_requests_get_no_server_error(label, mode, api_schema, fuzzed_server):
    """Requests the schema allows (positive) and requests it does not (negative): an
    answer below 500 to each, a 4xx always OpenAI's error object. A schema route that
    refuses most of what it allows is a schema that does not state its constraints: a third
    at least of the positive cases of each POST route succeed (the rest break rules between
    fields, such as min_tokens <= max_tokens, which a schema cannot state)."""
    fuzz_operation(api_schema, fuzzed_server, label, mode)


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):
    """A tiny random BERT encoder (the default embedding model's tokenizer)."""
    import transformers
    from transformers import AutoTokenizer

    from cpullm.transformers_utils import default_embedding_model_path

    path = tmp_path_factory.mktemp("fuzz-bert")
    tokenizer = AutoTokenizer.from_pretrained(default_embedding_model_path())
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    server = RemoteServer([str(path), "--dtype", "float32"])
    yield server
    server.stop()


@pytest.mark.parametrize("label,mode", [(label, mode) for label in (
    "POST /v1/embeddings", "POST /score", "POST /rerank") for mode in ("positive", "negative")])
def test_fuzzed_pooling_requests_get_no_server_error(label, mode, pooling_server):
    """The same for an embedding server's routes."""
    schema = schemathesis.openapi.from_url(f"{pooling_server.url}/openapi.json")
    fuzz_operation(schema, pooling_server, label, mode)


def fuzz_operation(api_schema, server, label: str, mode: str) -> None:
    operation = api_schema.find_operation_by_label(label)
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=MAX_EXAMPLES // 4 if label in TRANSLATED else MAX_EXAMPLES,
              deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def call(case) -> None:
        response = case.call(base_url=server.url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.status_code,
                                             response.text[:500])
        if 400 <= response.status_code < 500:
            check_error(response)

    call()
    assert statuses
    if mode == "positive" and label.startswith("POST"):
        accepted = sum(200 <= status < 300 for status in statuses)
        assert accepted >= len(statuses) // 3, collections.Counter(statuses)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def _nested(depth: int) -> str:
    return '{"prompt": ' + "[" * depth + "1" + "]" * depth + ', "max_tokens": 2}'


# (route, raw body or JSON value, content type, expected status: an int, or None for "any
# answer below 500"). Every 4xx must be OpenAI's error object.
NASTY = [
    ("/v1/completions", {"prompt": "\U0001F600 \u202e\u0301 \u4e2d\u6587", "max_tokens": 2},
     "application/json", 200),
    ("/v1/completions", '{"prompt": "lone \\ud800 surrogate", "max_tokens": 2}',
     "application/json", None),
    ("/v1/completions", {"prompt": "nul \u0000 byte", "max_tokens": 2}, "application/json", 200),
    ("/tokenize", '{"prompt": "\\udfff"}', "application/json", None),
    ("/v1/completions", {"prompt": "x" * (10 << 20), "max_tokens": 2}, "application/json", 400),
    ("/v1/completions", _nested(100_000), "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "n": 10**9}, "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "n": 10**30}, "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**9}, "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**63}, "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, "application/json", 400),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, "application/json", 400),
    ("/v1/completions", {"prompt": [-1, 5], "max_tokens": 2}, "application/json", 400),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 2}, "application/json", 400),
    ("/detokenize", {"tokens": [10**12]}, "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "stop": [], "max_tokens": 2}, "application/json", 200),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(1000)],
                         "max_tokens": 2}, "application/json", 200),
    ("/v1/completions", {"prompt": "hi", "stop": [""], "max_tokens": 2}, "application/json",
     None),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "application/json", 400),
    ("/v1/completions", '{"prompt": "hi", "top_p": Infinity}', "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70, "max_tokens": 2}, "application/json",
     400),
    ("/v1/completions", {"prompt": "hi", "seed": -1, "max_tokens": 2}, "application/json",
     None),
    ("/v1/completions", {"prompt": "hi", "top_k": 10**9, "max_tokens": 2}, "application/json",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_k": 2**63 - 1, "max_tokens": 2}, "application/json", 200),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_k": 2**64, "max_tokens": 2}, "application/json", 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1e308}, "max_tokens": 2},
     "application/json", None),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 1e30}, "application/json", 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}] * 10_000}], "max_tokens": 2}, "application/json", None),
    ("/v1/completions", "null", "application/json", 400),
    ("/v1/completions", "[1, 2]", "application/json", 400),
    ("/v1/completions", '{"prompt": "hi"}', "text/plain", None),
    ("/v1/completions", "prompt=hi&max_tokens=2", "application/x-www-form-urlencoded", 400),
    ("/v1/completions", b"\xff\xfe\x00garbage", "application/json", 400),
]


@pytest.mark.parametrize("case", range(len(NASTY)),
                         ids=[f"{i}-{r.strip('/').replace('/', '_')}"
                              for i, (r, *_) in enumerate(NASTY)])
def test_nasty_inputs_get_a_clean_answer(case, fuzzed_server):
    import json

    route, body, content_type, expected = NASTY[case]
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    response = httpx.post(f"{fuzzed_server.url}{route}", content=content, timeout=120,
                          headers={"content-type": content_type})
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if expected is not None:
        assert response.status_code == expected, response.text[:300]
    if response.status_code >= 400:
        check_openai_error(response)
    assert httpx.get(f"{fuzzed_server.url}/health", timeout=10).status_code == 200


def test_a_chunked_body_is_read_whole(fuzzed_server):
    def chunks():
        yield b'{"prompt": "hel'
        yield b'lo", "max_tokens": 2}'

    response = httpx.post(f"{fuzzed_server.url}/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    fuzzed_server.wait_idle()
