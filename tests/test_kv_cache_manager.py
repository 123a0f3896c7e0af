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
    held = [b for r in requests for table in r.block_tables for b in table
            if b != manager.null_block]
    assert pool.num_free + len(set(held)) == pool.num_blocks
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == held.count(block)


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
    assert manager.pool.cached == {(0, a.block_hashes[0]): 0, (0, a.block_hashes[1]): 1}

    b = make_request("b", prompt[:8] + [99, 98, 97])
    hit = manager.find_cached_prefix(b)
    assert hit == [[0, 1]]
    assert manager.allocate_slots(b, 3, hit)
    # the blocks are the request's; counting their tokens as computed is the scheduler's
    assert b.num_computed_tokens == 0 and b.block_table == [0, 1, 3]
    assert manager.pool.ref_counts[:4] == [2, 2, 1, 1]
    check_invariant(manager, a, b)

    # A prompt that is exactly cached still computes its last token.
    c = make_request("c", prompt[:8])
    assert manager.find_cached_prefix(c) == [[0]]

    manager.free(a)
    manager.free(b)
    check_invariant(manager)
    # Freed blocks stay findable until handed out again.
    d = make_request("d", prompt)
    assert manager.find_cached_prefix(d) == [[0, 1]]
    assert manager.allocate_slots(d, 2, [[0, 1]])
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
        [salted.block_table[:2]]
    # Unsalted requests share among themselves, and not with salted ones.
    plain = make_request("e", prompt)
    cache(plain)
    assert manager.find_cached_prefix(make_request("f", prompt)) == [plain.block_table[:2]]
    assert set(plain.block_table).isdisjoint(salted.block_table)


def test_sliding_group_gives_back_blocks_out_of_its_window():
    """A full group keeps every block; a sliding group (window 6, blocks of 4) holds the
    NULL page for the blocks before the next query's window, and those go back to the pool."""
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False,
                             windows=(0, 6))
    null = manager.null_block
    a = make_request("a", list(range(1, 11)))
    assert manager.allocate_slots(a, 10)  # a 10-token prompt: 3 blocks in each group
    assert a.block_tables == [[0, 1, 2], [3, 4, 5]]
    a.num_computed_tokens = 10
    # the next query is at position 10 and sees keys 5..10: blocks 1 and 2
    assert manager.allocate_slots(a, 1)
    assert a.block_tables == [[0, 1, 2], [null, 4, 5]]
    assert manager.num_free_blocks == 16 - 5
    check_invariant(manager, a)
    a.num_computed_tokens = 12
    assert manager.allocate_slots(a, 1)  # position 12 sees 7..12: blocks 1 to 3
    assert a.block_tables == [[0, 1, 2, 6], [null, 4, 5, 7]]
    a.num_computed_tokens = 14
    assert manager.allocate_slots(a, 1)  # position 14 sees 9..14: blocks 2 and 3
    assert a.block_tables == [[0, 1, 2, 6], [null, null, 5, 7]]
    check_invariant(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 16 and a.block_tables == []


def test_sliding_group_all_or_nothing():
    """The blocks a step gives back count toward what it takes; when it cannot get all,
    nothing changes."""
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False,
                             windows=(0, 4))
    a = make_request("a", list(range(1, 9)))
    assert manager.allocate_slots(a, 8)  # [[0, 1], [2, 3]]
    a.num_computed_tokens = 8
    b = make_request("b", [5] * 4)
    assert manager.allocate_slots(b, 4)  # [[4], [5]]: the pool is empty
    before = [list(t) for t in a.block_tables]
    # position 8 sees 5..8: block 0 of the sliding group goes, which is one of the two
    # blocks the step needs
    assert not manager.allocate_slots(a, 1)
    assert a.block_tables == before and manager.num_free_blocks == 0
    manager.free(b)
    assert manager.allocate_slots(a, 1)
    assert a.block_tables[1][0] == manager.null_block
    check_invariant(manager, a)


def test_sliding_group_prefix_hit_needs_only_its_window():
    """A hit takes a full group's whole prefix, and of a sliding group only the blocks
    its window still sees: one it gave back (and was handed out again) does not stop it;
    a block in the window that is gone does."""
    manager = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True,
                             windows=(0, 5))
    null = manager.null_block
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    a = make_request("a", prompt)
    assert manager.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    manager.cache_computed_blocks(a, 0)
    full, sliding = (list(t) for t in a.block_tables)
    # Evict the sliding group's first block (outside the window of a hit of 4 blocks):
    manager.free(a)
    manager.pool.cached.pop((1, a.block_hashes[0]))
    manager.pool.block_hash[sliding[0]] = None
    b = make_request("b", prompt)
    # 4 blocks: position 16 sees 12..16, block 3 (and 4, not computed): NULL before it
    hit = manager.find_cached_prefix(b)
    assert hit == [full[:4], [null, null, null, sliding[3]]]
    assert manager.allocate_slots(b, 1, hit)
    assert [t[:4] for t in b.block_tables] == hit and list(map(len, b.block_tables)) == [5, 5]
    check_invariant(manager, b)
    # Gone from inside the window: the hit shrinks until its window is cached again
    manager.free(b)
    manager.pool.cached.pop((1, b.block_hashes[3]))
    manager.pool.block_hash[sliding[3]] = None
    hit = manager.find_cached_prefix(make_request("c", prompt))
    assert hit == [full[:3], [null, null, sliding[2]]]
