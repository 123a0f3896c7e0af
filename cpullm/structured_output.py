"""Structured outputs: a request's tokens held to a JSON schema, a regex, a list of choices
or a grammar, by token masks from llguidance.

llguidance, not xgrammar: both compute masks on the CPU, but xgrammar's wheel pulls triton
(a GPU compiler) and apache-tvm-ffi into a CPU server's environment, and llguidance needs
nothing. On two Zen 5 cores, with the default model's 49,152-token vocabulary, a matcher
for a nested JSON schema is ready in 0.3-0.7 ms and a mask takes ~60 us a token.

- ``StructuredOutputsParams`` is vLLM's request shape (``SamplingParams.structured_outputs``).
- ``grammar_of`` turns it into an llguidance grammar; ``GrammarChecker`` (the front end)
  compiles it once per distinct grammar, so that a grammar the engine cannot use is a
  ValueError (a 400) before the request reaches the engine.
- ``GuidedDecoding`` (the model runner) keeps a matcher per guided request, writes the
  masks of a step's guided rows, and advances the matchers by the sampled tokens. Rows
  that are not guided cost nothing.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

# The kinds a request may ask for, exactly one per request.
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# A mask that allows this many tokens or fewer is checked token by token (GuidedDecoding)
_NARROW_MASK = 8
# Grammars whose compiled matcher the model runner keeps, to copy for the next request
_KEPT_GRAMMARS = 256
# A grammar still compiling after this many seconds fails its request (vLLM's default)
GRAMMAR_COMPILE_TIMEOUT = 30.0
# The whitespace JSON may hold between two of its tokens: a run of spaces and tabs, or one
# line break with indentation on either side. Any pretty-printed JSON fits; a sampled model
# cannot spend its tokens on blank lines (unbounded whitespace lets a small model at
# temperature 1 write newlines until max_tokens)
_JSON_WHITESPACE = r"[\x20\x09]{1,64}|[\x20\x09]{0,64}\x0D?\x0A[\x20\x09]{0,64}"


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output parameters: exactly one of ``json`` (a JSON schema, as a
    dict or its text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF/
    EBNF), ``json_object`` (any JSON object) or ``structural_tag`` (free text in which
    each trigger opens a tagged JSON of a schema, as {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]} or its text)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's options: disable_any_whitespace keeps JSON compact (no whitespace between
    # tokens of the syntax); whitespace_pattern is the regex of the whitespace JSON may hold
    # between them (default _JSON_WHITESPACE); the others are accepted (llguidance never
    # falls back)
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar "
                             f"and json_object must be given, got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs: {name} must be a string")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | dict):
                raise ValueError(f"structured_outputs: {name} must be an object or its JSON "
                                 "text")

    @classmethod
    def from_dict(cls, value: object) -> StructuredOutputsParams:
        """From the JSON of a request's ``structured_outputs`` field."""
        if not isinstance(value, dict):
            raise ValueError("structured_outputs: expected an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}")
        return cls(**value)

    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar is made from, hashable."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs: the JSON schema is not JSON: "
                                     f"{e}") from None
            own = schema.get("x-guidance", {}) if isinstance(schema, dict) else None
            # (the schema's own x-guidance whitespace options win over the request's)
            if isinstance(own, dict) and not {"whitespace_flexible",
                                              "whitespace_pattern"} & set(own):
                options = ({"whitespace_flexible": False} if self.disable_any_whitespace
                           else {"whitespace_pattern": self.whitespace_pattern
                                 or _JSON_WHITESPACE})
                schema = {**schema, "x-guidance": {**own, **options}}
            # (ensure_ascii=False: llguidance reads a character beyond the BMP escaped as a
            # surrogate pair as two lone surrogates, a grammar no token can follow)
            text = schema if isinstance(schema, str) else json.dumps(
                schema, sort_keys=True, ensure_ascii=False)
        elif kind == "choice" or (kind == "structural_tag" and isinstance(value, dict)):
            text = json.dumps(value, ensure_ascii=False, sort_keys=kind != "choice")
        else:
            text = value
        return kind, text


