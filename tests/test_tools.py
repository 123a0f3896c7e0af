"""Tool calling: the parsers on canned answers of each family, and tools through the server
with the official client (required and named choices held to the tools' schemas)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from cpullm.entrypoints.openai.tool_parsers import ToolCallStream, get_tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A city's "
                                           "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def calls(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, found = get_tool_parser(parser).extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


CANNED = [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     (None, [("add", {"a": 1, "b": 2})])),
    ("hermes", 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo",'
     ' "unit": "C"}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}'
     "</tool_call>",
     ("Let me check.", [("get_weather", {"city": "Oslo", "unit": "C"}),
                        ("add", {"a": 3, "b": 4})])),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',
     ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', [])),
    ("hermes", "No tools needed: 42.", ("No tools needed: 42.", [])),
    ("llama3_json", '{"name": "add", "parameters": {"a": 5, "b": 6}}',
     (None, [("add", {"a": 5, "b": 6})])),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 1}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}',
     (None, [("add", {"a": 1, "b": 1}), ("get_weather", {"city": "Rome", "unit": "C"})])),
    ("llama3_json", '{"name": "add", "parameters": ', ('{"name": "add", "parameters": ', [])),
    ("llama3_json", "The answer is 7.", ("The answer is 7.", [])),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 2}}, {"name": '
     '"get_weather", "arguments": {"city": "Lima", "unit": "F"}}]',
     (None, [("add", {"a": 2, "b": 2}), ("get_weather", {"city": "Lima", "unit": "F"})])),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 0, "b": 9}}]',
     ("Sure.", [("add", {"a": 0, "b": 9})])),
    ("mistral", "[TOOL_CALLS][{broken", ("[TOOL_CALLS][{broken", [])),
    ("pythonic", '[get_weather(city="Paris", unit="C"), add(a=1, b=-2)]',
     (None, [("get_weather", {"city": "Paris", "unit": "C"}), ("add", {"a": 1, "b": -2})])),
    ("pythonic", "[add(1, 2)]", ("[add(1, 2)]", [])),
    ("pythonic", "I think [this] is right.", ("I think [this] is right.", [])),
]


@pytest.mark.parametrize("parser,text,expected", CANNED)
def test_parsers_on_canned_answers(parser, text, expected):
    assert calls(parser, text) == expected


def streamed(stream: ToolCallStream, text: str, seed: int) -> tuple[str, list, list[int]]:
    """The answer fed in random pieces of 1-5 characters: (content, [(name, arguments)],
    how many deltas each call came in)."""
    import random

    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        size = rng.randint(1, 5)
        pieces.append(text[i:i + size])
        i += size
    content, found = "", {}
    for n, piece in enumerate(pieces):
        more, deltas = stream.feed(piece, final=n == len(pieces) - 1)
        content += more
        for delta in deltas:
            name, arguments, count = found.get(delta["index"], ("", "", 0))
            assert ("id" in delta) == (count == 0)  # the id and name first, once
            found[delta["index"]] = (name + delta["function"].get("name", ""),
                                     arguments + delta["function"]["arguments"], count + 1)
    calls = [found[i] for i in sorted(found)]
    return content, [(name, arguments) for name, arguments, _ in calls], [c for *_, c in calls]


# (the third hermes answer breaks inside its arguments: streamed, its call was begun)
@pytest.mark.parametrize("parser,text,expected", [case for i, case in enumerate(CANNED) if i != 2])
@pytest.mark.parametrize("seed", range(3))
def test_streamed_calls_equal_the_whole_answers(parser, text, expected, seed):
    """Fed in pieces as they are generated, each format's answer comes out as the same
    content and calls as the finished answer parses to."""
    content, found, _ = streamed(ToolCallStream("auto", get_tool_parser(parser)), text, seed)
    expected_content, expected_calls = expected
    assert [(name, json.loads(arguments)) for name, arguments in found] == expected_calls
    if expected_calls:  # (the parse strips the content before the calls)
        assert content.strip() == (expected_content or "")
    else:
        assert content == expected_content


def test_streamed_arguments_come_in_fragments():
    """Required and named calls (and JSON calls under auto) send each call's name first,
    then its arguments as they are written; a call cut off by a tag stops there."""
    required = ('[{"name":"add","parameters":{"a":1,"b":2}},{"name":"get_weather",'
                '"parameters":{"city":"Oslo }{","unit":"C"}}]')
    _, found, counts = streamed(ToolCallStream("required"), required, seed=0)
    assert found == [("add", '{"a":1,"b":2}'),
                     ("get_weather", '{"city":"Oslo }{","unit":"C"}')]
    assert min(counts) > 2
    _, found, counts = streamed(ToolCallStream("named", name="add"), '{"a":1,"b":2}', seed=0)
    assert found == [("add", '{"a":1,"b":2}')] and counts[0] > 2
    content, found, _ = streamed(ToolCallStream("required"), "[", seed=0)
    assert (content, found) == ("[", [])  # cut before a call: the text as content
    broken = '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call> ok'
    _, found, _ = streamed(ToolCallStream("auto", get_tool_parser("hermes")), broken, seed=0)
    assert found == [("add", '{"a": 1,')]


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="'nope' is not supported; supported: hermes"):
        get_tool_parser("nope")


@pytest.fixture(scope="module")
def server():
    from server_utils import RemoteServer

    srv = RemoteServer(["--max-model-len", "2048", "--served-model-name", "default",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _stream_calls(stream) -> tuple[list[tuple[str, str]], str | None, int]:
    """The streamed calls, the finish reason, and the fewest deltas a call came in."""
    found, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name, arguments, count = found.get(call.index, ("", "", 0))
                found[call.index] = (name + (call.function.name or ""),
                                     arguments + (call.function.arguments or ""), count + 1)
            finish = choice.finish_reason or finish
    calls = [found[i] for i in sorted(found)]
    return [c[:2] for c in calls], finish, min((c[2] for c in calls), default=0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "get_weather", "add"])
def test_required_and_named_calls_validate(client, choice, stream):
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": choice}}
    # one call a "required" answer: the small default model sampled at temperature 1 may
    # write calls until max_tokens (the array is otherwise open-ended)
    single = {"parallel_tool_calls": False} if choice == "required" else {}
    for seed in range(3):
        response = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=seed,
            temperature=1.0, max_tokens=200, stream=stream, **single)
        if stream:
            found, finish, fewest = _stream_calls(response)
            assert fewest > 1  # the name, then the arguments as they were written
        else:
            message = response.choices[0].message
            found = [(c.function.name, c.function.arguments) for c in message.tool_calls]
            finish = response.choices[0].finish_reason
            assert message.content is None
        assert finish == "tool_calls" and found
        for name, arguments in found:
            assert choice in ("required", name)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_round_trip_with_a_tool_message(client):
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    reply = client.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=20)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_auto_answers_with_the_parsed_message(client):
    """The default model does not write hermes calls: its answer comes back as content,
    streamed or not."""
    response = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                              max_tokens=20, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")
    text = response.choices[0].message.content
    assert text
    stream = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                            max_tokens=20, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


@pytest.mark.parametrize("body,message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_get_a_400(server, body, message):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_auto_needs_the_flags(tiny_model):
    from server_utils import RemoteServer

    srv = RemoteServer([str(tiny_model("llama")), "--dtype", "float32", "--max-model-len",
                        "256"])
    try:
        response = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
            "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 5})
        assert response.status_code == 400
        assert "--enable-auto-tool-choice" in response.json()["error"]["message"]
    finally:
        srv.stop()
