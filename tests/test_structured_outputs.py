"""Structured outputs: whatever the model would say, its tokens follow the JSON schema, the
regex, the choices or the grammar asked for, offline and through the server."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cpullm import LLM, SamplingParams
from cpullm.structured_output import StructuredOutputsParams

# Nested objects, arrays, enums, bounded numbers, required fields.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "location": {"type": "object", "properties": {
            # (a float's digits are the model's to stop: integers keep answers short)
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}},
     "required": ["city", "location"], "additionalProperties": False},
    {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
        "size": {"enum": ["S", "M", "L"]}},
     "required": ["colors", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
     "required": ["items", "paid"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 1, "maxItems": 5},
]
SUBJECTS = ["a person", "a city", "a T-shirt", "an order", "some numbers"]
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z]{3,10}@[a-z]{3,10}\.(com|org|net)"
GRAMMAR = '''start: greeting " " name "!"
greeting: "hello" | "hi"
name: /[A-Z][a-z]{1,8}/
'''


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_model_len=1024)  # the default model, bfloat16


def _chat(i: int, what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe {what} (#{i}) as JSON."}]


@pytest.mark.slow
def test_fifty_json_answers_parse_and_validate(llm):
    """50 prompts over 5 schemas, sampled at temperature 1: every answer is JSON that
    validates against its schema."""
    conversations, params = [], []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        conversations.append(_chat(i, SUBJECTS[i % len(SUBJECTS)]))
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (i, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[i % len(SCHEMAS)])


def test_choice_regex_and_grammar_hold(llm):
    prompts = ["Is it raining?", "Pick one:", "Answer:", "The date is", "Mail me at",
               "Say hello"]
    cases = [("choice", ["yes", "no", "maybe"], lambda t: t in ("yes", "no", "maybe")),
             ("regex", DATE, lambda t: re.fullmatch(DATE, t) is not None),
             ("regex", EMAIL, lambda t: re.fullmatch(EMAIL, t) is not None),
             ("grammar", GRAMMAR,
              lambda t: re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", t) is not None)]
    for kind, value, holds in cases:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=2,
                                structured_outputs=StructuredOutputsParams(**{kind: value}))
        for output in llm.generate(prompts, params, use_tqdm=False):
            for completion in output.outputs:
                assert holds(completion.text), (kind, completion.text)


def test_guided_and_free_requests_share_a_batch(llm):
    """Unguided requests in the same batch sample as they would alone."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["The sky is", "One two"], free,
                                                           use_tqdm=False)]
    guided = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(choice=["blue", "red"]))
    mixed = llm.generate(["The sky is", "Colour:", "One two"], [free, guided, free],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert mixed[1].outputs[0].text in ("blue", "red")


def test_a_grammar_with_stop_strings_logprobs_and_a_cached_prefix(llm):
    """A stop string cuts a guided answer where it appears (what is left is the start of a
    match); logprobs come for every token; the same request again, its prompt now a cached
    prefix, samples the same answer."""
    import regex

    pattern = r"[a-z]{3,10}( [a-z]{2,10}){4,8}\."
    prompt = "Write one short sentence about the sea, in lower case. " * 30  # > 2 blocks
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=80, logprobs=2, n=2,
                            stop=[" the ", " a "],
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens >= 256
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    for completion in first.outputs:
        if completion.finish_reason == "stop" and completion.stop_reason is not None:
            assert regex.fullmatch(pattern, completion.text, partial=True), completion.text
        else:
            assert re.fullmatch(pattern, completion.text), completion.text
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and len(entry) <= 3


def test_grammar_survives_preemption(tiny_model):
    """A tiny random model, a KV cache small enough to preempt: the regex still holds."""
    llm = LLM(str(tiny_model("llama")), dtype="float32", block_size=32,
              kv_cache_memory_bytes=6 * 32 * 512, max_model_len=192)
    pattern = r"[a-z]{20,60}"
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = [" ".join(["words"] * n) for n in (30, 50, 70, 40)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


@pytest.mark.parametrize("params,message", [
    (dict(json='{"type": "bogus"}'), "cannot be used"),
    (dict(json="{not json"), "is not JSON"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
])
def test_a_grammar_that_cannot_compile_is_refused_before_the_engine(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(**params)), use_tqdm=False)


def test_characters_beyond_the_bmp_can_be_chosen(llm):
    """A choice (or a schema's enum) outside the Basic Multilingual Plane: spelled as it
    is, not as the surrogate pair JSON escapes it to, which no token could follow."""
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["\U0001F680", "\U0001F600 ok"]))
    text = llm.generate("Pick:", params, use_tqdm=False)[0].outputs[0].text
    assert text in ("\U0001F680", "\U0001F600 ok")