@functools.lru_cache(maxsize=512)
def _grammar(kind: str, text: str) -> str:
    import llguidance

    if kind == "json":
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs: the JSON schema is not JSON: {e}") from None
    if kind == "structural_tag":
        kind, text = "grammar", _structural_tag_grammar(text)
    source = {"json": "json_schema", "json_object": "json_schema", "regex": "regex",
              "choice": "choice", "grammar": "grammar"}[kind]
    try:
        return llguidance.grammar_from(source, text)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"structured_outputs: the {kind} cannot be compiled: {e}") from None


def _structural_tag_grammar(text: str) -> str:
    """The Lark grammar of a structural tag (vLLM's shape): any text, in which a trigger
    must go on as one of the structures that begin with it (its begin, JSON of its schema,
    its end), then any text again. A trigger written <...> is the special token of that
    name, as vLLM takes it."""
    import llguidance

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs: the structural_tag is not JSON: {e}") from None
    problem = "structured_outputs: structural_tag needs structures (a list of {begin, " \
              "schema, end}) and triggers (a list of strings)"
    if not isinstance(spec, dict):
        raise ValueError(problem)
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError(problem)
    tags = []
    for i, structure in enumerate(structures):
        if not (isinstance(structure, dict) and isinstance(structure.get("begin"), str)
                and isinstance(structure.get("end", ""), str)
                and isinstance(structure.get("schema", {}), dict)):
            raise ValueError(f"{problem}: structure {i} is not")
        begin = structure["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structured_outputs: structure {i} begins with {begin!r}, which "
                             f"no trigger ({triggers}) begins")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin,
                                         grammar=structure.get("schema") or {"type": "object"},
                                         end=structure.get("end", "")))
    return llguidance.StructTag.to_grammar(tags)


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a request's structured-output parameters (cached)."""
    return _grammar(*params.key())


def llg_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a Hugging Face tokenizer (its vocabulary as bytes)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def writable_bytes(tokenizer: Any) -> frozenset[int]:
    """The bytes some (non-special) token of an llguidance tokenizer holds: a byte-level
    vocabulary may lack a few (SmolLM2's lacks 0xf1-0xf3, which start every character of
    planes 4-15), and text needing one can never be written."""
    held: set[int] = set()
    for token in range(tokenizer.vocab_size):
        if not tokenizer.is_special_token(token):
            held.update(tokenizer.decode_bytes([token]))
    return frozenset(held)


