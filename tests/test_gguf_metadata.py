"""cpullm's fast reading of a GGUF file's config and tokenizer gives what transformers' own
GGUF loader gives, for every architecture cpullm reads that way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from cpullm.transformers_utils import (
    gguf_config,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)


@pytest.fixture(scope="module")
def default_fields():
    """The metadata of the default model's GGUF file (its tokenizer included)."""
    reader = GGUFReader(resolve_model(None).gguf_path)
    return [(f.name, f.types, f.contents()) for f in reader.fields.values()
            if not f.name.startswith("GGUF.") and f.name != "general.architecture"]


def write_gguf(path: Path, fields, architecture: str, name: str | None = None,
               untied: bool = False) -> Path:
    """The default model's metadata under another architecture, with two tiny tensors."""
    writer = GGUFWriter(str(path), architecture)
    for key, types, value in fields:
        if key.startswith("llama."):
            key = architecture + key[len("llama"):]
        if key == "general.name" and name is not None:
            value = name
        writer.add_key_value(key, value, types[0],
                             sub_type=types[1] if types[0] == GGUFValueType.ARRAY else None)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    if untied:
        writer.add_tensor("output.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CASES = {
    "llama-untied": dict(architecture="llama", untied=True),
    "mistral": dict(architecture="llama", name="mistral"),
    "qwen2": dict(architecture="qwen2"),
    "qwen3": dict(architecture="qwen3"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_config_and_tokenizer_equal_transformers(case, default_fields, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = write_gguf(tmp_path / f"{case}.gguf", default_fields, **CASES[case])
    reference = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    config = gguf_config(str(path))
    assert type(config) is type(reference)
    assert config.to_dict() == reference.to_dict()
    assert config.tie_word_embeddings == (case != "llama-untied")
    assert config.model_type == {"mistral": "mistral", "qwen2": "qwen2",
                                 "qwen3": "qwen3"}.get(case, "llama")

    source = resolve_model(str(path))
    tokenizer = load_tokenizer(source, hf_config=load_hf_config(source))
    expected = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name,
                                             local_files_only=True)
    assert type(tokenizer) is type(expected)
    assert tokenizer.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    assert tokenizer.init_kwargs == expected.init_kwargs
    assert tokenizer.chat_template == expected.chat_template
    text = "Hello, world! <|im_start|>user\n  élan 1234 "
    assert tokenizer(text).input_ids == expected(text).input_ids


def test_quantization_flag_as_vllm_spells_it(tiny_model):
    from cpullm.engine_args import EngineArgs

    def config(model, **kwargs):
        return EngineArgs(model=model, dtype="float32", max_model_len=256, block_size=32,
                          kv_cache_memory_bytes=1 << 24, **kwargs).create_engine_config()

    assert config(None).model.quantization == "gguf"  # found from the .gguf file
    assert config(None, quantization="gguf").model.quantization == "gguf"
    folder = str(tiny_model("llama"))
    assert config(folder).model.quantization is None
    with pytest.raises(ValueError, match="quantization: gguf needs a .gguf"):
        config(folder, quantization="gguf")
    with pytest.raises(ValueError, match="quantization: 'awq' does not match the checkpoint"):
        config(folder, quantization="awq")
    with pytest.raises(ValueError, match="quantization: 'bitsandbytes' is not supported"):
        config(folder, quantization="bitsandbytes")


@pytest.mark.parametrize("with_q5", [False, True])
def test_tensors_read_as_gguf_reads_them(tmp_path, with_q5):
    """The loader's tensors equal gguf's own reader and dequantizer: float types as values,
    block types as the stored blocks (dequantized here to compare); Q5_0/Q5_1, which the
    fast tensor table cannot size, take gguf's reader."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from cpullm.model_executor.layers.quantization.gguf import RawBlocks
    from cpullm.model_executor.layers.quantization.gguf_blocks import (
        dequantize_split,
        split_blocks,
    )
    from cpullm.model_executor.loader.gguf_loader import hf_name, iterate_gguf

    rng = np.random.default_rng(0)
    types = {"token_embd.weight": T.F32, "blk.0.attn_q.weight": T.F16,
             "blk.0.attn_k.weight": T.BF16, "blk.0.attn_v.weight": T.Q8_0,
             "blk.0.attn_output.weight": T.Q4_0, "blk.0.ffn_gate.weight": T.Q4_1}
    if with_q5:
        types |= {"blk.0.ffn_up.weight": T.Q5_0, "blk.0.ffn_down.weight": T.Q5_1}
    path = str(tmp_path / "t.gguf")
    writer = GGUFWriter(path, "qwen2")  # qwen2: q and k stored unpermuted
    for name, qtype in types.items():
        values = rng.standard_normal((32, 64)).astype(np.float32)
        if qtype == T.F32:
            writer.add_tensor(name, values)
        elif qtype == T.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    got = dict(iterate_gguf(path, num_heads=4, num_kv_heads=2))
    reader = GGUFReader(path)
    assert len(got) == len(types) == len(reader.tensors)
    for tensor in reader.tensors:
        expected = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert tensor.tensor_type == types[tensor.name]
        value = got[hf_name(tensor.name)]
        if isinstance(value, RawBlocks):
            assert value.qtype == tensor.tensor_type and value.shape == expected.shape
            value = dequantize_split(split_blocks(value.qtype, value.raw, value.shape[-1]))
        else:
            assert value.dtype == torch.float32 and tensor.tensor_type in (T.F32, T.F16, T.BF16)
            value = value.numpy()
        assert np.array_equal(value, expected), tensor.name
