"""Images in prompts: what a request carries of each (its placeholder tokens' place, a hash
of it, the processor's pixel values), and the step's image embeddings handed to the model.

The front end runs the model's own processor from transformers (its image processor and
its expansion of the image token into one token per image feature); the engine core keys
the prefix-cache blocks that hold an image's tokens by the image's hash; the model runner
encodes each image once, when a step first reaches its tokens, keeps the embeddings until
the request's computed tokens pass them (chunked prefill takes slices of the same
embeddings), and the model puts them in place of the placeholders' token embeddings."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import torch

# architectures whose prompts take images (the model classes in model_executor/models)
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)


@dataclass
class ImageInput:
    """One image of a prompt: its placeholder tokens [offset, offset + length) and the
    pixel values the model's vision tower takes."""

    offset: int
    length: int
    hash: str  # of the pixel values: equal images share prefix-cache blocks, others never
    pixel_values: torch.Tensor  # [channels, height, width], float32

    def encode(self) -> list[Any]:
        pixels = self.pixel_values.contiguous()
        return [self.offset, self.length, self.hash, list(pixels.shape),
                pixels.numpy().tobytes()]

    @classmethod
    def decode(cls, data: list[Any]) -> ImageInput:
        offset, length, digest, shape, raw = data
        pixels = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(shape)
        return cls(offset, length, digest, pixels)


def image_inputs(token_ids: list[int], pixel_values: torch.Tensor, image_token_id: int
                 ) -> list[ImageInput]:
    """The images of a processed prompt: each run of ``image_token_id`` is one image's
    placeholder, in the order of ``pixel_values``."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) != len(pixel_values):
        raise ValueError(f"the prompt has {len(runs)} image placeholders for "
                         f"{len(pixel_values)} images")
    images = []
    for (offset, length), pixels in zip(runs, pixel_values, strict=True):
        pixels = pixels.float().contiguous()
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        images.append(ImageInput(offset, length, digest, pixels))
    return images


_step = threading.local()  # this thread's step (compute lanes run steps side by side)


def set_step_embeds(embeds: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The step's image embeddings: (flat token indices, their rows), or None."""
    _step.embeds = embeds


def step_embeds() -> tuple[torch.Tensor, torch.Tensor] | None:
    return getattr(_step, "embeds", None)
