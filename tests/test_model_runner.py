"""KV cache memory: zeroed, and not resident until used."""

from __future__ import annotations

import torch

from cpullm.worker.model_runner import _zeroed


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_cache_is_zero_and_lazily_resident():
    # Dirty memory first, as a previous engine in the same process leaves it.
    dirty = [torch.full((64 << 20,), float("nan")) for _ in range(2)]
    del dirty
    before = _rss()
    cache = _zeroed((2, 2048, 128, 4, 64), torch.bfloat16)  # 512 MiB
    assert _rss() - before < 64 << 20  # nothing touched yet
    assert cache.shape == (2, 2048, 128, 4, 64) and cache.dtype == torch.bfloat16
    sample = cache[:, ::97]
    assert not torch.isnan(sample).any() and not sample.any()
    cache.view(-1)[:10] = 1.0  # writable
    assert int(cache.view(-1)[:10].sum()) == 10
