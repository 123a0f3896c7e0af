"""Copy named checkpoint tensors into a model, loudly.

A checkpoint name either matches a parameter, or is one shard of a merged parameter
(``q_proj`` -> ``qkv_proj`` shard "q"). Loading fails on an unknown name, a missing
parameter or shard, a shape mismatch or a non-float tensor (unless the parameter takes
integers: a quantized format's packed weights); nothing is silently skipped. A parameter
marked ``optional`` (a quantized layer's, which has either a float weight or its format's
tensors) may be absent; its layer checks what it got.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from cpullm.model_executor.layers.stage import skipped_prefixes

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       stacked_params: dict[str, tuple[str, str | int]],
                       skip: set[str]) -> None:
    params = dict(model.named_parameters())
    expected: dict[str, set[str | int | None]] = {
        name: {None} for name, param in params.items() if not getattr(param, "optional", False)}
    for name in expected:
        for merged, _ in stacked_params.values():
            if f".{merged}." in name:
                expected[name] = {s for m, s in stacked_params.values() if m == merged}
    loaded: dict[str, set[str | int | None]] = {name: set() for name in params}
    other_stages = skipped_prefixes(model)  # pipeline parallelism: other stages' modules

    for ckpt_name, tensor in weights:
        if ckpt_name in skip or ckpt_name.endswith(_IGNORED_SUFFIXES) \
                or ckpt_name.startswith(other_stages):
            continue
        name, shard = ckpt_name, None
        for part, (merged, shard_id) in stacked_params.items():
            if f".{part}." in ckpt_name:
                name, shard = ckpt_name.replace(f".{part}.", f".{merged}."), shard_id
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name} has no matching parameter in "
                             f"{type(model).__name__}")
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() \
                and not getattr(param, "takes_integers", False):
            raise ValueError(f"checkpoint tensor {ckpt_name} has dtype {tensor.dtype}; "
                             "a floating-point tensor is expected")
        try:
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            elif param.shape != tensor.shape:
                raise ValueError(f"checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
        except ValueError as e:
            raise ValueError(f"cannot load {ckpt_name} into {name}: {e}") from None
        loaded[name].add(shard)

    missing = [f"{name}" + (f" (shards {sorted(map(str, want - loaded[name]))})"
                            if want != {None} else "")
               for name, want in expected.items() if want - loaded[name]]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing)}")
