"""Functional block allocator: an immutable pool state and one transition per step.

`AllocatorState` is a value: reference counts and an LRU free queue for the
device pool and for the host (swap) pool, the prefix hash of every device
block, and the hash index of cached blocks, each entry with its block's content
key and cache id. Its arrays are persistent (read-only numpy chunks) and
nothing ever mutates a state.

A `Transaction` overlays one scheduler step's changes on a state (dicts of the
entries it changed) and reads through them, so each operation costs
O(blocks touched) Python work. `commit()` returns the next state and the
step's device ops, copying only the chunks of each array, and the nodes and
leaves of the hash index, that the step touched.

Free queue (vLLM v1's LRU order): freed blocks join the tail and allocation
takes the head. A freed block keeps its prefix hash, so a later prompt can
still hit it, until allocation takes it from the head (eviction). A prefix hit
on a free block takes it out of the queue. Block 0 of the device pool is the
null block: never in the queue, never allocated, never freed.

The device applies a step's `BlockOps` before the step's attention, in this
order: swap_out (device -> host), swap_in (host -> device), copies
(copy-on-write, all sources read before any destination is written). Blocks
freed during a step may be reused in the same step, which that order makes
safe, except for blocks the step's ops still touch: blocks a later phase reads
(copy sources on the device, swap-in sources on the host) and blocks an op
writes (swap-out destinations on the host, swap-in and copy destinations on the
device; reused, one would take a second write from a later phase or the same
scatter). Those are pinned and join the free queue only at commit, so no step
writes a block twice. Because copies read before they write, a copy from a
block that this step's copies fill reads that block's own source instead. The
one order a step cannot express is swapping out a device block that its own
swap-in or copies write, so `swap_out` refuses that.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from jpaged.memory.prefix_cache import NO_HASH, CachedBlock, HashIndex


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


_NO_PAIRS = _readonly(np.zeros((0, 2), np.int32))


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    """int32 [K, 2] array of (source, destination) block pairs, read-only."""
    if not pairs:
        return _NO_PAIRS  # most steps move nothing; building an empty array costs a microsecond
    return _readonly(np.array(pairs, dtype=np.int32).reshape(len(pairs), 2))


@dataclass(frozen=True)
class ChunkedArray:
    """A persistent 1-D integer array made of read-only numpy chunks.

    `updated` copies only the chunks it changes, plus the tuple of chunk
    references. With chunks of about sqrt(size) entries a step's commit costs
    O(sqrt(size) * (1 + chunks touched)) memcpy work, where one flat array
    would copy all `size` entries every step.
    """

    chunks: tuple[np.ndarray, ...]
    chunk_bits: int
    size: int

    @classmethod
    def of(cls, values: np.ndarray) -> ChunkedArray:
        size = len(values)
        chunk_bits = max(6, math.ceil(math.log2(max(size, 1)) / 2))
        step = 1 << chunk_bits
        chunks = tuple(_readonly(values[i : i + step].copy()) for i in range(0, max(size, 1), step))
        return cls(chunks, chunk_bits, size)

    def __len__(self) -> int:
        return self.size

    def item(self, index: int) -> int:
        return self.chunks[index >> self.chunk_bits].item(index & ((1 << self.chunk_bits) - 1))

    def to_numpy(self) -> np.ndarray:
        return _readonly(np.concatenate(self.chunks)[: self.size])

    def updated(self, changes: dict[int, int]) -> ChunkedArray:
        """A new array with array[k] = v for each change (`self` if there are none)."""
        if not changes:
            return self
        bits, mask = self.chunk_bits, (1 << self.chunk_bits) - 1
        copies: dict[int, np.ndarray] = {}
        for index, value in changes.items():
            chunk = copies.get(index >> bits)
            if chunk is None:
                chunk = copies[index >> bits] = self.chunks[index >> bits].copy()
            # Scalar stores: a step changes a few entries per chunk, and fancy
            # indexing with lists costs more than the copy itself.
            chunk[index & mask] = value
        chunks = list(self.chunks)
        for chunk_id, chunk in copies.items():
            chunks[chunk_id] = _readonly(chunk)
        return ChunkedArray(tuple(chunks), bits, self.size)


@dataclass(frozen=True)
class PoolState:
    """One block pool with an intrusive doubly linked free queue.

    refcounts: int32 [num_blocks]
    next_free: int32 [num_blocks + 1]  successor in the free queue; index
               num_blocks is the sentinel, so next_free[num_blocks] is the head.
    prev_free: int32 [num_blocks + 1]  predecessor; prev_free[num_blocks] is the tail.
               Both are -1 for blocks outside the queue.
    num_free:  number of blocks in the queue.
    """

    refcounts: ChunkedArray
    next_free: ChunkedArray
    prev_free: ChunkedArray
    num_free: int

    @classmethod
    def create(cls, num_blocks: int, first_block: int = 0) -> PoolState:
        """All blocks free, in id order; blocks below first_block are reserved."""
        sentinel = num_blocks
        chain = np.concatenate([[sentinel], np.arange(first_block, num_blocks), [sentinel]])
        next_free = np.full(num_blocks + 1, -1, np.int32)
        prev_free = np.full(num_blocks + 1, -1, np.int32)
        next_free[chain[:-1]] = chain[1:]
        prev_free[chain[1:]] = chain[:-1]
        refcounts = np.zeros(num_blocks, np.int32)
        return cls(
            ChunkedArray.of(refcounts),
            ChunkedArray.of(next_free),
            ChunkedArray.of(prev_free),
            num_blocks - first_block,
        )

    @property
    def num_blocks(self) -> int:
        return len(self.refcounts)

    def free_queue(self) -> list[int]:
        """Free blocks from the head (allocated next) to the tail."""
        blocks, block = [], self.next_free.item(self.num_blocks)
        while block != self.num_blocks:
            blocks.append(block)
            block = self.next_free.item(block)
        return blocks


@dataclass(frozen=True)
class AllocatorState:
    """Device and host pools plus the prefix cache.

    block_hashes:  uint64 [device blocks]  prefix hash of each device block,
                   NO_HASH if it holds none.
    hash_index:    hash -> CachedBlock (block, cache id, content key), for every
                   block with a hash.
    next_cache_id: the id the next registration takes; ids are never reused.
    """

    device: PoolState
    host: PoolState
    block_hashes: ChunkedArray
    hash_index: HashIndex[CachedBlock]
    next_cache_id: int

    @classmethod
    def create(cls, num_blocks: int, num_host_blocks: int) -> AllocatorState:
        """Empty pools; device block 0 is the reserved null block."""
        return cls(
            device=PoolState.create(num_blocks, first_block=1),
            host=PoolState.create(num_host_blocks),
            block_hashes=ChunkedArray.of(np.zeros(num_blocks, np.uint64)),
            hash_index=HashIndex.empty(num_blocks),
            next_cache_id=1,
        )


@dataclass(frozen=True)
class BlockOps:
    """Data movement one step asks of the device, applied before its attention.

    swap_out: int32 [K, 2]  (device block, host block), applied first.
    swap_in:  int32 [K, 2]  (host block, device block), applied second.
    copies:   int32 [K, 2]  (source, destination) device blocks, applied last,
              all sources read before any destination is written.

    No block is written twice: the destinations of swap_in and copies are
    distinct device blocks, those of swap_out distinct host blocks, so every
    phase may scatter its writes in any order.
    """

    swap_out: np.ndarray
    swap_in: np.ndarray
    copies: np.ndarray


class _PoolEdit:
    """Changes to one PoolState ("device" or "host", its `name`), overlaid on it until `commit`."""

    def __init__(self, base: PoolState, name: str):
        self.base = base
        self.name = name
        self.num_free = base.num_free
        self._sentinel = base.num_blocks
        self._refcounts: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._deferred: list[int] = []

    def refcount(self, block: int) -> int:
        count = self._refcounts.get(block)
        return self.base.refcounts.item(block) if count is None else count

    def checked_refcount(self, block: int) -> int:
        """refcount(block), for a block id checked to lie in the pool (numpy would read
        a negative one from the end)."""
        if not 0 <= block < self._sentinel:
            raise ValueError(f"{self.name} block {block} is out of range [0, {self._sentinel})")
        return self.refcount(block)

    def check_held(self, tables: list[list[int]]) -> None:
        """Raise unless every block occurs in `tables` at most as often as it has holders."""
        for block, count in Counter(block for table in tables for block in table).items():
            holders = self.checked_refcount(block)
            if count > holders:
                raise ValueError(
                    f"{self.name} block {block} occurs {count} times in the tables "
                    f"but has {holders} holders"
                )

    def _next_of(self, block: int) -> int:
        link = self._next.get(block)
        return self.base.next_free.item(block) if link is None else link

    def _prev_of(self, block: int) -> int:
        link = self._prev.get(block)
        return self.base.prev_free.item(block) if link is None else link

    def _link(self, before: int, after: int) -> None:
        self._next[before] = after
        self._prev[after] = before

    def _push_tail(self, block: int) -> None:
        self._link(self._prev_of(self._sentinel), block)
        self._link(block, self._sentinel)
        self.num_free += 1

    def _unlink(self, block: int) -> None:
        self._link(self._prev_of(block), self._next_of(block))
        self._next[block] = self._prev[block] = -1
        self.num_free -= 1

    def pop_head(self) -> int:
        """Take the head of the free queue; its refcount stays 0 for the caller to set."""
        block = self._next_of(self._sentinel)
        assert block != self._sentinel, "free queue is empty"
        self._unlink(block)
        return block

    def reuse(self, block: int) -> None:
        """Take a free block (anywhere in the queue, or pinned and freed) back into use."""
        assert self.refcount(block) == 0, block
        if block in self._deferred:
            self._deferred.remove(block)
        else:
            self._unlink(block)

    def incref(self, block: int) -> None:
        self._refcounts[block] = self.refcount(block) + 1

    def decref(self, block: int) -> None:
        count = self.checked_refcount(block) - 1
        if count < 0:
            raise ValueError(
                f"{self.name} block {block} freed more often than referenced: it is already free"
            )
        self._refcounts[block] = count
        if count > 0:
            return
        if block in self._pinned:
            self._deferred.append(block)
        else:
            self._push_tail(block)

    def pin(self, block: int) -> None:
        """Keep `block` out of the free queue until commit: this step's ops read or write it."""
        self._pinned.add(block)

    def commit(self) -> PoolState:
        for block in self._deferred:
            self._push_tail(block)
        self._deferred.clear()
        self._pinned.clear()
        return PoolState(
            self.base.refcounts.updated(self._refcounts),
            self.base.next_free.updated(self._next),
            self.base.prev_free.updated(self._prev),
            self.num_free,
        )


