"""The prefix cache's host tier: copies of prefix-cached device blocks in free host blocks.

The host pool (the allocator's `host`) has two uses. A swapped-out sequence holds
its host blocks; every other host block is free, and a free host block may hold the
copy of a full device block the prefix cache registered: each registration is
written through to the head of the host queue (the `store` phase, ordered like a
swap-out, before the step writes anything), and the copy stays findable until the
host queue hands its block out again, to a swap-out or a later store. Writing on
eviction instead would miss the blocks a decode loop takes on the device, which the
host never sees leave the cache.

Entries are keyed as the device's are (jpaged.memory.prefix_cache): the block's hash
locates it, and a hit needs its content key (parent cache id, salt, tokens) to
equal the lookup's, so a hash collision is a miss here too. A copy keeps the cache
id of the entry it copies, and a block loaded back into the device registers under
that id again: an id still names one content, so the chain of cache ids that keys a
prefix, and every layer group's entries, holds across the tiers.

A lookup that misses the device cache and hits here loads the copy into a fresh
device block (the `load` phase, before the step's attention) instead of computing
its tokens again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jpaged.memory import allocator
from jpaged.memory.allocator import AllocatorState, BlockOps
from jpaged.memory.prefix_cache import CachedBlock, PrefixCache


@dataclass
class HostTierStats:
    """Blocks the tier took (stores) and gave back (loads) since the engine started."""

    stored_blocks: int = 0
    loaded_blocks: int = 0


@dataclass(frozen=True)
class HostPoolCounts:
    """The host pool's blocks and the tier's traffic, as an engine reports them.

    num_blocks: the pool's blocks; swapped_blocks of them held by swapped-out
    sequences, cached_blocks holding the tier's copies. block_bytes: one host block's
    bytes. stored_blocks, loaded_blocks: the tier's copies written and read back so far.
    """

    num_blocks: int = 0
    swapped_blocks: int = 0
    cached_blocks: int = 0
    block_bytes: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def bytes_moved(self) -> int:
        """Bytes the tier copied to the host and back."""
        return (self.stored_blocks + self.loaded_blocks) * self.block_bytes

    def add(self, other: HostPoolCounts) -> HostPoolCounts:
        """The sums of two replicas' pools (of one model: their blocks are alike)."""
        return HostPoolCounts(
            self.num_blocks + other.num_blocks, self.swapped_blocks + other.swapped_blocks,
            self.cached_blocks + other.cached_blocks, max(self.block_bytes, other.block_bytes),
            self.stored_blocks + other.stored_blocks, self.loaded_blocks + other.loaded_blocks)


class HostTier:
    """The tier's index over a host pool of `num_host_blocks` blocks: which free host
    blocks hold the copy of which content key."""

    def __init__(self, num_host_blocks: int):
        self.cache = PrefixCache(num_host_blocks)
        self.stats = HostTierStats()

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache.entries)

    def lookup(self, block_hash: int, parent: int, cache_salt: str | None, tokens: bytes
               ) -> CachedBlock | None:
        """The tier's entry with this hash and content key, or None."""
        return self.cache.lookup(block_hash, parent, cache_salt, tokens)

    def store(self, state: AllocatorState, device_block: int, block_hash: int, cache_id: int,
              parent: int, cache_salt: str | None, tokens: bytes) -> AllocatorState:
        """Copy device_block, just registered under `cache_id` with this key, into the
        tier; nothing if the tier holds the hash already (the same content, or a
        collision: the older copy stays) or every host block is held by swapped-out
        sequences."""
        if block_hash in self.cache.entries or not state.host.num_free:
            return state
        state, host_block = allocator.store_block(state, device_block)
        self.cache.evict(np.array([host_block]))
        self.cache.register(host_block, block_hash, parent, cache_salt, tokens, cache_id)
        self.stats.stored_blocks += 1
        return state

    def load(self, state: AllocatorState, host_block: int) -> tuple[AllocatorState, int]:
        """Copy the tier's copy in `host_block` into a fresh device block, held once.

        returns (state, the device block), which the caller registers under the copy's
        key and cache id.
        """
        state, device_block = allocator.load_block(state, host_block)
        self.stats.loaded_blocks += 1
        return state, device_block

    def evict(self, host_blocks: np.ndarray) -> None:
        """Drop the copies in `host_blocks` (int [K]): the host queue handed them out."""
        self.cache.evict(np.asarray(host_blocks, np.int64))

    def forget_stores(self, ops: BlockOps) -> None:
        """Drop the copies `ops` were to store: a step that failed may not have written
        them, and no hit may read a half-written block."""
        self.evict(ops.store[:, 1])

    def problems(self, state: AllocatorState) -> list[str]:
        """Where a copy's host block is held by a swapped-out sequence."""
        blocks = np.flatnonzero(self.cache.block_hashes)
        held = blocks[state.host.refcounts[blocks] != 0]
        return [f"host block {block} holds a tier copy and a swapped-out block"
                for block in held.tolist()]
