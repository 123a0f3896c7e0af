"""Decode steps: a decoder layer's own forward, run over its parts' kernels directly.

On a single stream a decode step spends about as long in nn.Module's calls and in the
checks of each forward as in its kernels. So at the first decode-only step in bfloat16
(layers/stage.py) each layer's forward runs on a *view* of the layer: a plain object with
the layer's attributes and methods, in which every part is a function with that part's
call signature.

- A part that offers ``step_fn(dtype) -> (function, most rows) | None`` runs that: the
  kernels forward would call on a decode-only step, with forward's arguments, so the step
  computes the same bits. The linear layers (their product), RMSNorm, the gated MLP and
  the attention block (layers/self_attention.py: projections, rotary and paged attention
  in one function) have one.
- A module whose class sets ``decode_view = True`` (a decoder layer, or a block whose
  step_fn found no kernels) promises that its forward only calls its parts and reads its
  attributes; it is viewed in turn. A subclass whose forward does more sets it to False.
- Any other part (a mixture of experts, a tensor-parallel product that sums the ranks')
  runs its forward, bound, as the module call would.

A model file thus holds its forward only; a family's layer gets its step from it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# the most rows of a step function with no limit of its own
UNLIMITED = 1 << 30

Step = Callable[..., Any]


def decode_step(layer: nn.Module, dtype: torch.dtype = torch.bfloat16
                ) -> tuple[Step, int] | None:
    """``layer``'s forward for decode-only steps, and the most tokens it holds for; None
    where the layer cannot be viewed or no part of it has kernels here."""
    if not getattr(layer, "decode_view", False):
        return None
    step, limit, kernels = _step(layer, dtype)
    return (step, limit) if kernels else None


def _step(module: nn.Module, dtype: torch.dtype) -> tuple[Step, int, bool]:
    """(function, most rows, whether kernels are inside) of one part."""
    own = getattr(module, "step_fn", None)
    made = own(dtype) if own is not None else None
    if made is not None:
        return made[0], made[1], True
    if not getattr(module, "decode_view", False):
        return module.forward, UNLIMITED, False
    parts: dict[str, Step] = {}
    limit, kernels = UNLIMITED, False
    for name, child in module.named_children():
        parts[name], child_limit, child_kernels = _step(child, dtype)
        limit, kernels = min(limit, child_limit), kernels or child_kernels
    view = _view_class(type(module))()
    view.__dict__.update(module.__dict__)
    view.__dict__.update((k, v) for k, v in module._parameters.items() if v is not None)
    view.__dict__.update((k, v) for k, v in module._buffers.items() if v is not None)
    view.__dict__.update(parts)
    return view.forward, limit, kernels


@functools.cache
def _view_class(cls: type[nn.Module]) -> type:
    """A plain class with ``cls``'s own functions and attributes (those of its classes
    below nn.Module): its objects' attributes are read as fast as any object's, not
    through nn.Module's lookup."""
    namespace: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or issubclass(nn.Module, klass):
            continue  # nn.Module and its bases
        namespace.update((k, v) for k, v in vars(klass).items()
                         if k not in ("__dict__", "__weakref__", "__init__"))
    return type(f"{cls.__name__}View", (), namespace)
