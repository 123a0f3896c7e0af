"""KV block bookkeeping in pure Python: block pool, reference counts, prefix cache.

The cache tensors live in the worker; this module only decides which block ids a request
owns. A full block is identified by a SHA-256 digest of (its parent block's digest, its
token ids), the first block's also of the request's cache salt and LoRA adapter, so equal
prefixes give
equal chains and a hit hands out the KV of exactly those tokens (Python's ``hash`` of the
same tuple, which an attacker can make collide, once found blocks by it). Requests with
different salts (or adapters) never share a block; requests without one share among
themselves. A
block's digest is registered only once its KV has been computed, and a freed block stays
findable until it is handed out again (LRU).

The layers may form several groups (config.KVCacheGroups), each with its own block table
per request and blocks from the one pool. A group of sliding-window layers gives its
blocks back once they fall out of the window (the NULL page, past the pool, takes their
place in its table), so a long request holds a window's worth there instead of its whole
context. A prefix hit needs every block of a full group and, of a sliding group, the
blocks its window still sees.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from cpullm.engine.request import Request
from cpullm.utils import cdiv


class BlockPool:
    """Fixed set of block ids with ref counts, an LRU free queue and a hash index (keyed
    by (group, digest): each group's blocks hold its own layers)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
        self.cached: dict[tuple[int, bytes], int] = {}  # (group, block digest) -> block id
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

    def register(self, block: int, key: tuple[int, bytes]) -> None:
        if key in self.cached or self.block_hash[block] is not None:
            return  # an identical block is already findable; keep the first
        self.cached[key] = block
        self.block_hash[block] = key


class KVCacheManager:
    """Hands out KV blocks to requests and finds cached prompt prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: tuple[int, ...] = (0,)) -> None:
        """``windows``: per KV cache group, its sliding window (0: the whole context)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self.pool = BlockPool(num_blocks)
        self.null_block = num_blocks  # in a sliding group's table: a block it dropped
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

    def _first_needed(self, window: int, num_computed: int) -> int:
        """The first block a group still reads once ``num_computed`` tokens are in the
        cache: the next query, at that position, sees keys from num_computed - window + 1."""
        return max(0, num_computed - window + 1) // self.block_size if window else 0

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chain over the full blocks of its first num_tokens."""
        size = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // size):
            images = [image.hash for image in request.images
                      if image.offset < (i + 1) * size and image.offset + image.length > i * size]
            hashes.append(block_digest(hashes[-1] if hashes else None,
                                       tokens[i * size:(i + 1) * size], request.cache_salt,
                                       request.lora_key, images))

    def find_cached_prefix(self, request: Request) -> list[list[int]]:
        """Per group, the blocks already holding a prefix of the request's tokens (the same
        number in each; a sliding group's NULL before its window), or [] for none. At least
        one token is always left to compute, so the last position still produces logits."""
        if not self.enable_prefix_caching or request.long_rope \
                or request.sampling_params.prompt_logprobs is not None:
            return []  # (LongRoPE's long-factor KV is not shared)
        self._update_hashes(request, request.num_tokens - 1)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        self.num_queries += request.num_tokens
        # The longest prefix every group can take; lowering it for one group can undo
        # another sliding group's hit, so repeat until none lowers it.
        found, settled = len(hashes), False
        while not settled:
            settled = True
            for group, window in enumerate(self.windows):
                most = self._longest_hit(group, window, hashes, found)
                settled &= most == found
                found = most
        if not found:
            return []
        self.num_hits += found * self.block_size
        cached = self.pool.cached
        return [[cached[group, hashes[i]] if i >= first else self.null_block
                 for i in range(found)]
                for group, first in ((g, self._first_needed(w, found * self.block_size))
                                     for g, w in enumerate(self.windows))]

    def _longest_hit(self, group: int, window: int, hashes: list[bytes], limit: int) -> int:
        """The most blocks, up to ``limit``, that ``group`` can take from the cache: a
        full group's run of cached blocks, a sliding group's prefix whose window is cached."""
        cached = self.pool.cached
        if not window:
            found = 0
            while found < limit and (group, hashes[found]) in cached:
                found += 1
            return found
        for found in range(limit, 0, -1):
            first = self._first_needed(window, found * self.block_size)
            if all((group, hashes[i]) in cached for i in range(first, found)):
                return found
        return 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: list[list[int]] | None = None) -> bool:
        """Give the request room for num_new_tokens more tokens (after ``cached``, per
        group the blocks find_cached_prefix found, which become its first blocks), and
        give back the blocks its sliding groups no longer see. All or nothing: False
        leaves everything untouched. The scheduler, not this, counts the cached blocks'
        tokens as computed."""
        pool, null = self.pool, self.null_block
        if not request.block_tables:
            request.block_tables = [[] for _ in self.windows]
        if cached:
            assert not any(request.block_tables), "a prefix hit for a request with blocks"
            request_tables = cached
        else:
            request_tables = request.block_tables
        num_computed = request.num_computed_tokens + (
            len(cached[0]) * self.block_size if cached else 0)
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_revived = num_released = 0
        dropped: list[tuple[list[int], range]] = []
        for window, table in zip(self.windows, request_tables, strict=True):
            num_new_blocks += num_needed - len(table)
            if cached:  # cached blocks that sit in the free queue stop being free
                num_revived += sum(1 for b in table if b != null and pool.ref_counts[b] == 0)
            elif window:  # dropped blocks sit at the table's start: find the new ones
                end = first = self._first_needed(window, num_computed)
                while first and table[first - 1] != null:
                    first -= 1
                dropped.append((table, range(first, end)))
                num_released += sum(1 for i in range(first, end) if pool.ref_counts[table[i]] == 1)
        if num_new_blocks > pool.num_free - num_revived + num_released:
            return False
        for table, indices in dropped:
            for i in indices:
                pool.free(table[i])
                table[i] = null
            request.num_blocks_sent = min(request.num_blocks_sent, indices.start)
        for group, table in enumerate(request_tables):
            if cached:
                for block in table:
                    if block != null:
                        pool.touch(block)
                request.block_tables[group] = list(table)
            request.block_tables[group].extend(
                pool.allocate() for _ in range(num_needed - len(table)))
        return True

    def cache_computed_blocks(self, request: Request, num_computed_before: int) -> None:
        """Make the blocks filled since num_computed_before findable by later requests."""
        if not self.enable_prefix_caching or request.long_rope:
            return
        self._update_hashes(request, request.num_computed_tokens)
        hashes = request.block_hashes
        for group, table in enumerate(request.block_tables):
            for i in range(num_computed_before // self.block_size,
                           request.num_computed_tokens // self.block_size):
                if table[i] != self.null_block:
                    self.pool.register(table[i], (group, hashes[i]))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that the tail is evicted first."""
        for table in request.block_tables:
            for block in reversed(table):
                if block != self.null_block:
                    self.pool.free(block)
        request.block_tables = []
        request.num_blocks_sent = 0


PREFIX_CACHING_HASH_ALGOS = ("sha256",)  # --prefix-caching-hash-algo


def block_digest(parent: bytes | None, token_ids: list[int], cache_salt: str | None,
                 lora_key: str | None = None, images: list[str] | None = None) -> bytes:
    """The SHA-256 digest naming a full block: its parent's digest (none for the first
    block, which takes the salt instead, length-prefixed, and the digest of the adapter's
    files), its token ids (int32) and the hashes of the images whose tokens it holds."""
    h = hashlib.sha256()
    if parent is None:
        salt = (cache_salt or "").encode()
        h.update(b"\x00" if cache_salt is None else b"\x01" + len(salt).to_bytes(4, "little")
                 + salt)
        if lora_key is not None:
            h.update(b"\x02" + lora_key.encode())
    else:
        h.update(parent)
    h.update(array("i", token_ids).tobytes())
    for image in images or ():
        h.update(b"\x03" + image.encode())
    return h.digest()
