"""Reserved prefixes: prefixes whose full KV blocks the pool keeps until they are released.

The paper's Section 4.4 stores a shared prefix's KV blocks in advance, "as how OS
handles shared library": a request maps its first logical blocks onto them and computes
only what follows. Here a reservation is one more holder of each block that a later
prefix lookup of the prefix must find, taken once the prefix's blocks are computed and
registered in the prefix cache. A held block never enters the free queue, so no
allocation evicts it, and requests share it as they share any prefix hit. Releasing
drops that holder: the blocks join the free queue's LRU order, still cached, as a
finished request's blocks do.

This module keeps the reservations (their tokens and blocks) and checks a prefix's
tokens; the BlockManager (jpaged.memory.block_manager) decides which blocks a prefix
needs, how many blocks reservations may hold, and moves the holders. ("Pinned" names
the blocks a step's ops touch, jpaged.memory.allocator: these are "reserved".)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from jpaged.outputs import ReservedPrefix


class PrefixNotCached(ValueError):
    """A prefix to reserve whose full blocks are not all in the prefix cache."""


def check_token_ids(token_ids: Sequence[int]) -> tuple[int, ...]:
    """A prefix's token ids as a tuple of ints: TypeError for anything but a sequence of
    ints, ValueError for an empty one."""
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence | np.ndarray):
        raise TypeError(f"a prefix is a sequence of token ids, got {type(token_ids).__name__}")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise TypeError(f"token ids must be ints, got {token!r} ({type(token).__name__})")
    if len(token_ids) == 0:
        raise ValueError("an empty prefix has nothing to reserve")
    return tuple(int(token) for token in token_ids)


def check_cache_salt(cache_salt: str | None) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")


def check_prefix_id(prefix_id: int) -> int:
    if isinstance(prefix_id, bool) or not isinstance(prefix_id, int | np.integer):
        raise TypeError(f"a prefix id is an int, got {type(prefix_id).__name__}")
    return int(prefix_id)


@dataclass(eq=False)
class Reservation:
    """One reserved prefix.

    prefix:     what its holder is told (ReservedPrefix: id, tokens, blocks).
    token_ids:  the prefix's tokens; cache_salt: the tenant whose requests it serves.
    blocks:     the device blocks it holds in each KV cache group (int32 [K_g] each), or
                None while lost: the KV they held is gone (BlockManager.reset_prefix_cache)
                until the prefix is computed again and restored.
    """

    prefix: ReservedPrefix
    token_ids: tuple[int, ...]
    cache_salt: str | None
    blocks: tuple[np.ndarray, ...] | None

    @property
    def prefix_id(self) -> int:
        return self.prefix.prefix_id

    @property
    def is_lost(self) -> bool:
        return self.blocks is None


class ReservedPrefixes:
    """The reservations of one pool, by prefix id (ids count from 1 and are never reused)."""

    def __init__(self):
        self._by_id: dict[int, Reservation] = {}
        self._next_id = 1

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, prefix_id: int) -> Reservation:
        """The reservation `prefix_id`; ValueError if there is none (never reserved, or
        released)."""
        reservation = self._by_id.get(check_prefix_id(prefix_id))
        if reservation is None:
            raise ValueError(f"no prefix {prefix_id!r} is reserved (reserved: "
                             f"{sorted(self._by_id)})")
        return reservation

    def add(self, token_ids: tuple[int, ...], cache_salt: str | None,
            blocks: tuple[np.ndarray, ...], num_cached_tokens: int) -> Reservation:
        """A new reservation holding `blocks` (one int array per group)."""
        prefix = ReservedPrefix(self._next_id, len(token_ids), num_cached_tokens,
                                sum(len(group) for group in blocks))
        self._next_id += 1
        reservation = self._by_id[prefix.prefix_id] = Reservation(prefix, token_ids,
                                                                  cache_salt, blocks)
        return reservation

    def remove(self, prefix_id: int) -> Reservation:
        reservation = self.get(prefix_id)
        del self._by_id[reservation.prefix_id]
        return reservation

    @property
    def num_blocks(self) -> int:
        """Blocks the reservations hold, each counted as if it shared none with another,
        lost ones included (they hold them again once restored)."""
        return sum(r.prefix.num_blocks for r in self._by_id.values())

    def held(self) -> list[np.ndarray]:
        """The blocks each held reservation holds, one array per reservation and group: a
        block occurs once per reservation holding it."""
        return [group for r in self._by_id.values() if not r.is_lost for group in r.blocks]

    @property
    def num_held_blocks(self) -> int:
        """Distinct device blocks some reservation holds."""
        held = self.held()
        return len(np.unique(np.concatenate(held))) if held else 0

    def lose_all(self) -> None:
        """Every reservation's blocks are gone (their KV was lost); each stays, lost."""
        for reservation in self._by_id.values():
            reservation.blocks = None
