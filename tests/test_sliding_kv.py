"""Sliding-window layers give back the KV blocks that leave their window (the hybrid KV
cache groups), and the tokens stay those of keeping every block."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_pool_free

from cpullm import LLM, SamplingParams
from cpullm.config import KVCacheGroups

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_groups_plan():
    # Gemma 3 1B's pattern: 5 sliding layers, then a full one
    windows = [0 if i % 6 == 5 else 512 for i in range(26)]
    groups = KVCacheGroups.plan(windows)
    assert groups.group_size == 2 and groups.num_groups == 13
    assert groups.windows == (512,) * 11 + (0,) * 2
    assert [groups.layer_group[i] for i in (5, 11, 17, 23)] == [11, 11, 12, 12]
    assert sorted(zip(groups.layer_group, groups.layer_slot, strict=True)) == \
        [(g, s) for g in range(13) for s in range(2)]
    assert groups.slots_per_rank(1) == 2 and groups.slots_per_rank(2) == 2
    # a 4096-token request at decode: 32 blocks of 128 in the full groups, 5 in the others
    assert groups.blocks_per_request(4096, 128) == 2 * 32 + 11 * 5
    # every layer full: one group of all, one tensor per layer, as without groups
    plain = KVCacheGroups.plan([0] * 6)
    assert (plain.num_groups, plain.group_size, plain.layer_slot) == (1, 6, tuple(range(6)))
    assert plain.slots_per_rank(4) == 2 and not plain.has_windows


def prompts(n: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(100, 2000, (length,), generator=generator).tolist() for _ in range(n)]


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_sliding_groups_hold_their_window_and_match_full_tables(tiny_model, arch):
    """Long prompts (the window is 24 tokens, blocks 32): the sliding group's table holds
    the NULL page before the window while the full group keeps every block; the tokens,
    with chunked prefill and prefix hits too, equal those of keeping every block."""
    model_dir = str(tiny_model(arch))
    batch = prompts(3, 150)
    kept = LLM(model_dir, dtype="float32", block_size=32, disable_hybrid_kv_cache_manager=True)
    expected = [o.outputs[0].token_ids for o in kept.generate(batch, GREEDY, use_tqdm=False)]
    del kept

    llm = LLM(model_dir, dtype="float32", block_size=32, max_num_batched_tokens=40)
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    assert sorted(manager.windows) == [0, 24]
    engine.add_request("long", batch[0], GREEDY)
    while engine.scheduler.requests["long"].num_computed_tokens < 150:
        engine.step()
    request = engine.scheduler.requests["long"]
    full, sliding = (request.block_tables[manager.windows.index(w)] for w in (0, 24))
    assert manager.null_block not in full and len(full) == 5
    # the next query, at position 150 or later, sees keys from 127 on: blocks 3 and 4
    assert sliding[:3] == [manager.null_block] * 3 and manager.null_block not in sliding[3:]
    while engine.has_unfinished_requests():
        engine.step()

    # the first prompt's prefix is found (of the sliding group, the window of it), and
    # then the others'
    for cached in ([128, 0, 0], [128] * 3):
        again = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert [o.num_cached_tokens for o in again] == cached
    assert_pool_free(llm)


def test_sliding_groups_raise_concurrency(tiny_model):
    """The same KV space holds more long requests at once when the sliding layers keep
    only their window; the log's concurrency says so."""
    model_dir = str(tiny_model("gemma3"))
    space = dict(kv_cache_memory_bytes=1 << 20, max_model_len=1024)
    hybrid = LLM(model_dir, dtype="float32", block_size=32, **space).llm_engine
    kept = LLM(model_dir, dtype="float32", block_size=32, disable_hybrid_kv_cache_manager=True,
               **space).llm_engine
    # pages of one block of one layer (group size 1) against one block of both layers
    assert hybrid.config.cache.num_blocks == 2 * kept.config.cache.num_blocks
    groups = hybrid.config.cache.groups
    per_request = groups.blocks_per_request(1024, 32)
    assert per_request == 32 + 2  # the full layer's 32 blocks, the sliding layer's 2
    assert hybrid.config.cache.num_blocks // per_request > kept.config.cache.num_blocks // 32
