"""Tensors of a GGUF file under Hugging Face names: float tensors as float32, block types as
they are stored (``RawBlocks``), for the layers to keep quantized.

llama.cpp stores Llama's q/k projections with the rotary halves interleaved; their rows are
put back in Hugging Face's rotate-half order here (a row's blocks move with it). Qwen GGUF
files are stored unpermuted.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from cpullm.model_executor.layers.quantization.gguf import RawBlocks
from cpullm.model_executor.layers.quantization.gguf_blocks import FORMATS, KEPT_TYPES

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
    # mixtures of experts: the router, the experts (one 3-D tensor a projection, split per
    # expert), Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 2 and 3 norm before and after each block: llama.cpp's ffn_norm is the norm before
# the feed-forward block there, and the files store each norm's weight as 1 + w
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_ARCHITECTURES = {"gemma2", "gemma3"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = {"llama", "mistral"}


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if architecture in _GEMMA_ARCHITECTURES else _LAYER_NAMES
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name} is not known to cpullm")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"  # (experts: "{}" left in)


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of the rotary halves: a reordering of rows
    (of values, or of a row's blocks)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def iterate_gguf(path: str, num_heads: int, num_kv_heads: int
                 ) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
    """Every tensor of the file under its Hugging Face name: float types as float32
    tensors, block types as ``RawBlocks``. A type cpullm cannot run is refused by name."""
    architecture, tensors = _tensors(path)
    for gguf_name, qtype, array, shape in tensors:
        if gguf_name == "rope_freqs.weight":
            continue  # the rope's frequency factors: read into the config
        name = hf_name(gguf_name, architecture)
        if qtype not in _FLOAT_TYPES and qtype not in KEPT_TYPES:
            raise ValueError(f"GGUF tensor {gguf_name} has type {qtype.name}, which cpullm "
                             f"cannot run; supported: "
                             f"{', '.join(t.name for t in (*_FLOAT_TYPES, *KEPT_TYPES))}")
        if len(shape) == 3:  # [experts, rows, k]: the rows of each expert in turn
            if "{}" not in name:
                raise ValueError(f"GGUF tensor {gguf_name} is 3-D but not an expert tensor")
            rows = shape[1]
            for expert in range(shape[0]):
                yield _tensor(name.format(expert), qtype,
                              array[expert * rows:(expert + 1) * rows], shape[1:])
            continue
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, *shape)  # llama.cpp keeps the one-row gate as a vector
        if architecture in _PERMUTED_ARCHITECTURES:
            if name.endswith("q_proj.weight"):
                array = _unpermute(array, num_heads)
            elif name.endswith("k_proj.weight"):
                array = _unpermute(array, num_kv_heads)
        name, tensor = _tensor(name, qtype, array, shape)
        if (architecture in _GEMMA_ARCHITECTURES and name.endswith("norm.weight")
                and isinstance(tensor, torch.Tensor)):
            tensor = tensor - 1  # stored as 1 + w; the model's norms add the 1 themselves
        yield name, tensor


def prepared_ahead(weights: Iterator[tuple[str, torch.Tensor | RawBlocks]], workers: int
                   ) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
    """The same tensors in the same order, each block tensor taken apart (``prepare``) on
    one of ``workers`` threads a few tensors ahead of the caller: numpy and torch let go of
    the GIL in their array operations, so a file's tensors load on every core."""
    pending: deque[tuple[str, torch.Tensor | RawBlocks, Future | None]] = deque()
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="gguf-load") as pool:
        for name, tensor in weights:
            future = pool.submit(tensor.prepare) if isinstance(tensor, RawBlocks) else None
            pending.append((name, tensor, future))
            while len(pending) > 2 * workers or (pending and pending[0][2] is None):
                yield _ready(pending.popleft())
        while pending:
            yield _ready(pending.popleft())


def _ready(item: tuple[str, torch.Tensor | RawBlocks, Future | None]
           ) -> tuple[str, torch.Tensor | RawBlocks]:
    name, tensor, future = item
    if future is not None:
        future.result()  # (its error, if it failed)
    return name, tensor


def _tensor(name: str, qtype: GGMLQuantizationType, array: np.ndarray,
            shape: tuple[int, ...]) -> tuple[str, torch.Tensor | RawBlocks]:
    """A float type as a float32 tensor of ``shape``, a block type as its blocks."""
    if qtype in _FLOAT_TYPES:
        values = _FLOAT_TYPES[qtype](array).reshape(shape)
        # A writable array: torch refuses read-only memory (the file is memory-mapped).
        values = values.astype(np.float32, copy=not values.flags.writeable)
        return name, torch.from_numpy(values)
    return name, RawBlocks(qtype, array, tuple(shape))


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ggml's float types, read as values (of the raw bytes)
_FLOAT_TYPES = {GGMLQuantizationType.F32: lambda raw: raw.view(np.float32),
                GGMLQuantizationType.F16: lambda raw: raw.view(np.float16),
                GGMLQuantizationType.BF16: _bf16_to_f32}


def _tensors(path: str) -> tuple[str, Iterator[tuple[str, GGMLQuantizationType, np.ndarray,
                                                     tuple[int, ...]]]]:
    """The file's architecture, and its tensors one by one as (name, type, raw bytes
    [rows, bytes per row], shape in torch's order), read from the memory map as they are
    used. The tensor table comes from transformers' fast GGUF reader: gguf's own reader
    first walks every metadata value, the vocabulary included (1.7 of the 2.4 s the
    default model took to load). Files with a block type that reader cannot size (Q5_0,
    Q5_1, ...) take gguf's reader."""
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

    try:
        header = GgufHeader.from_file(path)
    except ValueError:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode(), (
            (t.name, GGMLQuantizationType(t.tensor_type), _rows(np.asarray(t.data), t.shape[::-1]),
             tuple(int(d) for d in t.shape[::-1])) for t in reader.tensors)
    raw = load_gguf_state_dict(header)
    return header.architecture, (
        (t.name, GGMLQuantizationType(t.ggml_type), _rows(np.asarray(raw[t.name].data), t.shape),
         tuple(t.shape)) for t in header.tensors)


def _rows(data: np.ndarray, shape) -> np.ndarray:
    """A tensor's bytes as [rows, bytes per row] (rows: every dimension but the last)."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return data.view(np.uint8).reshape(rows, -1)


def gguf_weight_bytes(path: str, dtype: torch.dtype, kept: bool = True) -> int:
    """The memory the file's tensors take once loaded: block types as kept (see
    ``FORMATS``; in ``dtype`` where ``kept`` is false: no quantized kernels), float types
    in ``dtype``. Read from the tensor table alone."""
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        table = [(GGMLQuantizationType(t.ggml_type), t.shape)
                 for t in GgufHeader.from_file(path).tensors]
    except ValueError:  # a type that table cannot size: gguf's reader
        table = [(GGMLQuantizationType(t.tensor_type), tuple(int(d) for d in t.shape))
                 for t in GGUFReader(path).tensors]
    element = torch.tensor([], dtype=dtype).element_size()
    total = 0.0
    for qtype, shape in table:
        numel = int(np.prod(shape))
        total += numel * (FORMATS[qtype].bytes_per_weight() if kept and qtype in FORMATS
                          else element)
    return int(total)
