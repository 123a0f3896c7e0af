"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from cpullm.sampling_params import (
    MAX_N,
    SEED_RANGE,
    RequestOutputKind,
    SamplingParams,
)
from cpullm.structured_output import StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are kept, not rejected (clients send fields of newer API versions), so
    # that the server can name them in a warning instead of dropping them unseen. NaN and
    # infinity (which Python's JSON reads) are no number a field takes.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# Bounds that depend on the model, marked here and filled in when the app's OpenAPI schema
# is built (api_server.bind_model_limits): a token id's maximum (the vocabulary), a
# length's (the context), the served model's name.
TOKEN_ID = {"x-cpullm-limit": "token_id"}
CONTEXT_LENGTH = {"x-cpullm-limit": "context_length"}
SERVED_MODEL = {"x-cpullm-limit": "served_model"}
_TokenId = Annotated[int, Field(ge=0, json_schema_extra=TOKEN_ID)]


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == []


class _Refusing(OpenAIModel):
    """A request body with fields that are refused (HTTP 400 naming the field) until they
    are implemented: answering them with plain text would break the client later, where
    the cause is hard to see. docs/api.md lists every field and its status."""

    # field -> (which values can be served as they are, why the others are refused)
    REFUSED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    def refused_field(self) -> tuple[str, str] | None:
        """The first refused field this request sets, with the reason; None if none."""
        extra = self.model_extra or {}
        for name, (servable, reason) in self.REFUSED.items():
            if not servable(extra.get(name)):
                return name, reason
        return None

    def ignored_fields(self) -> list[str]:
        """Fields this server does not know: accepted, not acted on."""
        return sorted(set(self.model_extra or {}) - set(self.REFUSED))


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema; and
    vLLM's structural tag (free text in which each trigger opens a tagged JSON)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Refusing):
    """Fields shared by completions and chat completions."""

    # The bounds SamplingParams checks, stated in the schema too (clients and fuzzers read
    # them); what depends on the model (token ids, lengths) is checked per request.
    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | \
        None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
                     Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(default=None, ge=-1, le=2**63 - 1)  # (an int64 past it)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[_TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* spellings (the backend field is accepted; llguidance runs them all)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's structured-output parameters, from whichever field gives them."""
        given = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(StructuredOutputsParams(json_object=True))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format: a json_schema format needs "
                                 "json_schema.schema")
            given.append(StructuredOutputsParams(json=fmt.json_schema.schema_))
        elif fmt is not None and fmt.type == "structural_tag":
            given.append(StructuredOutputsParams(structural_tag={
                "structures": fmt.structures, "triggers": fmt.triggers}))
        if self.structured_outputs is not None:
            given.append(StructuredOutputsParams.from_dict(self.structured_outputs))
        guided = {kind: value for kind, value in (
            ("json", self.guided_json), ("regex", self.guided_regex),
            ("choice", self.guided_choice), ("grammar", self.guided_grammar))
            if value is not None}
        if guided:
            given.append(StructuredOutputsParams(
                **guided, whitespace_pattern=self.guided_whitespace_pattern))
        if len(given) > 1:
            raise ValueError("structured_outputs: give one of response_format, "
                             "structured_outputs and the guided_* fields")
        return given[0] if given else None

    @property
    def usage_at_end(self) -> bool:
        """Stream a last chunk with the usage."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_in_every_chunk(self) -> bool:
        """Stream the usage so far in every chunk too (vLLM's continuous_usage_stats)."""
        return self.usage_at_end and self.stream_options.continuous_usage_stats  # type: ignore

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           stream: bool) -> SamplingParams:
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys must be token ids") from None
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            logit_bias=bias, max_tokens=max_tokens, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params())


# vLLM's sampling fields beyond OpenAI's, which /v1/responses and /v1/messages take too
# (as extra fields of their bodies) and hand on to the chat request they become
VLLM_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "min_tokens",
                        "ignore_eos", "presence_penalty", "frequency_penalty", "stop",
                        "stop_token_ids", "logit_bias", "skip_special_tokens",
                        "include_stop_str_in_output", "cache_salt", "structured_outputs")


