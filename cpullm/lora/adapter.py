"""PEFT adapters from disk: ``adapter_config.json`` and ``adapter_model.safetensors`` (or
PEFT's older ``adapter_model.bin``), checked against the base model's linear layers."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from cpullm.lora.request import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.default)?\.weight$")
# the projections LoRA goes on: attention's and the MLP's, separate or as merged checkpoints
# (Phi-3) store them
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "qkv_proj", "gate_up_proj"})


@dataclass
class LoRAAdapter:
    """An adapter read: per base-model module (Hugging Face's name) A [rank, input] and B
    [output, rank] in float32, B with the adapter's scaling in it."""

    request: LoRARequest
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # a digest of the adapter's files: what prefix-cache blocks are keyed by
    key: str


def linear_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """{module name: (input, output features)} of the base model's linear layers, from
    transformers' model built on the meta device (no memory, no weights)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return {name: (module.in_features, module.out_features)
            for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _fail(request: LoRARequest, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {message}")


def _config(request: LoRARequest) -> dict[str, Any]:
    path = request.lora_path
    if not os.path.isdir(path):
        raise _fail(request, "no such folder")
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _fail(request, f"no {ADAPTER_CONFIG} in the folder") from None
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(request, f"cannot read {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise _fail(request, f"{ADAPTER_CONFIG} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise _fail(request, f"peft_type {kind!r}: only LORA adapters are supported")
    refused = [("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")]
    for key, what in refused:
        if config.get(key):
            raise _fail(request, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(request, f"bias={config['bias']!r}: adapters with biases are not supported")
    if config.get("modules_to_save"):
        raise _fail(request, f"modules_to_save {config['modules_to_save']}: adapters that "
                    "replace whole modules are not supported")
    return config


def _tensors(request: LoRARequest) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter's tensors and a digest of its files."""
    for name in ADAPTER_FILES:
        path = os.path.join(request.lora_path, name)
        if os.path.isfile(path):
            break
    else:
        raise _fail(request, f"no {' or '.join(ADAPTER_FILES)} in the folder")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    with open(os.path.join(request.lora_path, ADAPTER_CONFIG), "rb") as f:
        digest.update(f.read())
    try:
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file
            tensors = load_file(path)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise _fail(request, f"cannot read {name}: {e}") from None
    return tensors, digest.hexdigest()


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_adapter(request: LoRARequest, shapes: dict[str, tuple[int, int]],
                 max_rank: int) -> LoRAAdapter:
    """The adapter at ``request.lora_path``, checked: its modules are linear projections of
    the base model (``shapes``, linear_shapes) of their shapes, of rank at most
    ``max_rank``."""
    config = _config(request)
    tensors, key = _tensors(request)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name.removeprefix(_PREFIX))
        if match is None:
            raise _fail(request, f"tensor {name!r} is not a LoRA A or B matrix (embedding "
                        "and other adapters are not supported)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise _fail(request, "the file holds no LoRA weights")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    for module, pair in sorted(parts.items()):
        leaf = module.rsplit(".", 1)[-1]
        if module not in shapes:
            raise _fail(request, f"it targets {module!r}, which the base model does not have "
                        "as a linear layer: made for another model?")
        if leaf not in TARGETS or ".experts." in module:
            raise _fail(request, f"it targets {module!r}: LoRA is supported on "
                        f"{', '.join(sorted(TARGETS))} (not on experts)")
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{module!r} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        inputs, outputs = shapes[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inputs or b.shape != (outputs, rank):
            raise _fail(request, f"{module!r}: lora_A {tuple(a.shape)} and lora_B "
                        f"{tuple(b.shape)} do not fit the base model's layer of {inputs} "
                        f"inputs and {outputs} outputs: made for another model?")
        if rank > max_rank:
            raise _fail(request, f"rank {rank} is over --max-lora-rank {max_rank}")
        module_alpha = float(_pattern(config.get("alpha_pattern") or {}, module, alpha))
        scale = module_alpha / (math.sqrt(rank) if rslora else rank)
        modules[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return LoRAAdapter(request, max(a.shape[0] for a, _ in modules.values()), modules, key)
