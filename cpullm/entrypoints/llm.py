"""LLM: offline batched generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from cpullm import beam_search
from cpullm.beam_search import BeamSearchOutput, BeamSearchParams
from cpullm.engine.llm_engine import LLMEngine, Prompt
from cpullm.engine_args import EngineArgs
from cpullm.logger import logging_to_tqdm
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput
from cpullm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids or a dict) or a list of them, as a list."""
    if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _chat_images(conversation: list[Message], frontend: Any
                 ) -> tuple[list[Message], list[Any]]:
    """A conversation's image parts (PIL images, loaded), and the conversation with each
    message's parts as text, an image part the model's image token in its place; the
    conversation as it is where it has none."""
    from cpullm.entrypoints.openai.media import MediaPolicy, load_image

    def is_image(part: Any) -> bool:
        return isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")

    if not any(isinstance(m.get("content"), list) and any(map(is_image, m["content"]))
               for m in conversation):
        return conversation, []
    token = frontend.image_token() if frontend.config.model.mm_config is not None else None
    if token is None:
        raise ValueError(f"{frontend.config.model.architecture} takes no images")
    policy = MediaPolicy(allowed_local_path="/", allow_remote=True)  # (the caller's own)
    pictures, rendered = [], []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        text = []
        for part in content:
            if part.get("type") == "image_pil":
                pictures.append(part["image_pil"])
            elif part.get("type") == "image_url":
                pictures.append(load_image(part["image_url"]["url"], policy,
                                           f"messages[{i}]: image_url"))
            else:
                text.append(part.get("text", ""))
                continue
            text.append(token)
        rendered.append({**message, "content": "".join(text)})
    return rendered, pictures


