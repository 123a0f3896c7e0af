"""LLMEngine: requests in, RequestOutputs out, one step at a time, in this process.

The engine is two halves that also run apart (the server runs the core in its own
process, cpullm/engine/core_proc.py): the front end (``Frontend``: tokenizer, prompts,
chat templates; ``OutputProcessor``: text, stop strings, RequestOutputs) and the
``EngineCore`` (scheduler and model runner).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from cpullm import envs
from cpullm.config import EngineConfig
from cpullm.engine.core import EngineCore
from cpullm.engine.core_proc import CoreClient
from cpullm.engine.output_processor import OutputProcessor
from cpullm.engine.request import RequestStatus
from cpullm.engine_args import EngineArgs
from cpullm.executor import UniProcExecutor
from cpullm.logger import init_logger
from cpullm.lora.request import LoRARequest
from cpullm.multimodal import ImageInput, image_inputs
from cpullm.outputs import PoolingRequestOutput, RequestOutput
from cpullm.pooling_params import PoolingParams
from cpullm.sampling_params import SamplingParams
from cpullm.structured_output import GrammarChecker
from cpullm.transformers_utils import load_tokenizer

if TYPE_CHECKING:
    from cpullm.engine.scheduler import Scheduler
    from cpullm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

Prompt = str | list[int] | dict[str, Any]

MAX_CACHE_SALT_LENGTH = 1024


def check_cache_salt(salt: object) -> None:
    """A cache salt is a non-empty string of at most 1024 characters, or None."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_LENGTH:
        raise ValueError(f"cache_salt: expected a non-empty string of at most "
                         f"{MAX_CACHE_SALT_LENGTH} characters")


