"""Reasoning parsers: the <think> part apart from the answer, whole and streamed in pieces,
and through the server (reasoning_content)."""

from __future__ import annotations

import re

import pytest

from cpullm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser

CANNED = [  # parser, answer, (reasoning, content)
    ("deepseek_r1", "<think>Two and two.</think>Four.", ("Two and two.", "Four.")),
    ("deepseek_r1", "The template opened it.</think>\n\nFour.",
     ("The template opened it.", "\n\nFour.")),
    ("deepseek_r1", "Still thinking when the tokens ran out", (
        "Still thinking when the tokens ran out", None)),
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("qwen3", "Paris.", (None, "Paris.")),  # enable_thinking false: no tags
    ("qwen3", "<think>cut short", ("cut short", None)),
    ("qwen3", "<think></think>Just the answer.", (None, "Just the answer.")),
]


@pytest.mark.parametrize("parser,text,expected", CANNED)
def test_split_on_canned_answers(parser, text, expected):
    assert get_reasoning_parser(parser).split(text) == expected


@pytest.mark.parametrize("parser,text,expected", CANNED)
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_streamed_pieces_add_up_to_the_split(parser, text, expected, piece):
    """Fed a few characters at a time (tags split across pieces), the deltas add up to the
    whole answer's split."""
    stream = ReasoningStream(get_reasoning_parser(parser))
    reasoning = content = ""
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    for i, part in enumerate(pieces):
        thought, said = stream.feed(part, final=i == len(pieces) - 1)
        assert "<think>" not in thought + said and "</think>" not in thought + said
        reasoning, content = reasoning + thought, content + said
    assert (reasoning or None, content or None) == expected


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="'o1' is not supported; supported: deepseek_r1, qwen3"):
        get_reasoning_parser("o1")


THOUGHT = r"<think>[a-z ]{10,40}</think>[A-Za-z ]{5,30}"


@pytest.fixture(scope="module")
def server():
    from server_utils import RemoteServer

    server = RemoteServer(["--max-model-len", "1024", "--served-model-name", "default",
                           "--reasoning-parser", "qwen3"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_through_the_server(client, stream):
    """The default model held by a regex to '<think>...</think>answer' (it does not think
    on its own), with --reasoning-parser qwen3: the thought in reasoning_content, the
    answer in content, streamed or not."""
    response = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=80, temperature=1.0, seed=4, stream=stream,
        extra_body={"structured_outputs": {"regex": THOUGHT}})
    if stream:
        reasoning = content = ""
        for chunk in response:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None:
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
    else:
        message = response.choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert re.fullmatch(r"[a-z ]{10,40}", reasoning), reasoning
    assert re.fullmatch(r"[A-Za-z ]{5,30}", content), content


ASK_TO_THINK = "Think, then answer."
HELD = {"structured_outputs": {"regex": THOUGHT}, "seed": 4}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_items_through_responses(client, stream):
    """/v1/responses: the thought is a reasoning item ahead of the message."""
    if stream:
        with client.responses.stream(model="default", input=ASK_TO_THINK,
                                     max_output_tokens=80, extra_body=HELD) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(model="default", input=ASK_TO_THINK,
                                           max_output_tokens=80, extra_body=HELD)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert re.fullmatch(r"[a-z ]{10,40}", response.output[0].content[0].text)
    assert re.fullmatch(r"[A-Za-z ]{5,30}", response.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_blocks_through_messages(server, stream):
    """/v1/messages: the thought is a thinking block ahead of the text."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused")
    ask = {"model": "default", "max_tokens": 80, "extra_body": HELD,
           "messages": [{"role": "user", "content": ASK_TO_THINK}]}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert re.fullmatch(r"[a-z ]{10,40}", message.content[0].thinking)
    assert re.fullmatch(r"[A-Za-z ]{5,30}", message.content[1].text)
