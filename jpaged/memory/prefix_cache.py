"""Automatic prefix caching: content keys and hashes of full blocks, and the map of cached blocks.

A full block's content key is the cache id of its parent block's entry, its
own token ids and the request's cache_salt. Cache ids are handed out once per
registration and never reused, so a chain of equal keys means an equal token
prefix (what makes the K/V equal) even after a parent is evicted and its
physical block holds other tokens; requests with different salts never share a
block, so tenants stay isolated.

A block's hash (over its parent's hash, tokens and salt) only locates its entry
in the index: a hit also needs the entry's key to equal the lookup's, so two
prefixes whose hashes collide never share K/V, whoever chose their tokens.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NO_HASH = 0
"""Parent hash of a sequence's first block, and the mark of a block with no hash."""

NO_PARENT = 0
"""Parent cache id of a sequence's first block; registrations take ids from 1."""

CachedBlock = tuple[int, int, int, str | None, bytes]
"""An entry of the hash index, (block, cache_id, parent, cache_salt, tokens).

Device `block` holds the K/V of the content key (parent, cache_salt, tokens),
what a full block's K/V depend on: parent is the cache id of the entry holding
the previous block of the prefix (NO_PARENT for a first block), None and "" are
different salts, tokens is `pack_tokens` of the block's token ids. cache_id
numbers this registration. A plain tuple of numbers, a str and bytes, which the
garbage collector stops tracking at its first pass (it would track a NamedTuple,
a tuple subclass, for good): a cache of a million blocks costs collections
nothing."""


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """One block's token ids as int64 bytes, as content keys and hash_block hold them.

    Bytes compare in one memcmp and, unlike a tuple of ints, are no work for
    the garbage collector, however many blocks the cache holds.
    """
    return array("q", token_ids).tobytes()


def hash_block(parent_hash: int, tokens: bytes, cache_salt: str | None) -> int:
    """64-bit blake2b hash of one full block, in [1, 2^64): where its entry lies in the index.

    tokens: `pack_tokens` of the block's token ids. Hits compare keys, so a
    collision costs a miss, never wrong K/V. The fixed-width parent hash and
    token byte count come first, so the byte string parses one way only:
    different (parent, tokens, salt) never share an input.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<QQ", parent_hash, len(tokens)))
    digest.update(tokens)
    if cache_salt is not None:
        digest.update(b"\x01" + cache_salt.encode())
    return int.from_bytes(digest.digest(), "little") or 1


class PrefixCache:
    """Which device blocks hold the K/V of which content key: a host map beside the
    allocator (jpaged.memory.allocator), which knows nothing of hashes.

    block_hashes:  uint64 [num_blocks]  hash of each device block's entry, NO_HASH if
                   it holds none.
    entries:       hash -> CachedBlock, for every block with a hash (in use or free).
    next_cache_id: the id the next registration takes; ids are never reused.

    A free block keeps its entry, so a later prompt can still hit it, until the
    allocator hands it out again and `evict` drops the entry.
    """

    def __init__(self, num_blocks: int, next_cache_id: int = 1):
        self.block_hashes = np.zeros(num_blocks, np.uint64)
        self.entries: dict[int, CachedBlock] = {}
        self.next_cache_id = next_cache_id

    def holds(self, block: int) -> bool:
        """Whether device `block` has an entry."""
        return self.block_hashes[block] != NO_HASH

    def lookup(self, block_hash: int, parent: int, cache_salt: str | None, tokens: bytes
               ) -> CachedBlock | None:
        """The entry under `block_hash` with this content key (parent, cache_salt, tokens),
        or None. An entry under `block_hash` with another key is a hash collision: a miss.
        """
        entry = self.entries.get(block_hash)
        if entry is None or entry[2] != parent or entry[4] != tokens or entry[3] != cache_salt:
            return None
        return entry

    def register(self, block: int, block_hash: int, parent: int, cache_salt: str | None,
                 tokens: bytes, cache_id: int | None = None) -> int | None:
        """Make a full, computed block findable by `block_hash` and its content key
        (parent, cache_salt, tokens); returns its cache id: `cache_id` for a copy of an
        entry registered before (the host tier's copies, and blocks loaded back from
        them, keep their entry's id: the same id, the same content), else a new one.

        If another block holds `block_hash`, `block` stays private: the holder's cache
        id if it holds the same key (equal K/V), None if it holds other content (a
        hash collision).
        """
        entry = self.entries.get(block_hash)
        if entry is not None:
            return entry[1] if entry[2:] == (parent, cache_salt, tokens) else None
        if self.holds(block):
            raise ValueError(f"block {block} is already cached under another hash")
        if cache_id is None:
            cache_id = self.next_cache_id
            self.next_cache_id += 1
        self.entries[block_hash] = (block, cache_id, parent, cache_salt, tokens)
        self.block_hashes[block] = block_hash
        return cache_id

    def evict(self, blocks: np.ndarray) -> None:
        """Drop the entries of `blocks` (int [K]): the allocator just handed them out."""
        if len(blocks) == 1:  # most steps take a block at a time
            block = blocks.item(0)
            block_hash = self.block_hashes.item(block)
            if block_hash != NO_HASH:
                del self.entries[block_hash]
                self.block_hashes[block] = NO_HASH
            return
        hashes = self.block_hashes[blocks]
        if not hashes.any():
            return
        for block_hash in hashes[hashes != NO_HASH].tolist():
            del self.entries[block_hash]
        self.block_hashes[blocks] = NO_HASH


@dataclass
class PrefixCacheStats:
    """Lookup counters. A query is one sequence admitted with prefix caching on.

    query_tokens:    tokens of the admitted sequences.
    hit_tokens:      of those, tokens served from the cache (either tier).
    tier_hit_tokens: of those, tokens loaded from the host tier.
    query_blocks:    full blocks eligible for a lookup (the last token excluded).
    hit_blocks:      of those, blocks served from the cache.
    """

    query_tokens: int = 0
    hit_tokens: int = 0
    tier_hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache (0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
