"""A decode-only step through the decoder layers' decode steps (each layer's forward over
its parts' kernels, without the module calls between them; layers/decode_step.py)
generates exactly what the layers' forward generates: the same kernels with the same
arguments, so the same bits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import kernels_or_skip

from cpullm import LLM, SamplingParams
from cpullm.model_executor.layers import stage
from cpullm.model_executor.layers.ops import load_ops


@pytest.fixture
def kernels():
    kernels_or_skip(load_ops() is not None, {"avx2"}, "the compiled kernels")


PROMPTS = [[1, 2, 3, 4, 5], [100, 2000, 30000, 7], [42] * 40]


def _generate(llm: LLM, steps: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Greedy completions with logprobs, the decode steps on (as shipped) or off."""
    with monkeypatch.context() as patch:
        if not steps:
            patch.setattr(stage, "_decode_steps", lambda *args: None)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                               use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _layers(llm: LLM) -> torch.nn.ModuleList:
    model = llm.llm_engine.model_runner.model
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))


def _assert_same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.logprobs == y.logprobs  # bit for bit: the same kernels, the same order


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3-rope-tied", "phi3", "granite",
                                  "qwen3", "mistral", "glm", "glm4", "gemma", "gemma2",
                                  "gemma3", "qwen3_moe", "gpt_oss"])
def test_decode_steps_generate_what_forward_does(tiny_model, arch, monkeypatch):
    """bfloat16 folders: Llama, Qwen2 (q, k, v biases), a tied head with llama3 rope, Phi-3
    (partial rotary, a sliding window shorter than the longest prompt), Granite (a residual
    multiplier), Qwen3 (q/k norms), Mistral, GLM (q and k reordered), GLM-4 (its own
    norms), Gemma 1-3 (Gemma 2's soft-cap and windows, Gemma 3's q/k norms and rotary per
    layer kind), a mixture of experts (its forward, bound, inside the step) and gpt-oss
    (attention sinks) take the decode steps: each layer's forward over its parts' kernels."""
    llm = LLM(model=str(tiny_model(arch)), dtype="bfloat16", max_model_len=256,
              kv_cache_memory_bytes=1 << 24)
    with_steps = _generate(llm, True, monkeypatch)
    steps, limit = _layers(llm).__dict__.get("decode_plan", ([], 0))
    assert len(steps) == len(_layers(llm)) and limit > 1
    _assert_same(with_steps, _generate(llm, False, monkeypatch))


@pytest.mark.usefixtures("kernels")
def test_decode_steps_on_the_kept_default_model(monkeypatch):
    """The default model's Q4_1 blocks, kept: the layers' steps call the kept kernels with
    the arguments their layers pass."""
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=1 << 24)  # the default model
    with_steps = _generate(llm, True, monkeypatch)
    steps, limit = _layers(llm).decode_plan
    assert len(steps) == len(_layers(llm)) and limit >= 4
    _assert_same(with_steps, _generate(llm, False, monkeypatch))


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_decode_steps_on_a_quantized_kv_cache(tiny_model, kv_cache_dtype, monkeypatch):
    """A quantized KV cache: the steps store and read it with the layers' kernels (int8's
    row scales; fp8's layer scales as the first prompt set them)."""
    llm = LLM(model=str(tiny_model("qwen3")), dtype="bfloat16", max_model_len=256,
              kv_cache_memory_bytes=1 << 24, kv_cache_dtype=kv_cache_dtype,
              calculate_kv_scales=kv_cache_dtype.startswith("fp8"))
    with_steps = _generate(llm, True, monkeypatch)
    steps, limit = _layers(llm).__dict__.get("decode_plan", ([], 0))
    assert len(steps) == len(_layers(llm)) and limit > 1
    _assert_same(with_steps, _generate(llm, False, monkeypatch))


def test_no_decode_steps_in_float32(tiny_model):
    """Steps are bfloat16's: a float32 model keeps forward (and makes no plan)."""
    llm = LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 24)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert "decode_plan" not in _layers(llm).__dict__
