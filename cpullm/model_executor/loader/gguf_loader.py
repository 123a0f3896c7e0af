"""Tensors of a GGUF file under Hugging Face names, dequantized to float32.

llama.cpp stores Llama's q/k projections with the rotary halves interleaved; they are put
back in Hugging Face's rotate-half order here. Qwen GGUF files are stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = {"llama", "mistral"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name} is not known to cpullm")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of the rotary halves."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def iterate_gguf(path: str, num_heads: int, num_kv_heads: int
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file, dequantized to float32, under its Hugging Face name."""
    architecture, tensors = _tensors(path)
    for gguf_name, array in tensors:
        name = hf_name(gguf_name)
        if architecture in _PERMUTED_ARCHITECTURES:
            if name.endswith("q_proj.weight"):
                array = _unpermute(array, num_heads)
            elif name.endswith("k_proj.weight"):
                array = _unpermute(array, num_kv_heads)
        # A writable array: torch refuses read-only memory (the file is memory-mapped).
        array = np.array(array, dtype=np.float32, copy=not array.flags.writeable)
        yield name, torch.from_numpy(array)


# ggml's float types, read as they are; every other type is blocks that gguf dequantizes
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


def _tensors(path: str) -> tuple[str, Iterator[tuple[str, np.ndarray]]]:
    """The file's architecture, and its tensors' values one by one (torch's shape order),
    read from the memory map as they are used. The tensor table comes from transformers'
    fast GGUF reader: gguf's own reader first walks every metadata value, the vocabulary
    included (1.7 of the 2.4 s the default model took to load). Files with a block type
    that reader cannot size (Q5_0, Q5_1, ...) take gguf's reader."""
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

    try:
        header = GgufHeader.from_file(path)
    except ValueError:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode(), (
            (t.name, dequantize(t.data, t.tensor_type)) for t in reader.tensors)
    raw = load_gguf_state_dict(header)

    def values(name: str, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
        data, qtype = np.asarray(raw[name].data), GGMLQuantizationType(ggml_type)
        if qtype in _FLOAT_TYPES:
            return data.view(_FLOAT_TYPES[qtype]).reshape(shape)
        # rows of blocks, [..., bytes per row] -> [..., elements per row]
        return dequantize(data.reshape(*shape[:-1], -1), qtype).reshape(shape)

    return header.architecture, ((t.name, values(t.name, t.ggml_type, t.shape))
                                 for t in header.tensors)
