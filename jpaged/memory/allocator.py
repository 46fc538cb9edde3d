"""The block allocator: reference counts, LRU free queues and a step's device ops, as arrays.

`AllocatorState` is a NamedTuple of numpy arrays (so a JAX pytree as it is):
one `BlockPool` for the device and one for the host (swap space), each with
its reference counts and its free queue, and the `StepOps` the open step has
asked of the device. The transitions below take the state and return it with
their result. On the host they update the arrays in place: one set of arrays,
touched where the step touches them, whatever the pool's size. No transition
keeps a Python object per block, and every array has a size fixed by the pool,
so the transitions of one block (`take_free_block`, `drop_holder`,
`private_copy`, ...) run unchanged on `jax.numpy` arrays under `jit`, where they
return updated copies: the host's transitions check their arguments and run
those, and the on-device decode loop (jpaged.worker.decode_loop) allocates with
them. The host adopts the state the device returns.

Free queue (vLLM v1's LRU order): an intrusive doubly linked list through
`next_free` / `prev_free`, whose entry `num_blocks` is the sentinel. Freed
blocks join the tail and allocation takes the head; a block taken back while
free (a prefix-cache hit) leaves from wherever it is. Which free blocks still
hold cached K/V is the prefix cache's business (jpaged.memory.prefix_cache):
the allocator only hands blocks out. Block 0 of the device pool is the null
block: never in the queue, never allocated, never freed.

The host pool has two uses. A swapped-out sequence holds its host blocks; a
free host block may still hold a copy of a prefix-cached device block (the
prefix cache's host tier, jpaged.memory.host_tier), evicted as the queue hands
it out, as the device's free cached blocks are.

The device applies a step's `BlockOps` before the step's attention, in this
order: swap_out (device -> host), store (device -> host: a tier copy),
swap_in (host -> device), load (host -> device: a tier hit), copies
(copy-on-write, all sources read before any destination is written). Blocks
freed during a step may be reused in the same step, which that order makes
safe, except for blocks the step's ops still touch: blocks a later phase reads
(copy sources on the device, swap-in and load sources on the host) and blocks
an op writes (swap-out and store destinations on the host, swap-in, load and
copy destinations on the device; reused, one would take a second write from a
later phase or the same scatter). Those are pinned: freed, they wait in the
pool's `deferred` list and join the free queue at `commit`, so no step writes a
block twice. Because
copies read before they write, a copy from a block that this step's copies fill
reads that block's own source instead. The one order a step cannot express is
swapping out a device block that its own swap-in or copies write, so
`swap_out` refuses that.

Every transition checks its arguments before it changes anything and raises
ValueError for misuse (a double free, sharing a free block, too few free blocks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class BlockPool(NamedTuple):
    """One pool of N blocks.

    refcounts:    int32 [N]      holders of each block (0: free).
    next_free:    int32 [N + 1]  successor in the free queue; entry N is the sentinel,
                                 so next_free[N] is the head.
    prev_free:    int32 [N + 1]  predecessor; prev_free[N] is the tail. Both are -1
                                 for blocks outside the queue.
    num_free:     int32 []       blocks in the queue.
    pinned:       bool [N]       blocks this step's ops read or write.
    deferred:     int32 [N]      pinned blocks freed this step, in the order freed:
                                 the first num_deferred entries.
    num_deferred: int32 []
    """

    refcounts: np.ndarray
    next_free: np.ndarray
    prev_free: np.ndarray
    num_free: np.ndarray
    pinned: np.ndarray
    deferred: np.ndarray
    num_deferred: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.refcounts)


class StepOps(NamedTuple):
    """The device ops of the open step (N device blocks, H host blocks).

    swap_out:    int32 [H, 2]  (device block, host block) pairs, the first sizes[0] rows.
    store:       int32 [H, 2]  (device block, host block), the first sizes[1] rows.
    swap_in:     int32 [N, 2]  (host block, device block), the first sizes[2] rows.
    load:        int32 [N, 2]  (host block, device block), the first sizes[3] rows.
    copies:      int32 [N, 2]  (source, destination) device blocks, the first sizes[4].
    sizes:       int32 [5]     rows in use, in the order of the phases above.
    written:     bool [N]      device blocks this step's swap-in, load or copies write.
    copied_from: int32 [N]     a copy destination's source (-1 for other blocks).

    Capacities hold a whole step: its writes go to distinct blocks.
    """

    swap_out: np.ndarray
    store: np.ndarray
    swap_in: np.ndarray
    load: np.ndarray
    copies: np.ndarray
    sizes: np.ndarray
    written: np.ndarray
    copied_from: np.ndarray


class AllocatorState(NamedTuple):
    device: BlockPool
    host: BlockPool
    ops: StepOps


_NO_PAIRS = np.zeros((0, 2), np.int32)
_NO_PAIRS.flags.writeable = False


@dataclass(frozen=True)
class BlockOps:
    """Data movement one step asks of the device, applied before its attention, one
    phase after another in the order of jpaged.worker.model_runner.BLOCK_OP_PHASES:
    swap_out, store, swap_in, load, copies (the blocks that leave the device are read
    before any is written, and the copies may copy a block swap_in or load filled).

    swap_out: int32 [K, 2]  (device block, host block): preemption's swap space.
    swap_in:  int32 [K, 2]  (host block, device block).
    copies:   int32 [K, 2]  (source, destination) device blocks, all sources read
              before any destination is written.
    store:    int32 [K, 2]  (device block, host block): the prefix cache's host tier
              keeps a copy of a block it registered.
    load:     int32 [K, 2]  (host block, device block): a prefix hit in the host tier.

    No block is written twice: the destinations of swap_in, load and copies are
    distinct device blocks, those of swap_out and store distinct host blocks, so every
    phase may scatter its writes in any order.
    """

    swap_out: np.ndarray
    swap_in: np.ndarray
    copies: np.ndarray
    # The shared, read-only empty pairs (a dataclass takes no array as a plain default).
    store: np.ndarray = field(default_factory=lambda: _NO_PAIRS)
    load: np.ndarray = field(default_factory=lambda: _NO_PAIRS)

    @classmethod
    def none(cls) -> BlockOps:
        return cls(_NO_PAIRS, _NO_PAIRS, _NO_PAIRS)


# StepOps' buffers, by their index in `sizes` (the order a step applies them).
_SWAP_OUT, _STORE, _SWAP_IN, _LOAD, _COPIES = range(5)


def _new_pool(num_blocks: int, first_block: int) -> BlockPool:
    """Every block from first_block on free, in id order; those below it are reserved."""
    sentinel = num_blocks
    chain = np.concatenate([[sentinel], np.arange(first_block, num_blocks), [sentinel]])
    next_free = np.full(num_blocks + 1, -1, np.int32)
    prev_free = np.full(num_blocks + 1, -1, np.int32)
    next_free[chain[:-1]] = chain[1:]
    prev_free[chain[1:]] = chain[:-1]
    return BlockPool(
        refcounts=np.zeros(num_blocks, np.int32),
        next_free=next_free,
        prev_free=prev_free,
        num_free=np.array(num_blocks - first_block, np.int32),
        pinned=np.zeros(num_blocks, bool),
        deferred=np.zeros(num_blocks, np.int32),
        num_deferred=np.array(0, np.int32),
    )


def create(num_blocks: int, num_host_blocks: int) -> AllocatorState:
    """Empty pools; device block 0 is the reserved null block."""
    return AllocatorState(
        device=_new_pool(num_blocks, first_block=1),
        host=_new_pool(num_host_blocks, first_block=0),
        ops=StepOps(
            swap_out=np.zeros((num_host_blocks, 2), np.int32),
            store=np.zeros((num_host_blocks, 2), np.int32),
            swap_in=np.zeros((num_blocks, 2), np.int32),
            load=np.zeros((num_blocks, 2), np.int32),
            copies=np.zeros((num_blocks, 2), np.int32),
            sizes=np.zeros(5, np.int32),
            written=np.zeros(num_blocks, bool),
            copied_from=np.full(num_blocks, -1, np.int32),
        ),
    )


# Reading a pool.


def free_queue(pool: BlockPool) -> list[int]:
    """Free blocks from the head (allocated next) to the tail."""
    blocks, sentinel = [], pool.num_blocks
    block = int(pool.next_free[sentinel])
    while block != sentinel:
        blocks.append(block)
        block = int(pool.next_free[block])
    return blocks


def _check_range(pool: BlockPool, name: str, blocks: np.ndarray) -> None:
    """Raise unless every block id lies in the pool (numpy would read a negative one
    from the end)."""
    if len(blocks) and not (blocks.min() >= 0 and blocks.max() < pool.num_blocks):
        bad = next(int(b) for b in blocks if not 0 <= b < pool.num_blocks)
        raise ValueError(f"{name} block {bad} is out of range [0, {pool.num_blocks})")


def _check_free_count(pool: BlockPool, name: str, num_blocks: int) -> None:
    if num_blocks > pool.num_free:
        raise ValueError(
            f"need {num_blocks} free {name} blocks, only {int(pool.num_free)} are free"
        )


def _check_held(pool: BlockPool, name: str, tables: list[list[int]]) -> None:
    """Raise unless every block occurs in `tables` at most as often as it has holders."""
    counts = Counter(block for table in tables for block in table)
    _check_range(pool, name, np.fromiter(counts, np.int64, len(counts)))
    for block, count in counts.items():
        holders = int(pool.refcounts[block])
        if count > holders:
            raise ValueError(
                f"{name} block {block} occurs {count} times in the tables but has {holders} "
                "holders"
            )


# One set of transitions for numpy and for JAX.
#
# The transitions below touch one block at a time and read and write arrays only
# through `store` and `_add`: on numpy arrays these store in place (and return the
# same array), on JAX arrays they return an updated copy (`x.at[i].set(v)`), so the
# same function runs on the host and under `jax.jit`. `where` masks an update: under
# `jit` a call cannot be skipped, so a transition that may not apply takes a traced
# `where` instead (on the host it is True, or a numpy bool, and a masked call skips
# its stores). Loops over a number of blocks fixed by the caller are Python loops
# (unrolled under `jit`); a count known only on the device is a fixed number of
# masked calls.


def store(x, index, value, where=True):
    """x with x[index] = value where `where` (numpy: in place, the same array)."""
    if isinstance(x, np.ndarray):
        if where is True or where:
            x[index] = value
        return x
    if where is not True:
        value = x.__array_namespace__().where(where, value, x[index])
    return x.at[index].set(value)


def _add(x, index, value, where=True):
    """x with `value` added at each entry of `index` (repeated entries add up)."""
    if isinstance(x, np.ndarray):
        if where is not True:
            value = np.where(where, value, 0)
        np.add.at(x, index, value)
        return x
    if where is not True:
        value = x.__array_namespace__().where(where, value, 0)
    return x.at[index].add(value)


def pop_head(pool: BlockPool, where=True) -> tuple[BlockPool, int]:
    """The queue's head block, taken out of it (its refcount unchanged). The pool must
    have a free block where `where`; elsewhere the block returned means nothing."""
    sentinel = pool.num_blocks
    block = pool.next_free[sentinel]
    after = pool.next_free[block]
    next_free = store(pool.next_free, sentinel, after, where)
    prev_free = store(pool.prev_free, after, sentinel, where)
    next_free = store(next_free, block, -1, where)
    prev_free = store(prev_free, block, -1, where)
    num_free = store(pool.num_free, (), pool.num_free - 1, where)
    return pool._replace(next_free=next_free, prev_free=prev_free, num_free=num_free), block


def push_tail(pool: BlockPool, block, where=True) -> BlockPool:
    """`block` (outside the queue) appended to its tail."""
    sentinel = pool.num_blocks
    tail = pool.prev_free[sentinel]
    next_free = store(pool.next_free, tail, block, where)
    prev_free = store(pool.prev_free, block, tail, where)
    next_free = store(next_free, block, sentinel, where)
    prev_free = store(prev_free, sentinel, block, where)
    num_free = store(pool.num_free, (), pool.num_free + 1, where)
    return pool._replace(next_free=next_free, prev_free=prev_free, num_free=num_free)


def unlink(pool: BlockPool, block, where=True) -> BlockPool:
    """`block` taken out of the queue from wherever it is."""
    before, after = pool.prev_free[block], pool.next_free[block]
    next_free = store(pool.next_free, before, after, where)
    prev_free = store(pool.prev_free, after, before, where)
    next_free = store(next_free, block, -1, where)
    prev_free = store(prev_free, block, -1, where)
    num_free = store(pool.num_free, (), pool.num_free - 1, where)
    return pool._replace(next_free=next_free, prev_free=prev_free, num_free=num_free)


def drop_holder(pool: BlockPool, block, where=True) -> BlockPool:
    """One holder fewer of `block`; at none it is released: pinned, it waits in the
    deferred list for commit, else it joins the tail."""
    remaining = pool.refcounts[block] - 1
    pool = pool._replace(refcounts=store(pool.refcounts, block, remaining, where))
    released = (remaining == 0) & where
    pinned = pool.pinned[block]
    pool = pool._replace(
        deferred=store(pool.deferred, pool.num_deferred, block, released & pinned),
        num_deferred=store(pool.num_deferred, (), pool.num_deferred + 1, released & pinned))
    return push_tail(pool, block, released & ~pinned)


def take_free_block(pool: BlockPool, where=True) -> tuple[BlockPool, int]:
    """The head block, held once: one block of `allocate`."""
    pool, block = pop_head(pool, where)
    return pool._replace(refcounts=store(pool.refcounts, block, 1, where)), block


def add_holders(pool: BlockPool, blocks, where=True) -> BlockPool:
    """One more holder per entry of `blocks` (blocks in use): a fork shares them."""
    return pool._replace(refcounts=_add(pool.refcounts, blocks, 1, where))


def record_copy(state: AllocatorState, source, dest, where=True) -> AllocatorState:
    """The step copies device block `source` into `dest` (from `source`'s own source if
    this step's copies fill it); both pinned until commit."""
    ops = state.ops
    source = _first_source(ops, source)
    device = state.device
    pinned = store(store(device.pinned, source, True, where), dest, True, where)
    count = ops.sizes[_COPIES]
    ops = ops._replace(
        copies=store(store(ops.copies, (count, 0), source, where), (count, 1), dest, where),
        sizes=store(ops.sizes, _COPIES, count + 1, where),
        copied_from=store(ops.copied_from, dest, source, where),
        written=store(ops.written, dest, True, where))
    return state._replace(device=device._replace(pinned=pinned), ops=ops)


def _first_source(ops: StepOps, source):
    """The block a copy from `source` reads: `source`'s own source if this step's copies
    fill it."""
    copied_from = ops.copied_from[source]
    if isinstance(ops.copied_from, np.ndarray):
        return int(copied_from) if copied_from >= 0 else source
    return copied_from.__array_namespace__().where(copied_from >= 0, copied_from, source)


def private_copy(state: AllocatorState, block, copy_content, where=True
                 ) -> tuple[AllocatorState, int]:
    """A private block from the queue's head in place of one holder of the shared
    `block`, filled with its content by this step's copies where `copy_content`."""
    device, private = take_free_block(state.device, where)
    state = record_copy(state._replace(device=device), block, private, copy_content & where)
    device = state.device
    device = device._replace(refcounts=store(device.refcounts, block, device.refcounts[block] - 1,
                                            where))
    return state._replace(device=device), private


# Host helpers over many blocks (numpy only).


def _pop_heads(pool: BlockPool, num_blocks: int) -> tuple[BlockPool, np.ndarray]:
    """int32 [num_blocks]: the head blocks of the queue, taken out of it (refcounts 0)."""
    blocks = np.empty(num_blocks, np.int32)
    for i in range(num_blocks):
        pool, blocks[i] = pop_head(pool)
    return pool, blocks


def _push_tail(pool: BlockPool, blocks: np.ndarray) -> BlockPool:
    """Append `blocks` (distinct, outside the queue) to the tail, in order."""
    for block in blocks.tolist():
        pool = push_tail(pool, block)
    return pool


def _drop_holders(pool: BlockPool, name: str, blocks: np.ndarray) -> BlockPool:
    """One holder fewer per entry of `blocks`, in order; blocks whose last holder left
    are released in the order of their last entries."""
    _check_range(pool, name, blocks)
    unique, counts = np.unique(blocks, return_counts=True)
    holders = pool.refcounts[unique]
    if (counts > holders).any():
        block = int(unique[np.argmax(counts > holders)])
        raise ValueError(
            f"{name} block {block} freed more often than referenced: it is already free"
        )
    for block in blocks.tolist():
        pool = drop_holder(pool, block)
    return pool


def _as_blocks(blocks) -> np.ndarray:
    return np.asarray(blocks, np.int64).reshape(-1)


# Transitions (host): each checks its arguments, then runs the transitions above.


def allocate(state: AllocatorState, num_blocks: int) -> tuple[AllocatorState, np.ndarray]:
    """Take `num_blocks` device blocks from the head of the free queue, refcount 1 each.

    returns int32 [num_blocks], in queue order.
    """
    _check_free_count(state.device, "device", num_blocks)
    device, blocks = state.device, np.empty(num_blocks, np.int32)
    for i in range(num_blocks):
        device, blocks[i] = take_free_block(device)
    return state._replace(device=device), blocks


def share(state: AllocatorState, blocks) -> AllocatorState:
    """One more holder for each entry of `blocks` (a fork); every block must be in use."""
    device, blocks = state.device, _as_blocks(blocks)
    _check_range(device, "device", blocks)
    if len(blocks) and not device.refcounts[blocks].all():
        block = int(blocks[np.argmin(device.refcounts[blocks] != 0)])
        raise ValueError(f"device block {block} is free; only a block in use can be shared")
    return state._replace(device=add_holders(device, blocks))


def take(state: AllocatorState, block: int) -> AllocatorState:
    """One more holder of a device block in use or free (a prefix hit on a cached block);
    a free one leaves the free queue, or the step's deferred list."""
    _check_range(state.device, "device", _as_blocks(block))
    if block == 0:
        raise ValueError("device block 0 is the null block: it holds no K/V")
    return state._replace(device=_take(state.device, block))


def _take(pool: BlockPool, block: int) -> BlockPool:
    """One more holder of `block`; a free one leaves the queue or the deferred list."""
    if pool.refcounts[block] == 0:
        num_deferred = int(pool.num_deferred)
        waiting = np.flatnonzero(pool.deferred[:num_deferred] == block)
        if len(waiting):
            i = int(waiting[0])
            pool.deferred[i : num_deferred - 1] = pool.deferred[i + 1 : num_deferred]
            pool.num_deferred[...] -= 1
        else:
            pool = unlink(pool, block)
    pool.refcounts[block] += 1
    return pool


def free(state: AllocatorState, blocks) -> AllocatorState:
    """One holder fewer per entry of `blocks` (device blocks, freed in this order); a
    block at zero joins the tail (or waits for commit if pinned).

    Raises ValueError, changing nothing, for a block that no one holds (a double free).
    """
    return state._replace(device=_drop_holders(state.device, "device", _as_blocks(blocks)))


def free_host(state: AllocatorState, blocks) -> AllocatorState:
    """As `free`, for host blocks."""
    return state._replace(host=_drop_holders(state.host, "host", _as_blocks(blocks)))


def _record(state: AllocatorState, kind: int, pairs: np.ndarray) -> None:
    ops, start = state.ops, int(state.ops.sizes[kind])
    buffer = (ops.swap_out, ops.store, ops.swap_in, ops.load, ops.copies)[kind]
    buffer[start : start + len(pairs)] = pairs
    ops.sizes[kind] += len(pairs)


def copy(state: AllocatorState, source: int, dest: int) -> AllocatorState:
    """The step copies device block `source` into `dest`, a block in use by one holder;
    from `source`'s own source if this step's copies fill it."""
    device = state.device
    _check_range(device, "device", _as_blocks([source, dest]))
    if device.refcounts[dest] != 1 or device.refcounts[source] < 1:
        raise ValueError(
            f"copying device block {source} into {dest} needs both in use and {dest} held "
            "by one holder"
        )
    return record_copy(state, source, dest)


def copy_on_write(state: AllocatorState, block: int, copy_content: bool
                  ) -> tuple[AllocatorState, int]:
    """A private block in place of one holder of a shared `block`; with copy_content
    the step copies `block` into it (its holder wrote some of its slots before).

    returns (state, the private block), taken from the head of the free queue.
    """
    device = state.device
    _check_range(device, "device", _as_blocks(block))
    holders = int(device.refcounts[block])
    if holders < 2:
        raise ValueError(
            f"device block {block} has {holders} holders; copy-on-write needs a shared one"
        )
    _check_free_count(device, "device", 1)
    state, private = private_copy(state, block, copy_content)
    return state, int(private)


def swap_out(state: AllocatorState, tables: list[list[int]]
             ) -> tuple[AllocatorState, list[list[int]]]:
    """Move device block tables to host blocks; each distinct block is copied once.

    returns (state, the host tables).
    """
    device, host, ops = state.device, state.host, state.ops
    _check_held(device, "device", tables)
    distinct = np.fromiter(dict.fromkeys(b for table in tables for b in table), np.int64)
    _check_free_count(host, "host", len(distinct))
    written = distinct[ops.written[distinct]]
    if len(written):
        raise ValueError(
            f"device blocks {written.tolist()} are written by this step's swap-in or copies, "
            "which run after its swap-outs; swap them out in a later step"
        )
    host, host_blocks = _pop_heads(host, len(distinct))
    host.pinned[host_blocks] = True
    _record(state, _SWAP_OUT, np.stack([distinct, host_blocks], axis=1))
    host_of = dict(zip(distinct.tolist(), host_blocks.tolist(), strict=True))
    host_tables = [[host_of[block] for block in table] for table in tables]
    for table in host_tables:
        host = add_holders(host, table)
    for table in tables:
        device = _drop_holders(device, "device", np.asarray(table[::-1], np.int64))
    return state._replace(device=device, host=host), host_tables


def swap_in(state: AllocatorState, host_tables: list[list[int]]
            ) -> tuple[AllocatorState, list[list[int]]]:
    """Move host block tables back to fresh device blocks (from the head of the free
    queue); each distinct block is copied once.

    returns (state, the device tables).
    """
    device, host, ops = state.device, state.host, state.ops
    _check_held(host, "host", host_tables)
    distinct = np.fromiter(dict.fromkeys(b for table in host_tables for b in table), np.int64)
    _check_free_count(device, "device", len(distinct))
    device, device_blocks = _pop_heads(device, len(distinct))
    device.pinned[device_blocks] = True
    ops.written[device_blocks] = True
    _record(state, _SWAP_IN, np.stack([distinct, device_blocks], axis=1))
    device_of = dict(zip(distinct.tolist(), device_blocks.tolist(), strict=True))
    tables = [[device_of[block] for block in table] for table in host_tables]
    for table in tables:
        device = add_holders(device, table)
    host.pinned[distinct] = True
    for table in host_tables:
        host = _drop_holders(host, "host", np.asarray(table, np.int64))
    return state._replace(device=device, host=host), tables


def store_block(state: AllocatorState, device_block: int) -> tuple[AllocatorState, int]:
    """The step copies device `device_block` (in use) into the host queue's head block,
    which joins the queue's tail, free, at commit: the host tier's copy, evicted as the
    queue hands it out.

    returns (state, the host block).
    """
    device, host = state.device, state.host
    _check_range(device, "device", _as_blocks(device_block))
    if device.refcounts[device_block] < 1:
        raise ValueError(f"device block {device_block} is free: only a block in use "
                         "holds K/V to store")
    _check_free_count(host, "host", 1)
    host, host_block = take_free_block(host)
    host.pinned[host_block] = True
    host = drop_holder(host, host_block)  # pinned: it waits for commit
    _record(state, _STORE, np.array([[device_block, host_block]]))
    return state._replace(host=host), int(host_block)


def load_block(state: AllocatorState, host_block: int) -> tuple[AllocatorState, int]:
    """The step copies free host `host_block` (a tier copy) into a device block from the
    head of the free queue, held once; the host block rejoins the host queue's tail at
    commit, as the most recently used.

    returns (state, the device block).
    """
    device, host = state.device, state.host
    _check_range(host, "host", _as_blocks(host_block))
    if host.refcounts[host_block] != 0:
        raise ValueError(f"host block {host_block} is held by a swapped-out sequence: only "
                         "a free host block holds a tier copy")
    _check_free_count(device, "device", 1)
    host = _take(host, host_block)
    host.pinned[host_block] = True
    host = drop_holder(host, host_block)
    device, device_block = take_free_block(device)
    device.pinned[device_block] = True
    state.ops.written[device_block] = True
    _record(state, _LOAD, np.array([[host_block, device_block]]))
    return state._replace(device=device, host=host), int(device_block)


def _end_step(pool: BlockPool, pinned: np.ndarray) -> BlockPool:
    """Deferred blocks join the tail in the order they were freed; the pins lift."""
    num_deferred = int(pool.num_deferred)
    pool = _push_tail(pool, pool.deferred[:num_deferred].copy())
    pool.num_deferred[...] = 0
    pool.pinned[pinned] = False
    return pool


def commit(state: AllocatorState) -> tuple[AllocatorState, BlockOps]:
    """End the step: its device ops (the device applies them before the step runs), and
    a state whose next step starts with no ops, pins or deferred blocks."""
    ops = state.ops
    block_ops = BlockOps.none()
    if ops.sizes.any():
        swap_out, stores, swap_in, loads, copies = (
            buffer[:size].copy() for buffer, size in zip(
                (ops.swap_out, ops.store, ops.swap_in, ops.load, ops.copies),
                ops.sizes.tolist(), strict=True))
        block_ops = BlockOps(swap_out, swap_in, copies, store=stores, load=loads)
        # Exactly the blocks the ops name are pinned, and the written ones are destinations.
        device = _end_step(state.device, np.concatenate([swap_in[:, 1], loads[:, 1],
                                                         copies.reshape(-1)]))
        host = _end_step(state.host, np.concatenate([swap_out[:, 1], stores[:, 1],
                                                     swap_in[:, 0], loads[:, 0]]))
        ops.written[swap_in[:, 1]] = False
        ops.written[loads[:, 1]] = False
        ops.written[copies[:, 1]] = False
        ops.copied_from[block_ops.copies[:, 1]] = -1
        ops.sizes[:] = 0
        state = state._replace(device=device, host=host)
    return state, block_ops
