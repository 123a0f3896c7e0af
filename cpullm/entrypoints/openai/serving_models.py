"""The server's models: the base model and its LoRA adapters (``--lora-modules``, and
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` where
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` allows), as /v1/models lists them and as a request's
``model`` picks one.

An adapter is read and checked against the base model here when it is added, so a bad one
is refused at once; each engine core reads it again at its first request. Unloading takes
the name away: new requests for it are refused, and those running finish with it."""

from __future__ import annotations

import itertools
import json
from typing import Any

from cpullm.config import ModelConfig
from cpullm.entrypoints.openai.protocol import ModelCard
from cpullm.entrypoints.openai.serving_engine import OpenAIError
from cpullm.lora.adapter import linear_shapes, read_adapter
from cpullm.lora.request import LoRARequest


def parse_lora_module(value: str) -> dict[str, Any]:
    """One --lora-modules value, vLLM's forms: ``name=path``, or JSON with ``name``,
    ``path`` and, optionally, ``base_model_name``."""
    if value.lstrip().startswith("{"):
        try:
            module = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r}: not JSON: {e}") from None
        if not isinstance(module, dict) or not {"name", "path"} <= module.keys() \
                or not module.keys() <= {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules {value!r}: JSON takes name, path and "
                             "base_model_name")
        return module
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected name=path or JSON")
    return {"name": name, "path": path}


class ServingModels:
    def __init__(self, model_config: ModelConfig, served_model_name: str) -> None:
        self.config = model_config
        self.base = served_model_name
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: an id names one adapter's files
        self._shapes: dict[str, tuple[int, int]] | None = None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Read and check the adapter at ``path`` and serve it as ``name``; ValueError
        where it cannot be."""
        lora_config = self.config.lora
        if lora_config is None:
            raise ValueError("LoRA adapters need --enable-lora")
        if name == self.base or name in self.loras:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, next(self._ids), path, base_model_name or self.base)
        if self._shapes is None:
            self._shapes = linear_shapes(self.config.hf_config)
        read_adapter(request, self._shapes, lora_config.max_lora_rank)
        self.loras[name] = request
        return request

    def remove(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a name
        served here neither as the model nor as an adapter."""
        if model is None or model == self.base:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return lora

    def cards(self) -> list[dict[str, Any]]:
        source = self.config.source
        cards = [ModelCard(id=self.base, root=str(source.gguf_path or source.directory),
                           max_model_len=self.config.max_model_len)]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_path,
                            parent=lora.base_model_name) for lora in self.loras.values()]
        return [card.model_dump() for card in cards]
