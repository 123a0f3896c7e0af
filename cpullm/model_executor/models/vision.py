"""Vision towers of the vision-language models: CLIP's (LLaVA) and SigLIP's (Gemma 3,
Idefics3 / SmolVLM) encoders, on the same linear layers (and so the same bfloat16 GEMMs) as
the language models.

Parameter names mirror Hugging Face's ``CLIPVisionModel`` / ``SiglipVisionModel`` below
their ``vision_model.`` (``embeddings.*``, ``encoder.layers.N.*``), except that q, k and v
are merged into ``self_attn.qkv_proj`` and the patch embedding's convolution runs as a
linear layer over the patches' pixels (its weight [hidden, channels, p, p] read as
[hidden, channels x p x p]). Every image of a batch has the processor's one size, so
attention runs over [images, heads, patches, head_dim] in one call, unmasked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpullm.model_executor.layers.linear import ReplicatedLinear
from cpullm.model_executor.loader.weights import load_named_weights


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# model_type -> (a class token, a LayerNorm before the layers, last_hidden_state normed)
_KINDS = {"clip_vision_model": (True, True, False), "siglip_vision_model": (False, False, True)}


class _Merged(ReplicatedLinear):
    """q, k and v as one replicated product (shards 0, 1, 2 of equal size)."""

    shard_ids = (0, 1, 2)

    def shard_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id is None:
            return 0, self.output_size
        size = self.output_size // 3
        return int(shard_id) * size, (int(shard_id) + 1) * size


class VisionAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = _Merged(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.out_proj = ReplicatedLinear(hidden, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, patches, hidden = x.shape
        qkv = self.qkv_proj(x.reshape(-1, hidden)).view(images, patches, 3, self.num_heads,
                                                         self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [images, heads, patches, dim]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(-1, hidden)).view(x.shape)


class VisionMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision tower activation {config.hidden_act!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.fc1 = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True,
                                    dtype=dtype)
        self.fc2 = ReplicatedLinear(config.intermediate_size, config.hidden_size, bias=True,
                                    dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        mlp = self.mlp(self.layer_norm2(x).reshape(-1, x.shape[-1]))
        return x + mlp.view(x.shape)


class VisionEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, class_token: bool,
                 patch_bias: bool) -> None:
        super().__init__()
        self.patch = config.patch_size
        self.channels = getattr(config, "num_channels", 3)
        self.patch_embedding = ReplicatedLinear(self.channels * self.patch ** 2,
                                                config.hidden_size, bias=patch_bias, dtype=dtype)
        weight = self.patch_embedding.weight
        weight.weight_loader = self._load_patch_weight  # type: ignore[attr-defined]
        num_patches = (config.image_size // self.patch) ** 2
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype),
                                            requires_grad=False) if class_token else None
        self.position_embedding = nn.Embedding(num_patches + class_token, config.hidden_size,
                                               dtype=dtype)

    def _load_patch_weight(self, param: nn.Parameter, loaded: torch.Tensor,
                           shard_id: Any = None) -> None:
        """The convolution's kernel [hidden, channels, p, p] as the linear layer's weight."""
        self.patch_embedding.weight_loader(param, loaded.reshape(loaded.shape[0], -1))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        images, channels, height, width = pixel_values.shape
        p = self.patch
        if channels != self.channels or height % p or width % p:
            raise ValueError(f"pixel values of shape {tuple(pixel_values.shape)} for patches "
                             f"of {p} pixels and {self.channels} channels")
        # [images x patches, channels x p x p], each patch's pixels in the kernel's order
        patches = pixel_values.reshape(images, channels, height // p, p, width // p, p) \
            .permute(0, 2, 4, 1, 3, 5).reshape(-1, channels * p * p)
        x = self.patch_embedding(patches.to(self.position_embedding.weight.dtype))
        x = x.view(images, -1, x.shape[-1])
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(images, 1, -1), x], dim=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"{x.shape[1]} positions in an image of {height}x{width}; the "
                             f"vision tower has {self.position_embedding.num_embeddings}")
        return x + self.position_embedding.weight


class VisionTransformer(nn.Module):
    """A CLIP or SigLIP vision encoder (``config``: its ``vision_config``)."""

    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2)}

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if config.model_type not in _KINDS:
            raise ValueError(f"vision tower {config.model_type!r} is not supported "
                             f"({', '.join(_KINDS)})")
        class_token, pre_norm, self.norm_last = _KINDS[config.model_type]
        eps = config.layer_norm_eps
        self.embeddings = VisionEmbeddings(config, dtype, class_token,
                                           patch_bias=not class_token)
        # (CLIP's checkpoints spell it "pre_layrnorm")
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype) \
            if pre_norm else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(config, dtype)
                                            for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """[images, channels, height, width] -> [images, positions, hidden]: transformers'
        ``hidden_states[layer]`` (0: the embeddings; negative from the end), or with
        ``layer`` None its ``last_hidden_state`` (SigLIP's after the final LayerNorm)."""
        layers = self.encoder.layers
        count = len(layers) if layer is None else layer % (len(layers) + 1)
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for block in layers[:count]:
            x = block(x)
        return self.post_layernorm(x) if layer is None and self.norm_last else x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A vision model's tensors, named below its ``vision_model.`` (SigLIP's pooling
        head, which the language models do not use, is skipped)."""
        load_named_weights(self, ((name, tensor) for name, tensor in weights
                                  if not name.startswith("head.")), self.stacked_params, set())