class Transaction:
    """One step's changes to an AllocatorState; `commit()` gives the next state.

    The base state is never modified: the same state can start any number of
    transactions, and earlier states stay valid.
    """

    def __init__(self, state: AllocatorState):
        self.base = state
        self._device = _PoolEdit(state.device, "device")
        self._host = _PoolEdit(state.host, "host")
        self._block_hashes: dict[int, int] = {}
        self._index: dict[int, CachedBlock | None] = {}
        self._next_cache_id = state.next_cache_id
        self._committed = False
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._copies: list[tuple[int, int]] = []
        self._copied_from: dict[int, int] = {}  # copy destination -> its source
        self._written: set[int] = set()

    @property
    def num_free(self) -> int:
        """Free device blocks, cached ones included (allocation evicts them)."""
        return self._device.num_free

    @property
    def num_free_host(self) -> int:
        return self._host.num_free

    def refcount(self, block: int) -> int:
        return self._device.refcount(block)

    def host_refcount(self, block: int) -> int:
        return self._host.refcount(block)

    def block_hash(self, block: int) -> int:
        block_hash = self._block_hashes.get(block)
        return self.base.block_hashes.item(block) if block_hash is None else block_hash

    def _entry(self, block_hash: int) -> CachedBlock | None:
        if block_hash in self._index:
            return self._index[block_hash]  # None: evicted in this step
        return self.base.hash_index.get(block_hash)

    def cached_block(
        self, block_hash: int, parent: int, cache_salt: str | None, tokens: bytes
    ) -> CachedBlock | None:
        """The entry, of a block in use or free, under `block_hash` with this content key
        (parent, cache_salt, tokens), or None.

        An entry under `block_hash` with another key is a hash collision: a miss.
        """
        # `_entry` and the key comparison inlined: this runs for every block of every lookup.
        if block_hash in self._index:
            entry = self._index[block_hash]
        else:
            entry = self.base.hash_index.get(block_hash)
        if entry is None or entry[2] != parent or entry[4] != tokens or entry[3] != cache_salt:
            return None
        return entry

    def is_written(self, block: int) -> bool:
        """Whether this step's swap-in or copies write device `block` (after any swap-out)."""
        return block in self._written

    def _check_free(self, num_blocks: int, num_free: int, pool: str) -> None:
        if num_blocks > num_free:
            raise ValueError(f"need {num_blocks} free {pool} blocks, only {num_free} are free")

    def _take_head(self) -> int:
        """Pop the LRU free device block, evicting its prefix hash; refcount stays 0."""
        block = self._device.pop_head()
        block_hash = self.block_hash(block)
        if block_hash != NO_HASH:
            self._index[block_hash] = None
            self._block_hashes[block] = NO_HASH
        return block

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` device blocks from the head of the free queue, refcount 1 each."""
        self._check_free(num_blocks, self.num_free, "device")
        blocks = [self._take_head() for _ in range(num_blocks)]
        for block in blocks:
            self._device.incref(block)
        return blocks

    def share(self, block: int) -> None:
        """One more holder of an in-use device block (a fork)."""
        if self._device.checked_refcount(block) == 0:
            raise ValueError(f"device block {block} is free; only a block in use can be shared")
        self._device.incref(block)

    def take_cached(self, block: int) -> None:
        """One more holder of a cached block (a prefix hit); a free one leaves the free queue."""
        holders = self._device.checked_refcount(block)
        if self.block_hash(block) == NO_HASH:
            raise ValueError(f"device block {block} is not in the prefix cache")
        if holders == 0:
            self._device.reuse(block)
        self._device.incref(block)

    def free(self, block: int) -> None:
        """Drop one holder of a device block; at zero it joins the tail, keeping its hash.

        Raises ValueError for a block that no one holds (a double free).
        """
        self._device.decref(block)

    def free_host(self, block: int) -> None:
        self._host.decref(block)

    def register(
        self, block: int, block_hash: int, parent: int, cache_salt: str | None, tokens: bytes
    ) -> int | None:
        """Make a full, computed block findable by `block_hash` and its content key
        (parent, cache_salt, tokens); returns its cache id.

        If another block holds `block_hash`, `block` stays private: the holder's
        cache id if it holds the same key (equal K/V), None if it holds other
        content (a hash collision).
        """
        entry = self._entry(block_hash)
        if entry is not None:
            return entry[1] if entry[2:] == (parent, cache_salt, tokens) else None
        if self.block_hash(block) != NO_HASH:
            raise ValueError(f"device block {block} is already cached under another hash")
        cache_id = self._next_cache_id
        self._next_cache_id += 1
        self._index[block_hash] = (block, cache_id, parent, cache_salt, tokens)
        self._block_hashes[block] = block_hash
        return cache_id

    def copy_on_write(self, block: int, copy_content: bool) -> int:
        """Give the caller a private block in place of a shared one.

        A new block replaces one holder of `block`; if `copy_content`, the step
        copies `block` into it (the caller wrote some of its slots before): from
        `block` itself, or from its source if this step's copies fill `block`.
        """
        holders = self._device.checked_refcount(block)
        if holders < 2:
            raise ValueError(
                f"device block {block} has {holders} holders; copy-on-write needs a shared one"
            )
        (private,) = self.allocate(1)
        if copy_content:
            source = self._copied_from.get(block, block)
            self._device.pin(source)
            self._device.pin(private)
            self._copies.append((source, private))
            self._copied_from[private] = source
            self._written.add(private)
        self._device.decref(block)
        return private

    def copy(self, source: int, dest: int) -> None:
        """The step copies device block `source` into `dest`, a block the caller holds alone
        (a reserved sequence forked into blocks of its own)."""
        if self._device.checked_refcount(dest) != 1 or self._device.checked_refcount(source) < 1:
            raise ValueError(
                f"copying device block {source} into {dest} needs both in use and {dest} "
                "held by one table"
            )
        source = self._copied_from.get(source, source)
        self._device.pin(source)
        self._device.pin(dest)
        self._copies.append((source, dest))
        self._copied_from[dest] = source
        self._written.add(dest)

    def swap_out(self, tables: list[list[int]]) -> list[list[int]]:
        """Move device block tables to host; each distinct block is copied once."""
        self._device.check_held(tables)
        distinct = list(dict.fromkeys(block for table in tables for block in table))
        self._check_free(len(distinct), self.num_free_host, "host")
        written = [block for block in distinct if block in self._written]
        if written:
            raise ValueError(
                f"device blocks {written} are written by this step's swap-in or copies, "
                "which run after its swap-outs; swap them out in a later step"
            )
        host_of = {block: self._host.pop_head() for block in distinct}
        self._swap_out.extend(host_of.items())
        for block in host_of.values():
            self._host.pin(block)
        host_tables = [[host_of[block] for block in table] for table in tables]
        for table in host_tables:
            for block in table:
                self._host.incref(block)
        for table in tables:
            for block in reversed(table):
                self._device.decref(block)
        return host_tables

    def swap_in(self, host_tables: list[list[int]]) -> list[list[int]]:
        """Move host block tables back to fresh device blocks; each distinct block copied once."""
        self._host.check_held(host_tables)
        distinct = list(dict.fromkeys(block for table in host_tables for block in table))
        self._check_free(len(distinct), self.num_free, "device")
        device_of = {block: self._take_head() for block in distinct}
        self._swap_in.extend(device_of.items())
        self._written.update(device_of.values())
        for block in device_of.values():
            self._device.pin(block)
        tables = [[device_of[block] for block in table] for table in host_tables]
        for table in tables:
            for block in table:
                self._device.incref(block)
        for block in distinct:
            self._host.pin(block)
        for table in host_tables:
            for block in table:
                self._host.decref(block)
        return tables

    def commit(self) -> tuple[AllocatorState, BlockOps]:
        """The next state and the device ops of this step; a transaction commits once."""
        if self._committed:
            raise RuntimeError("transaction already committed: start the next one from its state")
        self._committed = True
        state = AllocatorState(
            device=self._device.commit(),
            host=self._host.commit(),
            block_hashes=self.base.block_hashes.updated(self._block_hashes),
            hash_index=self.base.hash_index.updated(self._index),
            next_cache_id=self._next_cache_id,
        )
        ops = BlockOps(_pairs(self._swap_out), _pairs(self._swap_in), _pairs(self._copies))
        return state, ops