class GrammarChecker:
    """The front end's check of a request's grammar against the model's tokenizer: each
    distinct grammar compiled once."""

    def __init__(self, tokenizer: Any) -> None:
        self._hf_tokenizer = tokenizer
        self._checked: dict[tuple[str, str], str] = {}

    @functools.cached_property
    def _tokenizer(self) -> Any:
        return llg_tokenizer(self._hf_tokenizer)

    @functools.cached_property
    def _writable(self) -> frozenset[int]:
        return writable_bytes(self._tokenizer)

    def warm(self) -> None:
        """Read the vocabulary now (0.6 s for 49,152 tokens), not at the first request."""
        _ = self._writable

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem if the grammar cannot be used."""
        key = params.key()
        if key not in self._checked:
            if len(self._checked) > 4096:
                self._checked.clear()
            self._checked[key] = self._problem(params)
        if self._checked[key]:
            raise ValueError(f"structured_outputs: the {key[0]} cannot be used: "
                             f"{self._checked[key]}")

    def _problem(self, params: StructuredOutputsParams) -> str:
        """Why the grammar cannot be used ("" if it can): it does not compile, or it spells
        (or, escaped, starts with) characters needing bytes no token of the vocabulary
        holds, which llguidance's mask would spell with other tokens its matcher refuses.
        (A character spelled in a negated class is refused too.)"""
        import llguidance

        grammar = grammar_of(params)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            return problem
        unwritable = sorted(c for c in set(params.key()[1])
                            if not set(c.encode(errors="surrogatepass")) <= self._writable)
        if unwritable:
            return f"it holds characters no token of this model can write: {unwritable}"
        forced = llguidance.LLMatcher(self._tokenizer, grammar).compute_ff_bytes()
        if not set(forced) <= self._writable:
            return (f"it starts with {forced.decode(errors='replace')!r}, which has "
                    "characters no token of this model can write")
        return ""


class GuidedDecoding:
    """The model runner's matchers, one per guided request."""

    def __init__(self, tokenizer_loader: Any, vocab_size: int) -> None:
        self._load_tokenizer = tokenizer_loader  # called once (``warm``, or when first needed)
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}
        self._consumed: dict[str, int] = {}  # request id -> output tokens its matcher took
        self._loading: concurrent.futures.Future[Any] | None = None
        self._templates: dict[str, Any] = {}  # grammar -> its matcher at the start, kept
        self._starting = threading.Lock()  # compute lanes may ask for the vocabulary at once
        # grammars compiling off the engine step (``ready``): grammar -> (its compile,
        # when it began)
        self._compiling: dict[str, tuple[concurrent.futures.Future[Any], float]] = {}
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.compile_timeout = GRAMMAR_COMPILE_TIMEOUT

    def warm(self) -> None:
        """Read the vocabulary (0.6-1 s) in a thread now, while the engine starts, not in
        the step of the first guided request, which every request in it would wait for.
        Not a daemon thread: a process that ends sooner (a short offline run) waits for it,
        since a thread still in the tokenizer's native code while the interpreter shuts
        down can crash it (SIGSEGV at exit)."""
        with self._starting:
            if self._loading is None:
                self._loading = concurrent.futures.Future()
                threading.Thread(target=self._load, name="grammar-vocabulary").start()

    def _load(self) -> None:
        assert self._loading is not None
        try:
            self._loading.set_result(llg_tokenizer(self._load_tokenizer()))
            # the masks' module too: importing it compiles a torch function (~1.5 s on
            # two cores), which the first guided request's step would otherwise wait for
            import llguidance.torch  # noqa: F401
        except Exception as e:  # (raised again where the vocabulary is needed)
            if not self._loading.done():
                self._loading.set_exception(e)

    @property
    def _tokenizer(self) -> Any:
        with self._starting:
            if self._loading is None:
                self._loading = concurrent.futures.Future()
                self._load()
        return self._loading.result()

    def ready(self, params: Any) -> bool:
        """Whether a request can be scheduled: it follows no grammar, or its grammar is
        compiled (or failed, or ran past ``compile_timeout``: its first step fails it).
        The first ask starts the compile on a thread of its own, so that the scheduler
        holds the request back instead of a step waiting 0.3-5 ms for it (llguidance lets
        go of the GIL while it compiles)."""
        guided = getattr(params, "structured_outputs", None)
        if guided is None:
            return True
        grammar = grammar_of(guided)
        with self._lock:
            if grammar in self._templates:
                return True
            if grammar not in self._compiling:
                if self._compiler is None:
                    self._compiler = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="grammar-compile")
                self._compiling[grammar] = (self._compiler.submit(self._compile, grammar),
                                            time.monotonic())
                # (the grammars of requests aborted while they waited: the oldest go)
                while len(self._compiling) > _KEPT_GRAMMARS:
                    self._compiling.pop(next(iter(self._compiling)))
                return False
            compile_, began = self._compiling[grammar]
        return compile_.done() or time.monotonic() - began > self.compile_timeout

    def _compile(self, grammar: str) -> Any:
        import llguidance

        template = llguidance.LLMatcher(self._tokenizer, grammar)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def _new_matcher(self, grammar: str) -> Any:
        """A matcher at the start of ``grammar``: a copy of the one compiled for it before
        (~20 us), or of the one ``ready`` compiled, else compiled here (0.3-5 ms; a model
        runner of several ranks, whose scheduler does not ask) and kept for the next
        request that asks."""
        with self._lock:
            template = self._templates.pop(grammar, None)
            compiling = self._compiling.pop(grammar, None) if template is None else None
        if compiling is not None:
            compile_, _ = compiling
            if not compile_.done():  # (left to finish unheard)
                raise ValueError(f"it took longer than {self.compile_timeout:g} s to compile")
            template = compile_.result()  # (raises what the compile raised)
        if template is None:
            template = self._compile(grammar)
        with self._lock:
            self._templates[grammar] = template  # the most recent last
            while len(self._templates) > _KEPT_GRAMMARS:
                self._templates.pop(next(iter(self._templates)))
        return template.deep_copy()

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._consumed.pop(request_id, None)

    def masks(self, request_ids: list[str], params: list[Any],
              output_token_ids: list[list[int]]) -> tuple[list[int], torch.Tensor | None,
                                                          dict[str, str]]:
        """For a step's sampling rows: the guided rows, their allowed tokens [guided,
        vocab_size] (bool), and the requests whose grammar failed (id -> why)."""
        rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        failed: dict[str, str] = {}
        if not rows:
            return rows, None, failed
        # (not before: importing it compiles a torch function, most of a second)
        import llguidance.torch as llg_torch

        bitmask = llg_torch.allocate_token_bitmask(len(rows), self._tokenizer.vocab_size)
        kept = []
        for slot, row in enumerate(rows):
            request_id = request_ids[row]
            matcher = self._matchers.get(request_id)
            if matcher is None:
                try:  # (checked in the front end already; a failure here fails the request)
                    matcher = self._new_matcher(grammar_of(params[row].structured_outputs))
                except (ValueError, RuntimeError) as e:
                    failed[request_id] = f"the grammar cannot be used: {e}"
                    continue
                self._matchers[request_id], self._consumed[request_id] = matcher, 0
            done = self._consumed[request_id]
            pending = output_token_ids[row][done:]  # e.g. after a restart; usually none
            if pending and not matcher.consume_tokens(pending):
                failed[request_id] = f"the output left the grammar: {matcher.get_error()}"
                continue
            self._consumed[request_id] = done + len(pending)
            if matcher.is_error():
                failed[request_id] = f"the grammar failed: {matcher.get_error()}"
                continue
            llg_torch.fill_next_token_bitmask(matcher, bitmask, slot)
            kept.append(slot)
        guided = [rows[slot] for slot in kept]
        if not guided:
            return [], None, failed
        # int32 words, bit j of word w allowing token 32 w + j, to booleans
        words = bitmask[kept]
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(kept), -1)
        if allowed.shape[1] < self.vocab_size:  # ids past the tokenizer's: never allowed
            allowed = torch.nn.functional.pad(allowed, (0, self.vocab_size - allowed.shape[1]))
        allowed = allowed[:, :self.vocab_size]
        left = self._check_narrow_masks([request_ids[row] for row in guided], allowed)
        for row, any_left in zip(guided, left, strict=True):
            if not any_left:
                failed[request_ids[row]] = ("the grammar asks for characters no token of "
                                            "this model can write")
        if not all(left):
            guided = [row for row, ok in zip(guided, left, strict=True) if ok]
            allowed = allowed[torch.tensor(left)]
        return guided, (allowed if guided else None), failed

    def _check_narrow_masks(self, request_ids: list[str], allowed: torch.Tensor) -> list[bool]:
        """Clear from each narrow mask (a grammar's forced text) the tokens its matcher
        refuses: llguidance forces the tokens the tokenizer would spell the text with, and
        where the vocabulary lacks one of its bytes, those tokens spell other text. Whether
        each row has a token left; a wide mask is the lexer's own and kept as it is."""
        left = []
        for i, count in enumerate(allowed.sum(dim=1).tolist()):
            if count <= _NARROW_MASK:
                matcher = self._matchers[request_ids[i]]
                for token in allowed[i].nonzero().flatten().tolist():
                    # (special tokens, such as the end of text, spell no bytes)
                    if (not self._tokenizer.is_special_token(token)
                            and not matcher.validate_tokens([token])):
                        allowed[i, token] = False
                count = int(allowed[i].sum())
            left.append(count > 0)
        return left

    def advance(self, request_id: str, token: int) -> str | None:
        """Feed a guided request's sampled token to its matcher; why it failed, or None."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        if not matcher.consume_token(token):
            return f"the sampled token {token} left the grammar: {matcher.get_error()}"
        self._consumed[request_id] += 1
        return None
