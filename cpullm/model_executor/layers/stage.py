"""Pipeline stages: the part of a model one stage holds.

Under pipeline parallelism (cpullm/distributed.py) stage s holds a contiguous run of the
decoder layers; the first stage also the embedding table, the last the final norm and the
LM head (and the embedding table, where the head is tied to it). The modules a stage does
not hold are ``OtherStage`` placeholders: no parameters, and the loader skips the
checkpoint tensors under them. Layer indices stay the model's, so checkpoint names match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cpullm import distributed
from cpullm.model_executor.layers.decode_step import decode_step


class OtherStage(nn.Module):
    """A module another pipeline stage holds."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module belongs to another pipeline stage")


def stage_layers(num_layers: int) -> range:
    """The decoder layers this rank's stage holds."""
    return distributed.layout().stage_layers(num_layers)


def build_layers(num_layers: int, make: Callable[[int], nn.Module]) -> nn.ModuleList:
    """Layer i from ``make(i)`` for the layers of this stage, placeholders for the rest."""
    held = stage_layers(num_layers)
    return nn.ModuleList(make(i) if i in held else OtherStage() for i in range(num_layers))


def first_stage_only(make: Callable[[], nn.Module], also_last: bool = False) -> nn.Module:
    """``make()`` on the first stage (and the last, with ``also_last``), else a
    placeholder."""
    layout = distributed.layout()
    held = layout.is_first_stage or (also_last and layout.is_last_stage)
    return make() if held else OtherStage()


def last_stage_only(make: Callable[[], nn.Module]) -> nn.Module:
    return make() if distributed.layout().is_last_stage else OtherStage()


def run_layers(layers: nn.ModuleList, positions: torch.Tensor, hidden: torch.Tensor,
               residual: torch.Tensor | None, kv_caches: list[torch.Tensor],
               meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This stage's decoder layers over (hidden, residual); ``kv_caches``: one per layer
    of the stage. A decode-only step runs the layers' decode steps where every layer has
    one (layers/decode_step.py)."""
    held = stage_layers(len(layers))
    steps = _decode_steps(layers, held, hidden, residual, kv_caches, meta)
    if steps is not None:
        for step, kv_cache in zip(steps, kv_caches, strict=True):
            hidden, residual = step(positions, hidden, residual, kv_cache, meta)
    else:
        for index, kv_cache in zip(held, kv_caches, strict=True):
            hidden, residual = layers[index](positions, hidden, residual, kv_cache, meta)
    assert residual is not None
    return hidden, residual


# bfloat16 caches, and the quantized ones (--kv-cache-dtype) the steps' kernels read
_STEP_CACHE_DTYPES = (torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def _decode_steps(layers: nn.ModuleList, held: range, hidden: torch.Tensor,
                  residual: torch.Tensor | None, kv_caches: list[torch.Tensor], meta: Any
                  ) -> list[Callable[..., tuple[torch.Tensor, torch.Tensor]]] | None:
    """The held layers' decode steps, where this step is one they hold for: every token a
    sequence's next, in bfloat16, the tensors as the steps take them. Made at the first
    decode step and kept on ``layers``."""
    rows = hidden.shape[0]
    if (getattr(meta, "num_decode_tokens", None) != rows or hidden.dtype != torch.bfloat16
            or not hidden.is_contiguous()
            or (residual is not None and not residual.is_contiguous())
            or any(slots.dtype != torch.long or not slots.is_contiguous()
                   for slots in meta.slot_mapping)
            or any(cache.dtype not in _STEP_CACHE_DTYPES or not cache.is_contiguous()
                   for cache in kv_caches)):
        return None
    plan = layers.__dict__.get("decode_plan")
    if plan is None:
        made = [decode_step(layers[index]) for index in held]
        plan = (([step for step, _ in made], min(limit for _, limit in made))
                if made and all(m is not None for m in made) else ([], 0))
        layers.decode_plan = plan
    steps, limit = plan
    return steps if rows <= limit else None


class StagedDecoder(nn.Module):
    """A decoder model's body as a pipeline stage holds it: subclasses hold
    ``embed_tokens`` (first stage), ``layers`` (``build_layers``) and ``norm`` (last stage),
    and say in ``embed`` how token ids become the first hidden states."""

    layers: nn.ModuleList
    norm: nn.Module

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states; on a stage before the last, (hidden, residual) for the
        next stage, which passes them as ``intermediate``."""
        if intermediate is None:
            hidden, residual = self.embed(input_ids), None  # [num_tokens, hidden_size]
        else:
            hidden, residual = intermediate
        hidden, residual = run_layers(self.layers, positions, hidden, residual, kv_caches, meta)
        if not distributed.layout().is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


def skipped_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The names (with a trailing dot) of the modules another stage holds."""
    return tuple(f"{name}." for name, module in model.named_modules()
                 if isinstance(module, OtherStage))
