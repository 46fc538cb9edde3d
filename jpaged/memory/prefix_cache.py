"""Automatic prefix caching: content keys and hashes of full blocks, and the hash index.

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
import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, TypeVar

NO_HASH = 0
"""Parent hash of a sequence's first block, and the mark of a block with no hash."""

NO_PARENT = 0
"""Parent cache id of a sequence's first block; registrations take ids from 1."""

Value = TypeVar("Value")

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


_LEAF_BITS = 6
_LEAVES_PER_NODE = 1 << _LEAF_BITS


@dataclass(frozen=True)
class HashIndex(Generic[Value]):
    """Persistent map block hash -> value (a CachedBlock): a two-level tree of read-only dicts.

    The hash's low bits pick a leaf dict (about 16 entries when `capacity`
    blocks are cached); leaves hang 64 to a node under one root tuple.
    `updated` copies the root, then only the nodes and leaves it touches:
    O(capacity / 1024 + 80 * leaves touched) C-level work per commit, where one
    flat dict would be copied whole.
    """

    root: tuple[tuple[Mapping[int, Value], ...], ...]

    @classmethod
    def empty(cls, capacity: int) -> HashIndex[Value]:
        num_leaves = 1 << math.ceil(math.log2(max(capacity / 16, _LEAVES_PER_NODE)))
        node = (MappingProxyType({}),) * _LEAVES_PER_NODE
        return cls((node,) * (num_leaves // _LEAVES_PER_NODE))

    def get(self, block_hash: int) -> Value | None:
        # The leaf is the hash's low bits: node = leaf >> _LEAF_BITS, then the leaf's index in it.
        leaf = block_hash & (len(self.root) * _LEAVES_PER_NODE - 1)
        return self.root[leaf >> _LEAF_BITS][leaf & (_LEAVES_PER_NODE - 1)].get(block_hash)

    def __len__(self) -> int:
        return sum(len(leaf) for node in self.root for leaf in node)

    def items(self) -> list[tuple[int, Value]]:
        return [item for node in self.root for leaf in node for item in leaf.items()]

    def updated(self, changes: Mapping[int, Value | None]) -> HashIndex[Value]:
        """A new index with `changes` applied (a None value removes the hash)."""
        if not changes:
            return self
        last_leaf = len(self.root) * _LEAVES_PER_NODE - 1
        leaves: dict[int, dict[int, Value]] = {}
        for block_hash, value in changes.items():
            leaf = block_hash & last_leaf
            entries = leaves.get(leaf)
            if entries is None:
                entries = self.root[leaf >> _LEAF_BITS][leaf & (_LEAVES_PER_NODE - 1)].copy()
                leaves[leaf] = entries
            if value is None:
                entries.pop(block_hash, None)
            else:
                entries[block_hash] = value
        nodes: dict[int, list[Mapping[int, Value]]] = {}
        for leaf, entries in leaves.items():
            node_leaves = nodes.get(leaf >> _LEAF_BITS)
            if node_leaves is None:
                node_leaves = nodes[leaf >> _LEAF_BITS] = list(self.root[leaf >> _LEAF_BITS])
            node_leaves[leaf & (_LEAVES_PER_NODE - 1)] = MappingProxyType(entries)
        root = list(self.root)
        for node, node_leaves in nodes.items():
            root[node] = tuple(node_leaves)
        return HashIndex(tuple(root))


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
