"""KV cache memory: zeroed, and resident from the start."""

from __future__ import annotations

import torch

from cpullm.worker.model_runner import _kv_cache_tensor, _reserve


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_cache_is_zero_and_resident():
    # Dirty memory first, as a previous engine in the same process leaves it.
    dirty = [torch.full((16 << 20,), float("nan")) for _ in range(2)]
    del dirty
    before = _rss()
    cache = _kv_cache_tensor((2, 256, 128, 4, 64), torch.bfloat16)  # 32 MiB
    _reserve([cache])
    assert _rss() - before >= 30 << 20  # resident when reserved, not on first use
    assert cache.shape == (2, 256, 128, 4, 64) and cache.dtype == torch.bfloat16
    assert not torch.isnan(cache).any() and not cache.any()
    cache.view(-1)[:10] = 1.0  # writable
    assert int(cache.view(-1)[:10].sum()) == 10


def test_generate_gives_the_caller_its_cpus_back(tiny_model):
    import os

    from cpullm import LLM, SamplingParams

    before = os.sched_getaffinity(0)
    llm = LLM(str(tiny_model("llama")), dtype="float32", max_model_len=256)
    for _ in range(2):  # pinned again for the second call, released again after it
        assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        assert os.sched_getaffinity(0) == before
    # A second engine in the same process plans its binding from the same CPUs.
    second = LLM(str(tiny_model("llama")), dtype="float32", max_model_len=256)
    assert second.llm_engine.config.parallel.binding == llm.llm_engine.config.parallel.binding
