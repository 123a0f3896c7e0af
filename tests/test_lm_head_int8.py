"""--lm-head-quantization int8: the LM head (and the embedding table tied to it) quantized
at load to int8 with one scale per vocabulary row, read by the quantized kernels.

The reference quantizes the same bfloat16 weights here (s = max |w| / 127 per row,
round(w / s) s), independently of the engine's code; transformers runs it in float32. In
float32, cpullm on the reference folder gives transformers' tokens; with the flag, the
bfloat16 engine on the original folder follows them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    GREEDY_PROMPTS,
    assert_greedy_follows,
    greedy_outputs,
    hf_greedy,
    kernels_or_skip,
    quantized_kernels,
)

from cpullm.engine_args import EngineArgs
from cpullm.model_executor.layers.quantization.kept import QuantizedWeight


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Each row of ``w`` (as the bfloat16 engine reads it) quantized to int8 and back."""
    w = w.bfloat16().float()
    s = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.where(s > 0, torch.round(w / s) * s, torch.zeros_like(w))


def _reference(folder: Path, out: Path, tied: bool) -> torch.Tensor:
    """The model of ``folder`` with its head (tied: the shared table) as int8 rows, saved to
    ``out`` in float32; returns that head's weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    head = model.get_output_embeddings().weight
    assert (head.data_ptr() == model.get_input_embeddings().weight.data_ptr()) == tied
    with torch.no_grad():
        head.copy_(int8_rows(head))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return head.detach().clone()


@pytest.mark.parametrize("arch", ["llama3-rope-tied", "llama"])
def test_int8_lm_head_follows_its_dequantized_reference(arch, tiny_model, tmp_path):
    folder = tiny_model(arch)
    tied = arch.endswith("tied")
    head = _reference(folder, tmp_path / "reference", tied)
    model, exact = greedy_outputs(str(tmp_path / "reference"), "float32")
    assert [o.token_ids for o in exact] == hf_greedy(tmp_path / "reference", GREEDY_PROMPTS, 16)
    ops, _ = quantized_kernels()
    kernels_or_skip(QuantizedWeight.kernels_run(ops, torch.bfloat16), {"avx2"},
                    "--lm-head-quantization's quantized kernels")
    model, kept = greedy_outputs(str(folder), "bfloat16", lm_head_quantization="int8")
    assert_greedy_follows(exact, kept)
    weight = model.lm_head.quantized
    assert weight is not None and (weight.qtype, weight.origin) == ("int8 channel", "at load")
    assert model.lm_head.gemm is None
    assert torch.allclose(weight.dequantize(torch.float32), head, rtol=1e-3, atol=0)
    table = model.model.embed_tokens
    if tied:  # the table reads its rows from the int8 copy; its float copy is freed
        assert table.quantized is weight and table.weight.numel() == 0
        ids = torch.tensor([0, 5, 77, len(head) - 1])
        assert torch.allclose(table(ids).float(), head[ids], rtol=1e-2, atol=0)
    else:
        assert table.quantized is None and table.weight.shape == head.shape


def test_int8_lm_head_quantizes_each_row_on_its_own():
    """Rows of very different ranges (one of zeros) keep their own scales."""
    from cpullm.model_executor.layers.embedding import LMHead

    ops, _ = quantized_kernels()
    head = LMHead(48, 64, torch.bfloat16)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]
    w[7] = 0
    head.weight.data = w.bfloat16()
    head.int8 = True
    head.process_weights_after_loading(ops)
    assert head.weight.numel() == 0
    deq = head.quantized.dequantize(torch.float32)
    assert torch.equal(deq[7], torch.zeros(64))
    assert torch.allclose(deq, int8_rows(w), rtol=1e-3, atol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float32"), "needs the quantized kernels"),
    (dict(dtype="bfloat16", enforce_eager=True), "needs the quantized kernels"),
])
def test_int8_lm_head_refuses_what_cannot_run_it(kwargs, message, tiny_model):
    args = EngineArgs(model=str(tiny_model("llama")), lm_head_quantization="int8",
                      kv_cache_memory_bytes=1 << 24, **kwargs)
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()
