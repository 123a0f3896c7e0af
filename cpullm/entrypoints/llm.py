"""LLM: offline batched generation, shaped like vLLM's ``LLM``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from cpullm.engine.llm_engine import LLMEngine, Prompt
from cpullm.engine_args import EngineArgs
from cpullm.logger import logging_to_tqdm
from cpullm.outputs import RequestOutput
from cpullm.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]


class LLM:
    """Load a model once, then ``generate`` or ``chat`` over batches of prompts.

    ``LLM()`` with no model loads the default model, SmolLM2-135M-Instruct. Keyword
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
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        if isinstance(prompts, str | dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for "
                                 f"{len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.add_request(None, prompt, params))
            return self._run(ids, use_tqdm)
        finally:
            engine.abort_request(ids)  # after an error, leave nothing queued

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.llm_engine.apply_chat_template(
                conversation, chat_template, add_generation_prompt, continue_final_message,
                **(chat_template_kwargs or {}))
            # The template already holds any BOS token: do not add special tokens again.
            ids = self.llm_engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids})
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        # Pinned before the bar starts (its log line would land on the bar), and after the
        # prompts are tokenized: threads this thread starts later inherit its one CPU, and
        # the tokenizer starts its helper threads on first use.
        engine.bind_threads()
        try:
            return self._steps(request_ids, use_tqdm)
        finally:
            engine.release_threads()

    def _steps(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
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
                    num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"input: {num_prompt_tokens / elapsed:.1f} toks/s, "
                                        f"output: {num_output_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()
        return [finished[request_id] for request_id in request_ids]