# SmolLM2's vocabulary holds no 0xf1 byte, which starts every character from U+40000 to
# U+7FFFF: no output can hold one
UNWRITABLE = "\U00040000"


@pytest.mark.parametrize("params", [dict(choice=["yes", UNWRITABLE]),
                                    dict(regex=f"{UNWRITABLE}+"),
                                    dict(json={"enum": [UNWRITABLE]}),
                                    dict(regex=r"\x{40000}|\x{40001}"),
                                    dict(regex=f"(a|b{UNWRITABLE})c")])
def test_a_grammar_no_token_can_write_is_refused(llm, params):
    with pytest.raises(ValueError, match="no token of this model can write"):
        llm.generate("hi", SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(**params)), use_tqdm=False)


def test_text_no_token_can_write_fails_the_request_when_the_grammar_reaches_it(llm):
    """Text the front end cannot see (escaped, past the start) fails its request alone
    when the grammar gets there: llguidance's mask would allow the tokens the tokenizer
    spells it with (other bytes), which its matcher then refuses."""
    from cpullm.structured_output import GuidedDecoding

    tokenizer = llm.get_tokenizer()
    guided = GuidedDecoding(lambda: tokenizer, len(tokenizer))
    params = [SamplingParams(structured_outputs=StructuredOutputsParams(
        regex=r"(a|b\x{40000})c")) for _ in range(2)]
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    rows, allowed, failed = guided.masks(["took a", "took b"], params, [[a], [b]])
    assert rows == [0] and set(failed) == {"took b"}
    assert "no token of this model can write" in failed["took b"]
    assert allowed[0].nonzero().flatten().tolist() == tokenizer.convert_tokens_to_ids(["c"])


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    return LLM(str(tiny_model("llama")), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=1 << 24).llm_engine


def _waiting(engine) -> set[str]:
    return {request.request_id for request in engine.scheduler.waiting}


def test_a_new_grammar_compiles_off_the_step(tiny_engine):
    """A request with a grammar not seen before waits, while its grammar compiles on a
    thread of its own, and the running requests' steps go on without it."""
    engine = tiny_engine
    free = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    guided = engine.add_request(None, [4, 5, 6], SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(
            json={"enum": ["compiled", "aside"]})))
    engine.step()
    assert guided in _waiting(engine) and free not in _waiting(engine)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        assert not engine.failed
    assert json.loads(outputs[guided].outputs[0].text) in ("compiled", "aside")
    assert len(outputs[free].outputs[0].token_ids) == 8


def test_a_grammar_past_its_compile_time_fails_its_request(tiny_engine):
    import concurrent.futures
    import threading

    engine = tiny_engine
    decoding = engine.model_runner.sampler.guided
    held = threading.Event()  # the compile thread, busy until the request has failed
    decoding.compile_timeout = 0.0
    decoding._compiler = concurrent.futures.ThreadPoolExecutor(1)
    decoding._compiler.submit(held.wait)
    try:
        late = engine.add_request(None, [7, 8, 9], SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="late|slow")))
        failed = {}
        while engine.has_unfinished_requests():
            engine.step()
            failed.update(engine.failed)
        assert "took longer than 0 s to compile" in str(failed[late])
    finally:
        held.set()
        decoding.compile_timeout = 30.0


def _writes(tokenizer, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar lets the tokens of this text be written, whole."""
    import llguidance

    from cpullm.structured_output import grammar_of, llg_tokenizer

    matcher = llguidance.LLMatcher(llg_tokenizer(tokenizer), grammar_of(params))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_json_whitespace_is_bounded_and_can_be_chosen(llm):
    """Pretty-printed JSON is written; blank lines are not (a sampled model would otherwise
    spend max_tokens on them); whitespace_pattern and disable_any_whitespace change it,
    and a schema's own x-guidance options win."""
    tokenizer = llm.get_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "array"}}}
    default = StructuredOutputsParams(json=schema)
    pretty = json.dumps({"a": 1, "b": [1, [2]]}, indent=4)
    assert _writes(tokenizer, default, pretty)
    assert _writes(tokenizer, default, '{"a":1, "b":[ 1 ]}')
    assert not _writes(tokenizer, default, '{"a": 1,\n\n"b": []}')
    assert not _writes(tokenizer, default, '{"a": 1' + " " * 65 + "}")
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert _writes(tokenizer, compact, '{"a":1,"b":[]}')
    assert not _writes(tokenizer, compact, pretty)
    blank_lines = StructuredOutputsParams(json=json.dumps(schema), whitespace_pattern=r"\n+")
    assert _writes(tokenizer, blank_lines, '{"a":1,\n\n\n"b":[]}')
    assert not _writes(tokenizer, blank_lines, '{"a": 1}')
    own = {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert not _writes(tokenizer, StructuredOutputsParams(json=own), pretty)


def test_structured_outputs_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="must be an object or its JSON text"):
        StructuredOutputsParams(structural_tag=["a"])  # type: ignore[arg-type]


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
WEATHER_TAG = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER_SCHEMA,
                               "end": "</function>"}], "triggers": ["<function="]}
