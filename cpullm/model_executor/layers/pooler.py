"""Poolers: the hidden states of an input's tokens to one vector.

``PoolerConfig`` says how (vLLM's ``pooling_type`` names: MEAN, CLS, LAST) and whether to
normalize; a folder's sentence-transformers files (``modules.json``,
``1_Pooling/config.json``) set it, as sentence-transformers itself would run the model, and
``--override-pooler-config`` overrides it. ``pool`` works on the flat hidden states of a
whole batch at once (inputs one after another, their lengths given), with no loop over
the inputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from cpullm.utils import json_object

POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "CLS"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def override(self, value: str | dict[str, Any] | None) -> PoolerConfig:
        """This config with a user's overrides (JSON text or a dict, vLLM's field names)."""
        if value is None:
            return self
        value = json_object(value, "pooler config")
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler config: unknown fields {unknown} (pooling_type, "
                             "normalize)")
        fields = dict(value)
        if "pooling_type" in fields:
            fields["pooling_type"] = str(fields["pooling_type"]).upper()
        if "normalize" in fields and not isinstance(fields["normalize"], bool):
            raise ValueError("pooler config: normalize must be true or false")
        return replace(self, **fields)


# sentence-transformers' pooling modes (its ``pooling_mode`` names) -> ``pooling_type``;
# its others (max, mean_sqrt_len_tokens, weightedmean) are refused by name
ST_POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
# the boolean keys of the folders saved before sentence-transformers 6 -> the mode each sets
_ST_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean",
                    "pooling_mode_lasttoken": "lasttoken"}


def sentence_transformers_pooling(directory: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers folder asks for, or None if it has no
    ``modules.json``. Its Pooling module's config is read in both formats: ``pooling_mode``
    (a name or a list of names, sentence-transformers 6) and the older boolean
    ``pooling_mode_*_token(s)`` keys."""
    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type = "CLS"
    if "Pooling" in kinds:
        with open(os.path.join(directory, kinds["Pooling"].get("path", ""),
                               "config.json")) as f:
            pooling = json.load(f)
        if "pooling_mode" in pooling:
            modes = pooling["pooling_mode"]
            modes = [modes] if isinstance(modes, str) else list(modes)
        else:
            modes = [mode for key, mode in _ST_LEGACY_MODES.items() if pooling.get(key)]
        if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
            asked = " + ".join(map(str, modes)) or "none"
            raise ValueError(f"{directory}: sentence-transformers pooling {asked!r} is not "
                             f"supported (one of {', '.join(ST_POOLING_MODES)})")
        pooling_type = ST_POOLING_MODES[modes[0]]
    return PoolerConfig(pooling_type, normalize="Normalize" in kinds)


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """[inputs, hidden]: each input's vector from the flat hidden states [tokens, hidden]
    of inputs of ``lengths`` one after another."""
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    if pooling_type == "CLS":
        return hidden[starts]
    if pooling_type == "LAST":
        return hidden[ends - 1]
    # MEAN: the sum of each input's rows, in float32, over its length
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, owner, hidden.float())
    return sums / lengths[:, None].float()


def finish_embeddings(vectors: torch.Tensor, normalize: list[bool],
                      dimensions: list[int | None]) -> list[torch.Tensor]:
    """Each input's embedding in float32: its first ``dimensions`` (all with None), then
    scaled to unit length where ``normalize`` says."""
    out = []
    for vector, norm, dims in zip(vectors.float(), normalize, dimensions, strict=True):
        if dims is not None:
            vector = vector[:dims]
        out.append(F.normalize(vector, dim=0) if norm else vector)
    return out
