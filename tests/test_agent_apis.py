"""OpenAI's Responses API and Anthropic's Messages API, through the official clients against
the real server: each answer as /v1/chat/completions gives it for the same conversation,
streams that add up to the whole answer, stored conversations, tool-call round trips, and
bad input answered in each API's own error shape."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pydantic
import pytest

from cpullm.entrypoints.openai.serving_engine import OpenAIError
from cpullm.entrypoints.openai.serving_responses import ResponseStore, input_messages

KEY = "secret-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
FUNCTION = {"type": "function", "name": "get_weather", "description": "A city's weather",
            "parameters": WEATHER}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "A city's weather",
                  "input_schema": WEATHER}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server():
    from server_utils import RemoteServer

    srv = RemoteServer(["--max-model-len", "2048", "--served-model-name", "default",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--api-key", KEY, "--responses-store-size", "4"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)


@pytest.fixture(scope="module")
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=KEY)


def chat_text(client, messages, max_tokens, **extra) -> tuple[str, object]:
    response = client.chat.completions.create(model="default", messages=messages,
                                              max_tokens=max_tokens, temperature=0, **extra)
    return response.choices[0].message.content, response


# ---- /v1/responses

def test_a_response_is_the_chat_answer(openai_client):
    response = openai_client.responses.create(
        model="default", instructions="Answer briefly.", input=ASK, max_output_tokens=12,
        temperature=0)
    text, chat = chat_text(openai_client, [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": ASK}], 12)
    assert response.output_text == text
    assert response.status == "incomplete" and chat.choices[0].finish_reason == "length"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == chat.usage.total_tokens


def test_a_streamed_response_adds_up_to_the_whole(openai_client):
    whole = openai_client.responses.create(model="default", input=ASK, max_output_tokens=16,
                                           temperature=0)
    with openai_client.responses.stream(model="default", input=ASK, max_output_tokens=16,
                                        temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_parse_holds_the_answer_to_a_pydantic_model(openai_client):
    class City(pydantic.BaseModel):
        name: str
        population: int

    response = openai_client.responses.parse(model="default", input="Describe a city.",
                                             text_format=City, max_output_tokens=100)
    assert isinstance(response.output_parsed, City)


def test_previous_response_id_continues_the_conversation(openai_client):
    first = openai_client.responses.create(model="default", input="Name a color.",
                                           max_output_tokens=8, temperature=0)
    second = openai_client.responses.create(model="default", input="And another one?",
                                            previous_response_id=first.id,
                                            max_output_tokens=8, temperature=0)
    text, chat = chat_text(openai_client, [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"}], 8)
    assert second.previous_response_id == first.id
    assert second.output_text == text
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_a_function_call_round_trip(openai_client):
    first = openai_client.responses.create(
        model="default", input=ASK, tools=[FUNCTION], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = openai_client.responses.create(
        model="default", previous_response_id=first.id, tools=[FUNCTION], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "18 C and sunny"}], max_output_tokens=10)
    assert second.output_text and not any(i.type == "function_call" for i in second.output)
    # the whole conversation given instead of the stored one: the same prompt
    third = openai_client.responses.create(
        model="default", tools=[FUNCTION], tool_choice="none", max_output_tokens=10,
        input=[{"role": "user", "content": ASK}, calls[0].model_dump(),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "18 C and sunny"}])
    assert third.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_call_arguments_come_in_fragments(openai_client):
    with openai_client.responses.stream(
            model="default", input=ASK, tools=[FUNCTION],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=100) as stream:
        events = list(stream)
        final = stream.get_final_response()
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(fragments) > 1 and len(done) == 1
    assert "".join(fragments) == done[0].arguments == final.output[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)


def test_prompt_tokens_from_the_prefix_cache_are_reported(openai_client, anthropic_client):
    """A prompt asked twice: the second time its whole 128-token blocks come from the
    prefix cache, as both APIs' usage says."""
    system = "You answer questions about the weather, briefly and politely. " * 30
    for _ in range(2):
        response = openai_client.responses.create(model="default", instructions=system,
                                                  input=ASK, max_output_tokens=2)
        message = anthropic_client.messages.create(
            model="default", system=system, max_tokens=2,
            messages=[{"role": "user", "content": ASK}])
    for cached, total in ((response.usage.input_tokens_details.cached_tokens,
                           response.usage.input_tokens),
                          (message.usage.cache_read_input_tokens, message.usage.input_tokens)):
        assert total > 256 and cached == (total - 1) // 128 * 128


def test_stored_responses_can_be_read_and_deleted(openai_client):
    import openai

    response = openai_client.responses.create(model="default", input="Hi", max_output_tokens=4)
    assert openai_client.responses.retrieve(response.id).output_text == response.output_text
    openai_client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(response.id)
    unstored = openai_client.responses.create(model="default", input="Hi", max_output_tokens=4,
                                              store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model="default", input="More",
                                       previous_response_id=unstored.id)