def sampling_extras(request: BaseModel) -> dict[str, Any]:
    """The vLLM sampling fields a request body carries beyond its API's own."""
    return {name: value for name, value in (request.model_extra or {}).items()
            if name in VLLM_SAMPLING_EXTRAS}


_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[_TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: _Text | Annotated[list[_Text], Field(min_length=1)] | _TokenIds | \
        Annotated[list[_TokenIds], Field(min_length=1)]
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=0,  # 0: echo only
                                   json_schema_extra=CONTEXT_LENGTH)
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # must equal n
    # vLLM's beam search: the n best beams
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, ge=-100.0, le=100.0)

    REFUSED = {"suffix": (_absent, "insertion (suffix) is not supported")}

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt (and its logprobs) back, nothing generated, as
        scoring clients ask for a prompt's logprobs."""
        return self.echo and self.max_tokens == 0


class ContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str = Field(min_length=1)  # a data URL, a local file, or http(s) (docs/api.md)
    detail: str | None = None  # (OpenAI's; ignored: the model's processor sizes images)


class ImagePart(OpenAIModel):
    """An image (vision-language models only)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart | ImagePart] | None = None
    name: str | None = None

    def text(self, image_token: str | None = None) -> str:
        """The text content; an image part is ``image_token`` in its place (or nothing)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, ContentPart) else image_token or ""
                       for part in self.content)

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def for_template(self, image_token: str | None = None) -> dict[str, Any]:
        # (an assistant message's tool_calls and a tool message's tool_call_id ride along
        # as extra fields, which the template reads)
        """The message as the chat template sees it: text content (each image part the
        model's ``image_token``), and any other fields the client sent (name, tool_calls,
        tool_call_id, ...) as they are."""
        message = {**(self.model_extra or {}), "role": self.role,
                   "content": self.text(image_token)}
        calls = message.get("tool_calls")
        if isinstance(calls, list):  # templates read the arguments as an object (as vLLM's)
            message["tool_calls"] = [_arguments_as_object(c) for c in calls]
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


_FUNCTIONS = "the deprecated functions API is not supported; send tools"


def _arguments_as_object(call: Any) -> Any:
    """A tool call of the history with its JSON-text arguments parsed, where they parse."""
    import json

    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, json_schema_extra=CONTEXT_LENGTH)
    max_completion_tokens: int | None = Field(default=None, ge=1,
                                              json_schema_extra=CONTEXT_LENGTH)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    REFUSED = {"functions": (_empty, _FUNCTIONS),
               "function_call": (lambda v: v is None or v == "none", _FUNCTIONS),
               "audio": (_absent, "audio output is not supported"),
               "modalities": (lambda v: v is None or v == ["text"],
                              "only the text modality is supported")}


class TokenizeCompletionRequest(OpenAIModel):
    """/tokenize of a prompt (vLLM's two request kinds)."""

    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIModel):
    """/tokenize of chat messages, rendered by the chat template."""

    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/unload_lora_adapter (its lora_int_id is taken and not needed)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    tokens: list[_TokenId]


_TRUNCATE = Field(default=None, ge=-1, json_schema_extra=CONTEXT_LENGTH)
MAX_INPUTS = 2048  # inputs in one request, OpenAI's limit: each is an engine request
_Texts = Annotated[list[_Text], Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(OpenAIModel):
    """OpenAI's /v1/embeddings: ``input`` as a string, a list of strings, token ids or a
    list of token-id lists; vLLM's ``truncate_prompt_tokens`` and ``normalize`` too."""

    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    input: _Text | _Texts | _TokenIds | \
        Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = _TRUNCATE
    normalize: bool | None = None
    add_special_tokens: bool = True


class ScoreRequest(OpenAIModel):
    """vLLM's /score: one ``text_1`` against every ``text_2``, or pair by pair."""

    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    text_1: _Text | _Texts
    text_2: _Text | _Texts
    truncate_prompt_tokens: int | None = _TRUNCATE


class RerankRequest(OpenAIModel):
    """/rerank (Jina's and Cohere's shape): the documents ordered by relevance to the
    query, the ``top_n`` first."""

    model: str | None = Field(default=None, json_schema_extra=SERVED_MODEL)
    query: _Text
    documents: _Texts
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = _TRUNCATE


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "cpullm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
