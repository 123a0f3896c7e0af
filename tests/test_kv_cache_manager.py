"""Block bookkeeping without a model: exact block ids, ref counts, hash chains."""

from __future__ import annotations

import hashlib
from array import array

from cpullm.engine.kv_cache_manager import KVCacheManager
from cpullm.engine.request import Request
from cpullm.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(), eos_token_ids={0}, max_model_len=1024,
                   cache_salt=cache_salt)


def sha256(*parts: bytes) -> bytes:
    return hashlib.sha256(b"".join(parts)).digest()


def check_invariant(manager: KVCacheManager, *requests: Request) -> None:
    pool = manager.pool
    used = {b for r in requests for b in r.block_table}
    assert pool.num_free + len(used) == pool.num_blocks
    for block in range(pool.num_blocks):
        owners = sum(r.block_table.count(block) for r in requests)
        assert pool.ref_counts[block] == owners


def test_allocate_exact_blocks_and_free_lru():
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(1, 10)))  # 9 tokens -> 3 blocks
    assert manager.allocate_slots(a, 9)
    assert a.block_table == [0, 1, 2]
    b = make_request("b", [7] * 5)
    assert manager.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    check_invariant(manager, a, b)
    c = make_request("c", [9] * 8)
    assert not manager.allocate_slots(c, 8)  # needs 2, one free: nothing taken
    assert c.block_table == [] and manager.num_free_blocks == 1
    manager.free(a)  # freed tail first: 2, 1, 0 join the queue behind 5
    assert list(manager.pool.free_queue) == [5, 2, 1, 0]
    assert manager.allocate_slots(c, 8)
    assert c.block_table == [5, 2]
    check_invariant(manager, b, c)


def test_prefix_hash_chain_and_sharing():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    a = make_request("a", prompt)
    assert manager.find_cached_prefix(a) == []
    assert manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    manager.cache_computed_blocks(a, 0)
    # SHA-256 over (no salt | the parent's digest, the block's token ids as int32)
    h0 = sha256(b"\x00", array("i", [1, 2, 3, 4]).tobytes())
    assert a.block_hashes == [h0, sha256(h0, array("i", [5, 6, 7, 8]).tobytes())]
    assert manager.pool.cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}

    b = make_request("b", prompt[:8] + [99, 98, 97])
    hit = manager.find_cached_prefix(b)
    assert hit == [0, 1]
    assert manager.allocate_slots(b, 3, hit)
    # the blocks are the request's; counting their tokens as computed is the scheduler's
    assert b.num_computed_tokens == 0 and b.block_table == [0, 1, 3]
    assert manager.pool.ref_counts[:4] == [2, 2, 1, 1]
    check_invariant(manager, a, b)

    # A prompt that is exactly cached still computes its last token.
    c = make_request("c", prompt[:8])
    assert manager.find_cached_prefix(c) == [0]

    manager.free(a)
    manager.free(b)
    check_invariant(manager)
    # Freed blocks stay findable until handed out again.
    d = make_request("d", prompt)
    assert manager.find_cached_prefix(d) == [0, 1]
    assert manager.allocate_slots(d, 2, [0, 1])
    assert manager.pool.ref_counts[0] == 1 and 0 not in manager.pool.free_queue
    check_invariant(manager, d)


def test_eviction_removes_hash():
    manager = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert manager.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    manager.cache_computed_blocks(a, 0)
    manager.free(a)
    b = make_request("b", [9] * 8)
    assert manager.find_cached_prefix(b) == []
    assert manager.allocate_slots(b, 8)  # takes both blocks, evicting a's cached block
    assert manager.pool.cached == {}
    assert manager.find_cached_prefix(make_request("c", [1, 2, 3, 4, 5])) == []


def test_cache_salt_keeps_prefixes_apart():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))

    def cache(request: Request) -> None:
        assert manager.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        manager.cache_computed_blocks(request, 0)

    salted = make_request("a", prompt, cache_salt="tenant-a")
    assert manager.find_cached_prefix(salted) == []
    cache(salted)
    # Another tenant's salt, and no salt, find nothing; the same salt finds both blocks.
    assert manager.find_cached_prefix(make_request("b", prompt, cache_salt="tenant-b")) == []
    assert manager.find_cached_prefix(make_request("c", prompt)) == []
    assert manager.find_cached_prefix(make_request("d", prompt, cache_salt="tenant-a")) == \
        salted.block_table[:2]
    # Unsalted requests share among themselves, and not with salted ones.
    plain = make_request("e", prompt)
    cache(plain)
    assert manager.find_cached_prefix(make_request("f", prompt)) == plain.block_table[:2]
    assert set(plain.block_table).isdisjoint(salted.block_table)