class Frontend:
    """What the side that takes requests needs of the model: its tokenizer and chat
    template, the end-of-sequence ids, and the checks on a prompt. No weights."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model
        self.tokenizer = load_tokenizer(model_config.source, model_config.tokenizer,
                                        model_config.hf_config)
        if model_config.chat_template:
            self.tokenizer.chat_template = model_config.chat_template
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarChecker(self.tokenizer)
        self._processor: Any = None  # a vision-language model's, read at its first image

    def processor(self) -> Any:
        """A vision-language model's processor (transformers'), read once."""
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(
                self.config.model.source.directory, local_files_only=True)
        return self._processor

    def image_token(self) -> str:
        """The text that stands for an image in a prompt (LLaVA's "<image>")."""
        return self.processor().image_token

    def process_images(self, prompt: Prompt, add_special_tokens: bool = True
                       ) -> tuple[str, list[int], list[ImageInput]]:
        """A prompt with ``multi_modal_data`` ({"image": an image or a list}): its text
        through the model's processor (which expands each image token into the image's
        feature tokens), and its images."""
        from PIL import Image

        model_config = self.config.model
        if model_config.mm_config is None:
            raise ValueError(f"multi_modal_data: {model_config.architecture} takes no images")
        assert isinstance(prompt, dict)
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data: expected {\"image\": an image or a list of "
                             "images}")
        images = data.get("image") or []
        images = images if isinstance(images, list | tuple) else [images]
        if not all(isinstance(image, Image.Image) for image in images):
            raise ValueError("multi_modal_data: images must be PIL images")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("multi_modal_data: a prompt with images must be text (\"prompt\")")
        try:
            processed = self.processor()(text=text, images=[i.convert("RGB") for i in images]
                                         or None, return_tensors="pt",
                                         add_special_tokens=add_special_tokens)
        except ValueError as e:  # (the processor's own checks: placeholders and images)
            raise ValueError(f"multi_modal_data: {e}") from None
        token_ids = processed["input_ids"][0].tolist()
        if not images:
            return text, token_ids, []
        return text, token_ids, image_inputs(token_ids, processed["pixel_values"],
                                             model_config.mm_config.image_token_index)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for value in (getattr(self.config.model.hf_config, "eos_token_id", None),
                      self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(value)
        return ids

    @staticmethod
    def cache_salt(prompt: Prompt) -> str | None:
        """A dict prompt's ``cache_salt`` (vLLM's field), checked."""
        if not isinstance(prompt, dict):
            return None
        salt = prompt.get("cache_salt")
        check_cache_salt(salt)
        return salt

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt is text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}
        (either with an optional "cache_salt")."""
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                raise ValueError("multi_modal_data: images go through generate or chat")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, prompt
        raise ValueError("prompt: expected a string or a list of token ids, "
                         f"got {type(prompt).__name__}")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            chat_template: str | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            **template_kwargs: Any) -> str:
        if not messages:
            raise ValueError("messages: at least one message is required")
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("chat_template: the model has no chat template; pass one")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **template_kwargs)

    def check_lora(self, lora: LoRARequest | None) -> None:
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request: expected a LoRARequest, got {type(lora).__name__}")
        if self.config.model.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the engine runs without "
                             "LoRA (enable_lora=True, or --enable-lora)")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: token ids in its vocabulary.
        The offline API and the server both check here, before a request reaches the
        engine core, where a bad value would fail a whole step."""
        vocab = self.config.model.vocab_size
        limit = self.config.model.max_logprobs
        limit = vocab if limit == -1 else limit
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}: must be at most {limit} (the engine's "
                                 f"--max-logprobs), got {value}")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)

    def check_pooling(self, params: PoolingParams, token_ids: list[int]) -> list[int]:
        """What PoolingParams cannot check without the model: that it pools for this task,
        and embeds to the dimensions asked; the input's tokens, the last max length of
        them where ``truncate_prompt_tokens`` asks."""
        model = self.config.model
        wanted = {"embed": "embed", "classify": "classify", "score": "classify"}[params.task]
        if not model.is_pooling:
            raise ValueError(f"this model generates text; it does not {params.task} (serve "
                             "a pooling model: --task embed or score)")
        if wanted != model.task:
            served = "embed" if model.task == "embed" else "score"
            raise ValueError(f"this model is for --task {served}; it does not {params.task}")
        if params.dimensions is not None:
            sizes = getattr(model.hf_config, "matryoshka_dimensions", None)
            if not (getattr(model.hf_config, "is_matryoshka", False) or sizes):
                raise ValueError("dimensions: this model does not support Matryoshka "
                                 "embeddings (its vectors cannot be cut shorter)")
            hidden = model.hf_config.hidden_size
            if sizes and params.dimensions not in sizes or params.dimensions > hidden:
                raise ValueError(f"dimensions: {params.dimensions} is not one of the model's "
                                 f"({sizes or f'at most {hidden}'})")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = model.max_model_len if keep == -1 else min(keep, model.max_model_len)
            token_ids = token_ids[-keep:]
        self.check_prompt(token_ids, room_for_output=False)
        return token_ids

    def check_prompt(self, token_ids: list[int], room_for_output: bool = True) -> None:
        """``room_for_output``: a generated token must fit after the prompt (not for a
        pooling model's input, which may take the whole length)."""
        max_len = self.config.model.max_model_len
        if not token_ids:
            raise ValueError("prompt: the prompt is empty")
        if not room_for_output and len(token_ids) > max_len:
            raise ValueError(f"prompt: the input has {len(token_ids)} tokens, but the maximum "
                             f"model length is {max_len} (truncate_prompt_tokens cuts it)")
        if room_for_output and len(token_ids) >= max_len:
            raise ValueError(f"prompt: the prompt has {len(token_ids)} tokens, but the maximum "
                             f"model length is {max_len} (and at least one token must be "
                             "generated)")
        vocab = self.config.model.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")