@pytest.mark.parametrize("body,param,message", [
    ({"tools": [{"type": "web_search"}]}, "tools", "the web_search tool is not supported"),
    ({"background": True}, "background", "background is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "'input_image' are not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "only none, auto, required"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
    ({"max_output_tokens": 5000}, "max_tokens", "maximum context length"),
])
def test_bad_responses_requests_get_openai_errors(server, body, param, message):
    response = httpx.post(f"{server.url}/v1/responses", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "default", "input": "Hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_an_unknown_previous_response_is_a_404(server):
    response = httpx.post(f"{server.url}/v1/responses", timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"input": "Hi", "previous_response_id": "resp-nope"})
    assert response.status_code == 404
    assert "resp-nope" in response.json()["error"]["message"]


def test_the_store_keeps_the_newest_for_a_while():
    store = ResponseStore(max_entries=2, ttl=0.5)
    for name in ("a", "b", "c"):
        store.put({"id": name}, [])
    with pytest.raises(OpenAIError, match="'a' not found"):
        store.get("a")
    assert store.get("c").response == {"id": "c"} and len(store) == 2
    time.sleep(0.6)
    with pytest.raises(OpenAIError, match="not found"):
        store.get("c")
    assert len(store) == 0


def test_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
    messages = input_messages([
        {"role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"type": "message", "role": "user", "content": "Go"},
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Calling."}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}])
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool"]
    assert messages[0]["content"] == "Be terse." and messages[2]["content"] == "Calling."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}


# ---- /v1/messages

# (sampling fields that newer clients no longer name, as older ones and vLLM's clients send)
GREEDY = {"extra_body": {"temperature": 0}}


def test_a_message_is_the_chat_answer(openai_client, anthropic_client):
    message = anthropic_client.messages.create(
        model="default", system="Answer briefly.", max_tokens=12,
        messages=[{"role": "user", "content": ASK}], **GREEDY)
    text, chat = chat_text(openai_client, [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": ASK}], 12)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.stop_reason == "max_tokens" and message.role == "assistant"
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == 12
    counted = anthropic_client.messages.count_tokens(
        model="default", system="Answer briefly.", messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == message.usage.input_tokens


def test_a_stop_sequence_is_named(anthropic_client):
    whole = anthropic_client.messages.create(model="default", max_tokens=24, **GREEDY,
                                             messages=[{"role": "user", "content": ASK}])
    words = whole.content[0].text.split()
    stop = next(w for w in words[2:] if len(w) > 2)
    cut = anthropic_client.messages.create(model="default", max_tokens=24, **GREEDY,
                                           stop_sequences=[stop],
                                           messages=[{"role": "user", "content": ASK}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert whole.content[0].text.startswith(cut.content[0].text)


def test_a_streamed_message_adds_up_to_the_whole(anthropic_client):
    ask = [{"role": "user", "content": ASK}]
    whole = anthropic_client.messages.create(model="default", max_tokens=16, messages=ask,
                                             **GREEDY)
    with anthropic_client.messages.stream(model="default", max_tokens=16, messages=ask,
                                          **GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_parse_holds_the_message_to_a_pydantic_model(anthropic_client):
    class City(pydantic.BaseModel):
        name: str
        population: int

    message = anthropic_client.messages.parse(
        model="default", max_tokens=100, output_format=City,
        messages=[{"role": "user", "content": "Describe a city."}])
    assert isinstance(message.parsed_output, City)


def test_a_tool_use_round_trip(anthropic_client):
    ask = [{"role": "user", "content": ASK}]
    first = anthropic_client.messages.create(
        model="default", max_tokens=100, messages=ask, tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    reply = anthropic_client.messages.create(
        model="default", max_tokens=10, tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"},
        messages=[*ask, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": uses[0].id,
                                                "content": "18 C and sunny"}]}])
    assert [block.type for block in reply.content] == ["text"]


def test_a_streamed_tool_use_sends_its_input_in_fragments(anthropic_client):
    with anthropic_client.messages.stream(
            model="default", max_tokens=100, messages=[{"role": "user", "content": ASK}],
            tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "get_weather"}
            ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    assert len(fragments) > 1
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert json.loads("".join(fragments)) == final.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER)


@pytest.mark.parametrize("body,status,kind,message", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "Input tag 'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "runs on Anthropic's servers"),
    ({"model": "claude-nope"}, 404, "not_found_error", "`claude-nope` does not exist"),
    ({"max_tokens": 5000}, 400, "invalid_request_error", "maximum context length"),
    ({"tool_choice": {"type": "tool"}, "tools": [ANTHROPIC_TOOL]}, 400,
     "invalid_request_error", "needs a name"),
])
def test_bad_messages_get_anthropic_errors(server, body, status, kind, message):
    request = {"model": "default", "max_tokens": 5,
               "messages": [{"role": "user", "content": "Hi"}], **body}
    response = httpx.post(f"{server.url}/v1/messages", timeout=30, headers={"x-api-key": KEY},
                          json={k: v for k, v in request.items() if v is not None})
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert message in body["error"]["message"]


def test_either_key_header_opens_both_apis(server):
    ask = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    url = f"{server.url}/v1/messages"
    wrong = httpx.post(url, json=ask, headers={"x-api-key": "wrong"}, timeout=30)
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=ask, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30).status_code == 200
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-api-key": KEY},
                      json={**ask, "messages": ask["messages"]}, timeout=30)
    assert chat.status_code == 200
    assert httpx.post(f"{server.url}/v1/responses", json={"input": "Hi"},
                      timeout=30).json()["error"]["code"] == 401


def test_the_routes_are_counted(server, openai_client, anthropic_client):
    before = server.metrics()
    openai_client.responses.create(model="default", input="Hi", max_output_tokens=2)
    anthropic_client.messages.create(model="default", max_tokens=2,
                                     messages=[{"role": "user", "content": "Hi"}])
    after = server.metrics()
    assert after["cpullm:api_requests_total"] == before["cpullm:api_requests_total"] + 2
    assert 1 <= after["cpullm:responses_stored"] <= 4
    server.wait_idle()
