"""LLaVA (``LlavaForConditionalGeneration``): a CLIP (or SigLIP) vision tower, a two-layer
projector into the language model's hidden size, and a language model of the text
families (Llama, Mistral, Qwen2, ...), whose image tokens' input embeddings are the
projected image features.

Checkpoints name the parts ``model.vision_tower.``, ``model.multi_modal_projector.``,
``model.language_model.`` and ``lm_head.`` (transformers 5), or, as older ones and the
hub's llava-1.5 folders do, ``vision_tower.vision_model.``, ``multi_modal_projector.``,
``language_model.model.`` and ``language_model.lm_head.``; both load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.config import text_architecture
from cpullm.model_executor.layers.linear import ReplicatedLinear
from cpullm.model_executor.layers.ops import KernelTable
from cpullm.model_executor.layers.quantization.base import QuantizationConfig
from cpullm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
)
from cpullm.model_executor.models.vision import VisionTransformer
from cpullm.multimodal import step_embeds

# the language models a LLaVA checkpoint may hold
_LANGUAGE_MODELS: dict[str, type[nn.Module]] = {
    cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)}
_PROJECTOR_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh":
                          lambda x: F.gelu(x, approximate="tanh")}


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(features))): the vision tower's hidden states (of each feature
    layer, side by side) to the language model's hidden size."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        width = config.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        hidden = config.text_config.hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        act = config.projector_hidden_act
        if act not in _PROJECTOR_ACTIVATIONS:
            raise ValueError(f"projector activation {act!r} is not supported "
                             f"({', '.join(_PROJECTOR_ACTIVATIONS)})")
        self.act = _PROJECTOR_ACTIVATIONS[act]
        self.linear_1 = ReplicatedLinear(width, hidden, bias=bias, dtype=dtype)
        self.linear_2 = ReplicatedLinear(hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


def _part(name: str) -> tuple[str, str]:
    """(part, name within it) of a checkpoint tensor: "vision", "projector" or "text"."""
    for prefix, part in (("model.vision_tower.", "vision"), ("vision_tower.", "vision"),
                         ("model.multi_modal_projector.", "projector"),
                         ("multi_modal_projector.", "projector"),
                         ("model.language_model.", "text:model."),
                         ("language_model.model.", "text:model."),
                         ("language_model.lm_head.", "text:lm_head."),
                         ("lm_head.", "text:lm_head.")):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if part == "vision":
                return part, rest.removeprefix("vision_model.")
            if part.startswith("text:"):
                return "text", part[len("text:"):] + rest
            return part, rest
    raise ValueError(f"checkpoint tensor {name} belongs to no part of a LLaVA model")


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config: Any, max_position: int, dtype: torch.dtype,
                 ops: KernelTable | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             "(default, full)")
        self.drop_class_token = strategy == "default"
        self.feature_layers = config.vision_feature_layer
        self.image_token_id = config.image_token_index
        self.vision_tower = VisionTransformer(config.vision_config, dtype)
        self.multi_modal_projector = LlavaProjector(config, dtype)
        text = config.text_config
        language_model = _LANGUAGE_MODELS.get(text_architecture(text))
        if language_model is None:
            raise ValueError(f"LLaVA with a {text_architecture(text)} language model is not "
                             f"supported ({', '.join(_LANGUAGE_MODELS)})")
        self.language_model = language_model(text, max_position, dtype, ops, quant_config)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] -> [images, image tokens, hidden]: what each
        image's placeholder tokens embed as (transformers' ``get_image_features``)."""
        layers = self.feature_layers
        picked = [self.vision_tower(pixel_values, layer)
                  for layer in ([layers] if isinstance(layers, int) else layers)]
        if self.drop_class_token:
            picked = [states[:, 1:] for states in picked]
        features = torch.cat(picked, dim=-1)
        images, tokens, width = features.shape
        return self.multi_modal_projector(features.reshape(-1, width)).view(images, tokens, -1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The language model's forward, the step's image tokens embedded as their
        images' features (multimodal.step_embeds, set by the model runner)."""
        images = step_embeds()
        if images is not None and intermediate is None:
            index, rows = images
            hidden = self.language_model.model.embed(input_ids)
            hidden[index] = rows.to(hidden.dtype)
            intermediate = (hidden, None)  # (the first layer starts the residual stream)
        return self.language_model(input_ids, positions, kv_caches, meta, intermediate)

    @property
    def lm_head(self) -> nn.Module:
        return self.language_model.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {"vision": [], "projector": [],
                                                            "text": []}
        for name, tensor in weights:
            part, rest = _part(name)
            parts[part].append((rest, tensor))
        self.vision_tower.load_weights(parts["vision"])
        projector = dict(self.multi_modal_projector.named_parameters())
        for name, tensor in parts["projector"]:
            param = projector.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor multi_modal_projector.{name} has no "
                                 "matching parameter")
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
        self.language_model.load_weights(parts["text"])
