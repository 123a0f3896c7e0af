"""KV block bookkeeping in pure Python: block pool, reference counts, prefix cache.

The cache tensors live in the worker; this module only decides which block ids a request
owns. A full block is identified by a SHA-256 digest of (its parent block's digest, its
token ids), the first block's also of the request's cache salt, so equal prefixes give
equal chains and a hit hands out the KV of exactly those tokens (Python's ``hash`` of the
same tuple, which an attacker can make collide, once found blocks by it). Requests with
different salts never share a block; requests without one share among themselves. A
block's digest is registered only once its KV has been computed, and a freed block stays
findable until it is handed out again (LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from cpullm.engine.request import Request
from cpullm.utils import cdiv


class BlockPool:
    """Fixed set of block ids with ref counts, an LRU free queue and a hash index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block digest -> block id
        # Free blocks, least recently freed first; dict order is the LRU order.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_hash[block]
        if old_hash is not None:  # evict: its content is about to be overwritten
            del self.cached[old_hash]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Take another reference to a cached block (a prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

    def register(self, block: int, block_hash: bytes) -> None:
        if block_hash in self.cached or self.block_hash[block] is not None:
            return  # an identical block is already findable; keep the first
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash


class KVCacheManager:
    """Hands out KV blocks to requests and finds cached prompt prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free); 0 with
        no blocks (an encoder's engine)."""
        if not self.pool.num_blocks:
            return 0.0
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chain over the full blocks of its first num_tokens."""
        size = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // size):
            hashes.append(block_digest(hashes[-1] if hashes else None,
                                       tokens[i * size:(i + 1) * size], request.cache_salt))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of the request's tokens. At least one token is
        always left to compute, so the last position still produces logits."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        self._update_hashes(request, request.num_tokens - 1)
        blocks = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // self.block_size]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.num_queries += request.num_tokens
        self.num_hits += len(blocks) * self.block_size
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Give the request room for num_new_tokens more tokens (after cached_blocks, which
        become its first blocks). All or nothing: False leaves everything untouched. The
        scheduler, not this, counts the cached blocks' tokens as computed."""
        cached_blocks = cached_blocks or []
        pool = self.pool
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(request.block_table) - len(cached_blocks)
        # Cached blocks that sit in the free queue stop being free once touched.
        num_revived = sum(1 for b in cached_blocks if pool.ref_counts[b] == 0)
        if num_new_blocks > pool.num_free - num_revived:
            return False
        for block in cached_blocks:
            pool.touch(block)
        request.block_table.extend(cached_blocks)
        request.block_table.extend(pool.allocate() for _ in range(num_new_blocks))
        return True

    def cache_computed_blocks(self, request: Request, num_computed_before: int) -> None:
        """Make the blocks filled since num_computed_before findable by later requests."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request, request.num_computed_tokens)
        for i in range(num_computed_before // self.block_size,
                       request.num_computed_tokens // self.block_size):
            self.pool.register(request.block_table[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that the tail is evicted first."""
        for block in reversed(request.block_table):
            self.pool.free(block)
        request.block_table = []


PREFIX_CACHING_HASH_ALGOS = ("sha256",)  # --prefix-caching-hash-algo


def block_digest(parent: bytes | None, token_ids: list[int], cache_salt: str | None) -> bytes:
    """The SHA-256 digest naming a full block: its parent's digest (none for the first
    block, which takes the salt instead, length-prefixed) and its token ids (int32)."""
    h = hashlib.sha256()
    if parent is None:
        salt = (cache_salt or "").encode()
        h.update(b"\x00" if cache_salt is None else b"\x01" + len(salt).to_bytes(4, "little")
                 + salt)
    else:
        h.update(parent)
    h.update(array("i", token_ids).tobytes())
    return h.digest()
