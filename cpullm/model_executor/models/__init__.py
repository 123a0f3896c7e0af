"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from cpullm.model_executor.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
)
from cpullm.model_executor.models.glm import Glm4ForCausalLM, GlmForCausalLM
from cpullm.model_executor.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
