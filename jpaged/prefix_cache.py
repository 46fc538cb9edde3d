"""Automatic prefix caching: content hashes of full blocks and the hash -> block index.

A full block's hash covers its parent block's hash, its own token ids and the
request's cache_salt. Equal hashes therefore mean equal tokens over the whole
prefix (up to a 2^-64 collision), which is what makes the K/V equal, and
requests with different salts never share a block, so tenants stay isolated.
"""

from __future__ import annotations

import hashlib
import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

NO_HASH = 0
"""Parent hash of a sequence's first block, and the mark of a block with no hash."""


def hash_block(parent_hash: int, token_ids: Sequence[int], cache_salt: str | None) -> int:
    """64-bit blake2b hash of one full block, in [1, 2^64).

    The fixed-width parent hash and token count come first, so the byte string
    parses one way only: different (parent, tokens, salt) never share an input.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<QQ", parent_hash, len(token_ids)))
    digest.update(array("q", token_ids).tobytes())
    if cache_salt is not None:
        digest.update(b"\x01" + cache_salt.encode())
    return int.from_bytes(digest.digest(), "little") or 1


@dataclass(frozen=True)
class HashIndex:
    """Persistent map block hash -> device block.

    Split into about sqrt(capacity) read-only shards by the hash's low bits, so
    `updated` copies the tuple of shards and only the shards it touches:
    O(sqrt(capacity) * (1 + shards touched)) C-level work, never a full copy.
    """

    shards: tuple[Mapping[int, int], ...]

    @classmethod
    def empty(cls, capacity: int) -> HashIndex:
        num_shards = 1 << math.ceil(math.log2(max(1.0, math.sqrt(capacity))))
        return cls(tuple(MappingProxyType({}) for _ in range(num_shards)))

    def _shard(self, block_hash: int) -> int:
        return block_hash & (len(self.shards) - 1)

    def get(self, block_hash: int) -> int | None:
        return self.shards[self._shard(block_hash)].get(block_hash)

    def __len__(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def items(self) -> list[tuple[int, int]]:
        return [item for shard in self.shards for item in shard.items()]

    def updated(self, changes: Mapping[int, int | None]) -> HashIndex:
        """A new index with `changes` applied (a None value removes the hash)."""
        if not changes:
            return self
        edited: dict[int, dict[int, int]] = {}
        for block_hash, block in changes.items():
            shard = self._shard(block_hash)
            entries = edited.get(shard)
            if entries is None:
                entries = edited[shard] = dict(self.shards[shard])
            if block is None:
                entries.pop(block_hash, None)
            else:
                entries[block_hash] = block
        shards = list(self.shards)
        for shard, entries in edited.items():
            shards[shard] = MappingProxyType(entries)
        return HashIndex(tuple(shards))


@dataclass
class PrefixCacheStats:
    """Lookup counters. A query is one sequence admitted with prefix caching on.

    query_tokens: tokens of the admitted sequences.
    hit_tokens:   of those, tokens served from the cache.
    query_blocks: full blocks eligible for a lookup (the last token excluded).
    hit_blocks:   of those, blocks served from the cache.
    """

    query_tokens: int = 0
    hit_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache (0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