FEW_SHOT = "".join(f'Q: weather in {city}?\nA: <function=get_weather>{{"city": "{city}"}}'
                   "</function>\n" for city in ("Rome", "Oslo", "Lima"))
FEW_SHOT += "Q: weather in Paris?\nA:"


def check_tagged(text: str) -> int:
    """Every trigger in the text goes on as the structure: its begin, JSON of its schema
    and its end (the last may be cut by max_tokens); how many calls are whole."""
    whole = 0
    for part in text.split("<function=")[1:]:
        if "</function>" not in part:
            assert "get_weather>".startswith(part[:12]), text  # cut before the JSON's end
            continue
        body = part.split("</function>")[0]
        assert body.startswith("get_weather>"), text
        jsonschema.validate(json.loads(body.removeprefix("get_weather>")), WEATHER_SCHEMA)
        whole += 1
    return whole


def test_a_structural_tag_holds_what_follows_each_trigger(llm):
    """Free text, but each "<function=" goes on as the tagged call of the structure: its
    name, arguments of its schema, its end (free, the model writes other names and
    cities longer than the schema allows)."""
    whole = 0
    for spec in (WEATHER_TAG, json.dumps(WEATHER_TAG)):  # an object, or its text
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=60, n=3,
                                structured_outputs=StructuredOutputsParams(structural_tag=spec))
        for completion in llm.generate(FEW_SHOT, params, use_tqdm=False)[0].outputs:
            whole += check_tagged(completion.text)
    assert whole >= 2


@pytest.mark.parametrize("spec,message", [
    ({"structures": []}, "needs structures"),
    ({"structures": [{"begin": "<f=x>", "schema": {}}], "triggers": ["<g="]}, "no trigger"),
    ("{not json", "is not JSON"),
])
def test_a_bad_structural_tag_is_refused(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
            structural_tag=spec)), use_tqdm=False)


@pytest.fixture(scope="module")
def server():
    from server_utils import RemoteServer

    srv = RemoteServer(["--max-model-len", "1024", "--served-model-name", "default"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


PERSON = SCHEMAS[0]


def _content(stream) -> str:
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(client, stream):
    messages = [{"role": "user", "content": "Tell me about a person as JSON."}]
    formats = [{"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                        "strict": True}},
               {"type": "json_object"}]
    for response_format in formats:
        response = client.chat.completions.create(
            model="default", messages=messages, max_tokens=120, temperature=1.0, seed=2,
            response_format=response_format, stream=stream)
        text = _content(response) if stream else response.choices[0].message.content
        value = json.loads(text)
        if response_format["type"] == "json_schema":
            jsonschema.validate(value, PERSON)
        else:
            assert isinstance(value, dict)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_in_extra_body(client, stream):
    """structured_outputs (choice, regex, grammar) and the older guided_* spellings, on
    chat and on completions, with n=2."""
    cases = [({"structured_outputs": {"choice": ["yes", "no"]}},
              lambda t: t in ("yes", "no")),
             ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t)),
             ({"structured_outputs": {"grammar": GRAMMAR}},
              lambda t: re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}!", t)),
             ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)
              is None),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right"))]
    for extra, holds in cases:
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Answer."}], max_tokens=60,
            temperature=1.0, n=2, stream=stream, extra_body=extra)
        if stream:
            texts = ["", ""]
            for chunk in chat:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
        else:
            texts = [c.message.content for c in chat.choices]
        completion = client.completions.create(model="default", prompt="Answer:",
                                               max_tokens=60, extra_body=extra)
        for text in [*texts, completion.choices[0].text]:
            assert holds(text), (extra, text)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "structural_tag", **WEATHER_TAG}},
    {"structured_outputs": {"structural_tag": json.dumps(WEATHER_TAG)}}])
def test_structural_tag_through_the_server(client, extra):
    completion = client.completions.create(model="default", prompt=FEW_SHOT, max_tokens=60,
                                           temperature=0.8, seed=3, n=3, extra_body=extra)
    assert sum(check_tagged(choice.text) for choice in completion.choices) >= 1


def test_openai_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)

    completion = client.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person, max_tokens=100)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "cannot be used"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag needs structures"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"]}}, "needs structures"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one of"),
    ({"structured_outputs": {"colour": "blue"}}, "unknown fields"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "give one of"),
])
def test_bad_structured_outputs_get_a_400(server, body, message):
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and message in error["message"], error
    assert httpx.get(f"{server.url}/health").status_code == 200
