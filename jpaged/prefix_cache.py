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


_LEAF_BITS = 6
_LEAVES_PER_NODE = 1 << _LEAF_BITS


@dataclass(frozen=True)
class HashIndex:
    """Persistent map block hash -> device block: a two-level tree of read-only dicts.

    The hash's low bits pick a leaf dict (about 16 entries when `capacity`
    blocks are cached); leaves hang 64 to a node under one root tuple.
    `updated` copies the root, then only the nodes and leaves it touches:
    O(capacity / 1024 + 80 * leaves touched) C-level work per commit, where one
    flat dict would be copied whole.
    """

    root: tuple[tuple[Mapping[int, int], ...], ...]

    @classmethod
    def empty(cls, capacity: int) -> HashIndex:
        num_leaves = 1 << math.ceil(math.log2(max(capacity / 16, _LEAVES_PER_NODE)))
        node = (MappingProxyType({}),) * _LEAVES_PER_NODE
        return cls((node,) * (num_leaves // _LEAVES_PER_NODE))

    def _path(self, block_hash: int) -> tuple[int, int]:
        leaf = block_hash & (len(self.root) * _LEAVES_PER_NODE - 1)
        return leaf >> _LEAF_BITS, leaf & (_LEAVES_PER_NODE - 1)

    def get(self, block_hash: int) -> int | None:
        node, leaf = self._path(block_hash)
        return self.root[node][leaf].get(block_hash)

    def __len__(self) -> int:
        return sum(len(leaf) for node in self.root for leaf in node)

    def items(self) -> list[tuple[int, int]]:
        return [item for node in self.root for leaf in node for item in leaf.items()]

    def updated(self, changes: Mapping[int, int | None]) -> HashIndex:
        """A new index with `changes` applied (a None value removes the hash)."""
        if not changes:
            return self
        leaves: dict[tuple[int, int], dict[int, int]] = {}
        for block_hash, block in changes.items():
            path = self._path(block_hash)
            entries = leaves.get(path)
            if entries is None:
                node, leaf = path
                entries = leaves[path] = self.root[node][leaf].copy()
            if block is None:
                entries.pop(block_hash, None)
            else:
                entries[block_hash] = block
        nodes: dict[int, list[Mapping[int, int]]] = {}
        for (node, leaf), entries in leaves.items():
            if node not in nodes:
                nodes[node] = list(self.root[node])
            nodes[node][leaf] = MappingProxyType(entries)
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