def _params_list(params: Any, count: int, name: str) -> list[Any]:
    """One params object for every prompt, or a list of one per prompt."""
    if isinstance(params, SamplingParams | PoolingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{name}: {len(params)} given for {count} prompts")
    return params


class LLM:
    """Load a model once, then ``generate`` or ``chat`` over batches of prompts; or, for a
    pooling model, ``embed``, ``classify``, ``score`` or ``encode`` them.

    ``LLM()`` with no model loads the default model, SmolLM2-135M-Instruct;
    ``LLM(task="embed")`` the default embedding model, all-MiniLM-L6-v2. Keyword
    arguments are EngineArgs fields (``dtype``, ``max_model_len``, ``block_size``,
    ``kv_cache_memory_bytes``, ``max_num_seqs``, ``max_num_batched_tokens``, ``seed``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_engine_args(engine_args)
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.
        ``lora_request``: one LoRA adapter for every prompt, or one (or None) per prompt
        (the engine made with ``enable_lora=True``)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = _params_list(sampling_params, len(prompts), "sampling_params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        return self._submit(prompts, params_list, use_tqdm, loras)  # type: ignore[return-value]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The ``beam_width`` best sequences of every prompt (vLLM's ``LLM.beam_search``),
        searched as transformers' ``generate(num_beams=...)`` searches; the beams of every
        prompt are scored together, one batch a step."""
        engine = self.llm_engine
        frontend = engine.frontend
        beam_search.check_width(params, engine.config.model.max_logprobs,
                                engine.config.model.vocab_size, frontend.eos_token_ids)
        searches = []
        for prompt in _prompt_list(prompts):
            _, token_ids = engine.tokenize_prompt(prompt)
            frontend.check_prompt(token_ids)
            beam_search.check_length(token_ids, params, engine.config.model.max_model_len)
            searches.append(beam_search.BeamSearch(token_ids, params, frontend.eos_token_ids))
        beam_search.run(searches, lambda batch, step: self.generate(
            [{"prompt_token_ids": tokens} for tokens in batch], step, use_tqdm=use_tqdm))
        decode = engine.tokenizer.decode
        return [search.output(lambda ids: decode(ids, skip_special_tokens=True))
                for search in searches]

    def _submit(self, prompts: list[Prompt],
                params_list: Sequence[SamplingParams | PoolingParams], use_tqdm: bool,
                loras: Sequence[LoRARequest | None] | None = None,
                images: Sequence[list[ImageInput]] | None = None
                ) -> list[RequestOutput | PoolingRequestOutput]:
        """Queue every prompt (each with a copy of its params), run them all, and return
        the outputs in the order of the prompts, each once it is finished."""
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                params = params.clone()
                if isinstance(params, SamplingParams):
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.add_request(None, prompt, params, loras[i] if loras else None,
                                              images[i] if images else None))
            return self._run(ids, use_tqdm)
        finally:
            engine.abort_request(ids)  # after an error, leave nothing queued

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Run a pooling model over every prompt: its pooled tensor (``outputs.data``)."""
        prompts = _prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(
                task="embed" if self.llm_engine.config.model.task == "embed" else "classify")
        params_list = _params_list(pooling_params, len(prompts), "pooling_params")
        return self._submit(prompts, params_list, use_tqdm)  # type: ignore[return-value]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (``outputs.embedding``), as the model's pooler makes
        it; ``truncate_prompt_tokens``: keep the last so many tokens of a longer prompt."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        if truncate_prompt_tokens is not None:
            params.truncate_prompt_tokens = truncate_prompt_tokens
        return [EmbeddingRequestOutput.from_base(o)
                for o in self.encode(prompts, params, use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
                 ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities per prompt (``outputs.probs``)."""
        return [ClassificationRequestOutput.from_base(o) for o in
                self.encode(prompts, PoolingParams(task="classify"), use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
              ) -> list[ScoringRequestOutput]:
        """The relevance of each pair: one ``text_1`` against every ``text_2``, or pair by
        pair. A cross-encoder reads each pair together; an embedding model scores the
        cosine similarity of the two embeddings (vLLM's rule)."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise ValueError(f"score: {len(firsts)} first texts for {len(seconds)} second "
                             "texts; give one first text, or as many as second texts")
        if self.llm_engine.config.model.task == "embed":
            vectors = self.embed(firsts + seconds, use_tqdm=use_tqdm,
                                 truncate_prompt_tokens=truncate_prompt_tokens)
            n = len(firsts)
            return [ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}",
                ScoringOutput(float(torch.nn.functional.cosine_similarity(
                    torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                    dim=0))),
                a.prompt_token_ids + b.prompt_token_ids)
                for a, b in zip(vectors[:n], vectors[n:], strict=True)]
        tokenizer = self.llm_engine.tokenizer
        pairs: list[Prompt] = [{"prompt_token_ids": tokenizer(a, b)["input_ids"]}
                               for a, b in zip(firsts, seconds, strict=True)]
        params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                     o.prompt_token_ids)
                for o in self.encode(pairs, params, use_tqdm)]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.
        A vision-language model's messages may hold image parts, as vLLM's:
        ``{"type": "image_url", "image_url": {"url": ...}}`` (a data URL, a file or an
        http(s) URL) or ``{"type": "image_pil", "image_pil": PIL image}``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        images: list[list[ImageInput]] = []
        frontend = self.llm_engine.frontend
        for conversation in conversations:
            conversation, pictures = _chat_images(conversation, frontend)
            text = self.llm_engine.apply_chat_template(
                conversation, chat_template, add_generation_prompt, continue_final_message,
                **(chat_template_kwargs or {}))
            # The template already holds any BOS token: do not add special tokens again.
            if pictures:
                _, ids, inputs = frontend.process_images(
                    {"prompt": text, "multi_modal_data": {"image": pictures}},
                    add_special_tokens=False)
            else:
                ids, inputs = self.llm_engine.tokenizer.encode(text, add_special_tokens=False), []
            prompts.append({"prompt_token_ids": ids})
            images.append(inputs)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = _params_list(sampling_params, len(prompts), "sampling_params")
        loras = list(lora_request) if isinstance(lora_request, list | tuple) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} "
                             "conversations")
        return self._submit(prompts, params_list, use_tqdm, loras,  # type: ignore[return-value]
                            images)

    def _run(self, request_ids: list[str], use_tqdm: bool
             ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        # Pinned before the bar starts (its log line would land on the bar), and after the
        # prompts are tokenized: threads this thread starts later inherit its one CPU, and
        # the tokenizer starts its helper threads on first use.
        engine.bind_threads()
        try:
            return self._steps(request_ids, use_tqdm)
        finally:
            engine.release_threads()

    def _steps(self, request_ids: list[str], use_tqdm: bool
               ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm or len(request_ids) < 2)
        num_prompt_tokens = num_output_tokens = 0
        with logging_to_tqdm():
            while engine.has_unfinished_requests():
                step_outputs = engine.step()
                if engine.failed:
                    request_id, error = next(iter(engine.failed.items()))
                    raise RuntimeError(f"request {request_id} failed: {error!r}") from error
                for output in step_outputs:
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):
                        num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"input: {num_prompt_tokens / elapsed:.1f} toks/s, "
                                        f"output: {num_output_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()
        return [finished[request_id] for request_id in request_ids]