class LLMEngine:
    """The engine loop in this process: ``add_request``, then ``step()`` until no request
    is left.

    Each step: 1. the scheduler picks requests and token counts, 2. the model runner runs
    one forward pass and samples, 3. the scheduler advances requests and applies token
    stops, 4. new tokens are detokenized, stop strings checked, outputs built.
    """

    def __init__(self, config: EngineConfig, multiprocess: bool | None = None) -> None:
        """``multiprocess``: the engine core in a process of its own (default:
        ``VLLM_ENABLE_V1_MULTIPROCESSING``, unset meaning no)."""
        replicas = config.parallel.data_parallel_size
        if replicas > 1:
            raise ValueError(f"data_parallel_size={replicas}: data-parallel replicas run "
                             "behind `cpullm serve`; an engine in this process is one replica")
        self.config = config
        self.frontend = Frontend(config)
        self.tokenizer = self.frontend.tokenizer
        self.eos_token_ids = self.frontend.eos_token_ids
        if multiprocess is None:
            multiprocess = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
        self.core: EngineCore | CoreClient = (CoreClient(config, self.eos_token_ids)
                                              if multiprocess
                                              else EngineCore(config, self.eos_token_ids))
        self.processor = OutputProcessor(self.tokenizer)
        self.failed: dict[str, Exception] = {}  # by the last step: request id -> error
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    @property
    def scheduler(self) -> Scheduler:
        return self._in_process().scheduler

    @property
    def model_runner(self) -> ModelRunner:
        executor = self._in_process().executor
        if not isinstance(executor, UniProcExecutor):
            raise AttributeError("the model runs in the ranks' worker processes")
        return executor.model_runner

    def _in_process(self) -> EngineCore:
        if not isinstance(self.core, EngineCore):
            raise AttributeError("the engine core runs in its own process")
        return self.core

    def bind_threads(self) -> None:
        """Pin the compute threads to the calling thread (the core's process pins its own)."""
        if isinstance(self.core, EngineCore):
            self.core.executor.bind_threads()

    def release_threads(self) -> None:
        """Give the calling thread its CPUs back."""
        if isinstance(self.core, EngineCore):
            self.core.executor.release_calling_thread()

    def shutdown(self) -> None:
        """Stop the engine core's process, if it has one, and the ranks' processes."""
        self.core.shutdown()

    @property
    def last_step_num_tokens(self) -> int:
        return self.core.last_step_num_tokens

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.frontend.tokenize_prompt(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any
                            ) -> str:
        return self.frontend.apply_chat_template(messages, *args, **kwargs)

    def add_request(self, request_id: str | None, prompt: Prompt,
                    params: SamplingParams | PoolingParams,
                    lora_request: LoRARequest | None = None,
                    images: list[ImageInput] | None = None) -> str:
        """Queue a request (with a LoRA adapter; ``images``: its token ids' images, as
        Frontend.process_images made them); returns its id. Bad prompts and adapters raise
        ValueError."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if isinstance(prompt, dict) and "multi_modal_data" in prompt and not images:
            text, token_ids, images = self.frontend.process_images(prompt)
        else:
            text, token_ids = self.frontend.tokenize_prompt(prompt)
        if isinstance(params, PoolingParams):
            token_ids = self.frontend.check_pooling(params, token_ids)
        else:
            self.frontend.check_prompt(token_ids)
            self.frontend.check_params(params)
        salt = self.frontend.cache_salt(prompt)
        self.frontend.check_lora(lora_request)
        for sequence in self.processor.add_request(request_id, text, token_ids, params, salt,
                                                   lora_request, images):
            try:
                self.core.add_request(sequence)
            except ValueError:  # (an in-process core reads the adapter here)
                self.core.finish_requests(self.processor.abort_request(request_id))
                raise
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.finish_requests(self.processor.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One step's RequestOutputs. Requests whose processing raised are dropped (their
        KV freed) and listed with their errors in ``failed`` until the next step."""
        step = self.processor.process(self.core.step())
        self.core.finish_requests(step.to_finish, RequestStatus.FINISHED_STOPPED)
        self.failed = step.failed
        return step.outputs
