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


def iterate_pickle(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's PyTorch pickle files (``--load-format
    pt``), read with torch's weights-only unpickler: it builds tensors and plain containers
    only, and refuses any other object a file names (which a full unpickler would run)."""
    files = sorted(p for p in glob.glob(os.path.join(directory, "*"))
                   if p.endswith((".bin", ".pt", ".pth")))
    for path in files:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - the unpickler's refusal, named
            raise ValueError(f"model: cannot load {os.path.basename(path)} as weights only: "
                             f"{e}") from None
        if not isinstance(state, dict):
            raise ValueError(f"model: {os.path.basename(path)} holds a "
                             f"{type(state).__name__}, not a state dict of tensors")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor


def mxfp4_bytes(files: list[str]) -> int:
    """The bytes of the files' MXFP4 tensors (``*_blocks`` and ``*_scales``, uint8), from
    their headers."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(("_blocks", "_scales")):
                    shape = f.get_slice(name).get_shape()
                    total += int(torch.tensor(shape).prod()) if shape else 1
    return total


def safetensors_numel(files: list[str]) -> int:
    """The number of values in the files' tensors, from their headers (nothing is read).
    MXFP4 tensors (gpt-oss's experts) count as the values they hold once dequantized: two
    a byte of ``*_blocks``; their ``*_scales`` none."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shape = f.get_slice(name).get_shape()
                numel = int(torch.tensor(shape).prod()) if shape else 1
                if name.endswith("_blocks"):
                    numel *= 2
                elif name.endswith("_scales"):
                    numel = 0
                total += numel
    return total
