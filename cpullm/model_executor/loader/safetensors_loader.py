from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def iterate_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's *.safetensors files, memory-mapped."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def safetensors_numel(files: list[str]) -> int:
    """The number of values in the files' tensors, from their headers (nothing is read)."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shape = f.get_slice(name).get_shape()
                total += int(torch.tensor(shape).prod()) if shape else 1
    return total
