"""BlockManager: per-sequence block tables over the block allocator and the prefix cache.

The scheduler asks it whether a group fits, then allocates, appends, forks,
swaps and frees; each call runs the allocator's transitions
(jpaged.memory.allocator) on one state of arrays, and `end_step()` commits the
step and returns its device ops.

A sequence's table maps logical block i (positions i*block_size ..
(i+1)*block_size - 1) to a physical block of the device pool, or of the host
pool while the sequence is swapped out. Sequences of a group share blocks
after a fork (and copy them at their next write, with `share_blocks` off);
requests share full blocks through the prefix cache.

What the manager remembers of a sequence (its table, its hash chain) lives
here, keyed by seq_id, until `free(seq)`; that includes a WAITING sequence
whose prompt `can_allocate` has already hashed.

A prefix hit needs a cached block whose key (parent entry, salt, tokens) equals
the sequence's, block after block from the first: the hash only finds the
candidate, so a collision is a miss and the chain of hits stops there. Blocks
the allocator hands out lose their cache entries (`PrefixCache.evict`).

With a sliding window of W tokens on every layer (`CacheConfig.sliding_window`), a
query at position p reads keys p - W + 1 .. p only: after each step that computes a
sequence's tokens (`mark_computed`), the blocks wholly before its next token's window
go back to the pool, last first, and their table entries point at the null block.
Those released entries are always a table's leading ones; the kernels never read them
(pages before a window are skipped).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from jpaged.config import CacheConfig
from jpaged.memory import allocator
from jpaged.memory.allocator import AllocatorState, BlockOps, BlockPool
from jpaged.memory.block_table import BlockTable
from jpaged.memory.invariants import holder_problems
from jpaged.memory.kv_cache_groups import window_blocks
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.prefix_cache import (
    PrefixCache,
    PrefixCacheStats,
    hash_block,
    pack_tokens,
)
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

_RUNNING = SequenceStatus.RUNNING  # an enum attribute lookup costs as much as the check
Hits = tuple[list[int], list[int]]
"""A sequence's prefix-cache hit: the cached blocks of its prefix and their cache ids."""


@dataclass
class _SeqBlocks:
    """What the manager knows of one sequence.

    table:        physical blocks, logical order (host blocks while on_host).
    block_hashes: hash chain of the sequence's leading full blocks, computed once.
    block_tokens: `pack_tokens` of those blocks' token ids, as content keys hold them.
    cache_ids:    cache ids of the entries holding the K/V of the leading table
                  entries (theirs, or equal blocks cached first); a fork's child
                  inherits them. They stop before a block whose hash holds
                  other content (a collision).
    num_shared:   leading table entries another table may also hold. Entries past
                  it are this sequence's alone: only a fork, a prefix hit or a
                  swap-in shares a block, and a prefix hit takes only registered
                  blocks, which lie before the sequence's next write.
    owes_copies:  forked without `share_blocks`: the next append copies every
                  shared entry, written or not.
    num_released: leading table entries out of the window, given back to the pool and
                  pointing at the null block (0 without a window).
    """

    cache_salt: str | None
    table: BlockTable = field(default_factory=BlockTable)
    block_hashes: list[int] = field(default_factory=list)
    block_tokens: list[bytes] = field(default_factory=list)
    cache_ids: list[int] = field(default_factory=list)
    num_shared: int = 0
    on_host: bool = False
    owes_copies: bool = False
    num_released: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _copied_range(record: _SeqBlocks, first: int, end: int) -> tuple[int, int]:
    """Table entries [start, stop) that a write into entries first .. end - 1 must copy
    where shared: the written ones, or every shared one for a sequence owing copies."""
    if record.owes_copies:
        return 0, record.num_shared
    return first, min(end, record.num_shared)


@dataclass
class SharedPool:
    """The allocator state and prefix cache of one pool, which the block managers of
    several KV cache groups share (jpaged.memory.hybrid_block_manager)."""

    state: AllocatorState
    prefix_cache: PrefixCache

    @classmethod
    def create(cls, cache_config: CacheConfig) -> SharedPool:
        return cls(allocator.create(cache_config.num_blocks, cache_config.num_host_blocks),
                   PrefixCache(cache_config.num_blocks))


class BlockManager:
    """Block tables, prefix cache and swap space of one KV cache, or of one KV cache
    group of it.

    pool: the state shared with the other groups' managers (a pool of its own if None).
    group: this group's index; its prefix-cache entries are keyed apart from other
    groups' (chains rooted at hash `group` and parent id `-group`; group 0 is the
    plain cache's).
    anchor: the manager of group 0, whose chain of cache ids keys this group's
    entries: block i's parent is the anchor's entry of block i - 1. The anchor's chain
    vouches for the whole prefix, so a windowed group's hit needs only the blocks in
    the window (`anchored_hits`), found right to left.
    """

    def __init__(self, cache_config: CacheConfig, *, pool: SharedPool | None = None,
                 group: int = 0, anchor: BlockManager | None = None):
        self.block_size = cache_config.block_size
        self.num_device_blocks = cache_config.num_blocks - 1
        self.num_host_blocks = cache_config.num_host_blocks
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.share_blocks = cache_config.share_blocks
        self.sliding_window = cache_config.sliding_window
        self.chunk_tokens = cache_config.max_num_batched_tokens
        self.watermark_blocks = int(cache_config.watermark * self.num_device_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self.pool = pool or SharedPool.create(cache_config)
        self._root_hash, self._root_parent = group, -group
        self.anchor = anchor
        self._seqs: dict[int, _SeqBlocks] = {}
        self._logical_blocks = 0

    num_groups = 1
    # A decode loop may allocate from its device pool (`adopt_device_blocks`).
    adopts_device_blocks = True

    @property
    def state(self) -> AllocatorState:
        return self.pool.state

    @state.setter
    def state(self, state: AllocatorState) -> None:
        self.pool.state = state

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.pool.prefix_cache

    @property
    def num_free_blocks(self) -> int:
        """Free device blocks, cached ones included (allocation evicts them)."""
        return int(self.state.device.num_free)

    @property
    def num_free_host_blocks(self) -> int:
        return int(self.state.host.num_free)

    def refcount(self, block: int) -> int:
        """Holders of device `block`."""
        return int(self.state.device.refcounts[block])

    def host_refcount(self, block: int) -> int:
        return int(self.state.host.refcounts[block])

    @property
    def physical_blocks_used(self) -> int:
        """Device blocks held by at least one table (free cached blocks excluded)."""
        return self.num_device_blocks - self.num_free_blocks

    @property
    def logical_blocks_used(self) -> int:
        """Sum of device block-table lengths: what the tables would hold without sharing."""
        return self._logical_blocks

    @property
    def group_blocks_used(self) -> tuple[int]:
        """The logical blocks of each KV cache group: one."""
        return (self._logical_blocks,)

    def block_tables(self, seq: Sequence) -> tuple[BlockTable]:
        """The device block table of `seq` in each KV cache group: one table."""
        return (self.block_table(seq),)

    def block_table(self, seq: Sequence) -> BlockTable:
        """The device block table of `seq` (read-only to callers)."""
        record = self._seqs[seq.seq_id]
        if record.on_host:
            raise ValueError(f"sequence {seq.seq_id} is swapped out: it has no device table")
        return record.table

    def host_block_table(self, seq: Sequence) -> BlockTable:
        """The host block table of a swapped-out `seq`."""
        record = self._seqs[seq.seq_id]
        if not record.on_host:
            raise ValueError(f"sequence {seq.seq_id} is on the device: it has no host table")
        return record.table

    def end_step(self) -> BlockOps:
        """Commit this step; the device applies the returned ops."""
        self.state, ops = allocator.commit(self.state)
        return ops

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: the device KV they held is gone (the engine
        reallocated its cache). Every device block must be free; swapped
        sequences keep their host blocks. Pending device ops are dropped."""
        self.check_no_device_tables()
        committed, _ = allocator.commit(self.state)
        num_blocks = self.num_device_blocks + 1
        self.state = allocator.create(num_blocks, 0)._replace(host=committed.host,
                                                              ops=committed.ops)
        self.pool.prefix_cache = PrefixCache(num_blocks, self.prefix_cache.next_cache_id)

    def check_no_device_tables(self) -> None:
        """RuntimeError if a sequence holds device blocks (the prefix cache cannot reset)."""
        on_device = [seq_id for seq_id, record in self._seqs.items()
                     if len(record.table) and not record.on_host]
        if on_device:
            raise RuntimeError(
                f"the prefix cache can only be reset with every device block free; "
                f"sequences {on_device[:5]} hold device blocks")

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        """Check the blocks against the live sequences; RuntimeError on a violation.

        Every device and host block's reference count equals the number of the
        running (device) and swapped (host) sequences' tables holding it, so a
        block is free exactly when none does; the free counts agree; the null
        block is in no table but as its released leading entries, which are all
        the entries before the window of the sequence's next token; the logical
        block count is the tables' total, released entries excepted.
        """
        device = [self.block_table(seq).array for seq in running]
        host = [self.host_block_table(seq).array for seq in swapped]
        problems = holder_problems("device", self.state.device, device, first=1)
        problems += holder_problems("host", self.state.host, host, first=0)
        problems += self.table_problems(running)
        if problems:
            raise RuntimeError("KV block invariants violated: " + "; ".join(problems[:5]))

    def table_problems(self, running: list[Sequence]) -> list[str]:
        """Where the running sequences' tables break the null-block and window rules, or
        their length disagrees with the logical block count (see check_invariants)."""
        problems = []
        device = [self.block_table(seq).array for seq in running]
        for seq, table in zip(running, device, strict=True):
            released = self._seqs[seq.seq_id].num_released
            if (table[:released] != 0).any() or (table[released:] == 0).any():
                problems.append(f"sequence {seq.seq_id}: the null block outside its "
                                f"{released} released entries")
            out_of_window = min(self._window_start_block(seq.num_computed_tokens), len(table))
            if released != out_of_window:
                problems.append(f"sequence {seq.seq_id}: {released} entries released, "
                                f"{out_of_window} out of its window")
        logical = sum(len(table) for table in device) - sum(
            self._seqs[seq.seq_id].num_released for seq in running)
        if self.logical_blocks_used != logical:
            problems.append(f"logical blocks {self.logical_blocks_used}, tables hold {logical}")
        return problems

    # Admission -----------------------------------------------------------------

    def _record(self, seq: Sequence, cache_salt: str | None) -> _SeqBlocks:
        record = self._seqs.get(seq.seq_id)
        if record is None:
            record = self._seqs[seq.seq_id] = _SeqBlocks(cache_salt)
        return record

    def _memoise_blocks(self, seq: Sequence, record: _SeqBlocks, num_blocks: int) -> None:
        """Extend the memoised hash chain and block tokens to at least `num_blocks` blocks."""
        hashes, size = record.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else self._root_hash
            tokens = pack_tokens(seq.token_slice(i * size, (i + 1) * size))
            hashes.append(hash_block(parent, tokens, record.cache_salt))
            record.block_tokens.append(tokens)

    def prefix_hits(self, seqs: list[Sequence], group: SequenceGroup) -> list[Hits]:
        """For each of `seqs`: the cached blocks holding its longest cached prefix, never
        its last token (none for a group that must compute every token), and their
        cache ids."""
        return [self._prefix_hits(seq, group) for seq in seqs]

    def _prefix_hits(self, seq: Sequence, group: SequenceGroup) -> Hits:
        if not self.enable_prefix_caching or not group.use_prefix_cache:
            return [], []
        record = self._record(seq, group.cache_salt)
        num_eligible = (len(seq) - 1) // self.block_size
        self._memoise_blocks(seq, record, num_eligible)
        blocks: list[int] = []
        cache_ids: list[int] = []
        lookup, parent, salt = self.prefix_cache.lookup, self._root_parent, record.cache_salt
        chain = zip(record.block_hashes[:num_eligible], record.block_tokens, strict=False)
        for block_hash, tokens in chain:
            entry = lookup(block_hash, parent, salt, tokens)
            if entry is None:
                break
            blocks.append(entry[0])
            parent = entry[1]  # this entry's cache id, the next block's parent
            cache_ids.append(parent)
        return blocks, cache_ids

    def anchored_hits(self, seq: Sequence, group: SequenceGroup, anchor_ids: list[int],
                      num_blocks: int) -> Hits:
        """The longest hit of at most `num_blocks` blocks whose blocks this group holds in
        the cache, keyed by the anchor's cache ids `anchor_ids` (its hit's): every block
        for a global group, left to right; for a windowed one only those in the window of
        the hit's end, searched right to left. Entries before that window are 0 (never
        taken)."""
        record = self._record(seq, group.cache_salt)
        self._memoise_blocks(seq, record, num_blocks)
        salt, lookup = record.cache_salt, self.prefix_cache.lookup

        def entry(i: int):
            parent = anchor_ids[i - 1] if i else self._root_parent
            return lookup(record.block_hashes[i], parent, salt, record.block_tokens[i])

        end = num_blocks
        if self.sliding_window is None:
            found = []
            for i in range(end):
                hit = entry(i)
                if hit is None:
                    break
                found.append(hit)
            return [e[0] for e in found], [e[1] for e in found]
        found: dict[int, tuple] = {}
        i = end - 1
        while i >= self._window_start_block(end * self.block_size):
            hit = entry(i)
            if hit is None:
                end, i = i, i - 1  # no hit reaches past a missing window block
                continue
            found[i] = hit
            i -= 1
        start = self._window_start_block(end * self.block_size)
        return ([0] * start + [found[i][0] for i in range(start, end)],
                [0] * start + [found[i][1] for i in range(start, end)])

    def _window_start_block(self, position: int) -> int:
        """Leading table entries that a query at `position`, and every later one, no
        longer reads: the blocks wholly before key position - W + 1 (none without a
        window)."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def seq_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once: all of them, or with
        a window those of the window before a chunk and the chunk."""
        return window_blocks(num_tokens, self.block_size, self.sliding_window,
                             self.chunk_tokens)

    def admission_blocks(self, seqs: list[Sequence]) -> int:
        """Blocks the tables of `seqs` may hold at once, whatever the prefix cache holds."""
        return sum(self.seq_blocks(len(seq)) for seq in seqs)

    def admission_cost(self, seqs: list[Sequence], hits: list[Hits]) -> int:
        """Free blocks that admitting `seqs` with these prefix hits may consume; a hit
        before the window of the first token to compute is not taken."""
        num_blocks, taken = 0, []
        for seq, (seq_hits, _) in zip(seqs, hits, strict=True):
            num_hit_tokens = len(seq_hits) * self.block_size
            released = self._window_start_block(num_hit_tokens)
            num_blocks += min(_cdiv(len(seq), self.block_size) - released,
                              len(seq_hits) - released + self.seq_blocks(len(seq) - num_hit_tokens))
            taken += seq_hits[released:]
        refcounts = self.state.device.refcounts
        free_hits = {block for block in taken if refcounts[block] == 0}
        return num_blocks - len(taken) + len(free_hits)

    def check_fits(self, group: SequenceGroup) -> None:
        """Raise ValueError if the group's prompt needs more blocks than the pool holds
        beside the watermark."""
        self.check_prompt_fits(group, self.seq_blocks(group.seqs[0].num_prompt_tokens))

    def check_prompt_fits(self, group: SequenceGroup, num_blocks: int) -> None:
        """Raise ValueError if a prompt that needs `num_blocks` blocks cannot be admitted."""
        if num_blocks > self.num_device_blocks - self.watermark_blocks:
            raise ValueError(
                f"prompt of request {group.request_id!r} ({group.seqs[0].num_prompt_tokens} "
                "tokens) needs more KV blocks than the whole pool holds"
            )

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's WAITING sequences fit now, later, or never.

        Counts blocks for all of each sequence's tokens (prompt, plus outputs of
        a recomputed group; with a window those it holds at once), minus prefix
        hits, and keeps `watermark_blocks` free so running sequences can still grow.
        """
        seqs = group.seqs_with(SequenceStatus.WAITING)
        return self.admission_status(self.admission_blocks(seqs), lambda: self.admission_cost(
            seqs, self.prefix_hits(seqs, group)))

    def admission_status(self, num_blocks: int, cost) -> AllocStatus:
        """NEVER if `num_blocks` exceed the pool beside the watermark; else OK if
        `cost()` free blocks leave the watermark free, LATER if not."""
        if num_blocks > self.num_device_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_blocks - cost() >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Block tables for the group's WAITING sequences, each for all of its tokens.

        Prefix-cache hits become the leading blocks and set
        `seq.num_computed_tokens` (never covering the last token); the other
        sequences of a recomputed group get blocks of their own. With a sliding
        window a table starts with its hits alone (those before the window as
        released entries): `append_slots` adds blocks chunk by chunk, so a long
        prompt never holds blocks its window has left.
        """
        seqs = group.seqs_with(SequenceStatus.WAITING)
        self.check_unallocated(seqs)
        hits = self.prefix_hits(seqs, group)
        cost = self.admission_cost(seqs, hits)
        if cost > self.num_free_blocks:
            raise ValueError(
                f"group {group.request_id} needs {cost} free blocks, "
                f"only {self.num_free_blocks} are free"
            )
        self.take_hits(hits)
        self.allocate_tables(group, seqs, hits)

    def check_unallocated(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            record = self._seqs.get(seq.seq_id)
            if record is not None and record.table:
                raise ValueError(f"sequence {seq.seq_id} already has a block table")

    def take_hits(self, hits: list[Hits]) -> None:
        """Hold the hit blocks within the window. Every hit must be taken before any
        block is allocated: a free cached hit must not be handed out as another
        sequence's new block."""
        for seq_hits, _ in hits:
            released = self._window_start_block(len(seq_hits) * self.block_size)
            for block in seq_hits[released:]:
                self.state = allocator.take(self.state, block)

    def allocate_tables(self, group: SequenceGroup, seqs: list[Sequence], hits: list[Hits]
                        ) -> None:
        """The tables of `seqs`, from their hits (already taken) and new blocks."""
        for seq, (seq_hits, cache_ids) in zip(seqs, hits, strict=True):
            released = self._window_start_block(len(seq_hits) * self.block_size)
            num_new = (0 if self.sliding_window is not None
                       else _cdiv(len(seq), self.block_size) - len(seq_hits))
            new_blocks = self._allocate(num_new)
            record = self._record(seq, group.cache_salt)
            record.table = BlockTable([0] * released + seq_hits[released:]
                                      + new_blocks.tolist())
            record.cache_ids = cache_ids
            record.num_shared = len(seq_hits)
            record.num_released = released
            self._logical_blocks += len(record.table) - released
            seq.num_computed_tokens = len(seq_hits) * self.block_size
            if group.use_prefix_cache:
                self._count_query(seq, len(seq_hits))

    def _allocate(self, num_blocks: int) -> np.ndarray:
        """int32 [num_blocks] blocks from the free queue's head; their cache entries go."""
        self.state, blocks = allocator.allocate(self.state, num_blocks)
        self.prefix_cache.evict(blocks)
        return blocks

    def _count_query(self, seq: Sequence, num_hit_blocks: int) -> None:
        if not self.enable_prefix_caching:
            return
        stats = self.prefix_cache_stats
        stats.query_tokens += len(seq)
        stats.hit_tokens += num_hit_blocks * self.block_size
        stats.query_blocks += (len(seq) - 1) // self.block_size
        stats.hit_blocks += num_hit_blocks

    # Growth and sharing ----------------------------------------------------------

    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool:
        """Whether every RUNNING sequence of the group can take `num_new_tokens` more tokens."""
        return self.append_cost(group, num_new_tokens) <= self.num_free_blocks

    def append_cost(self, group: SequenceGroup, num_new_tokens: int) -> int:
        """Free blocks that `num_new_tokens` more tokens of the group's RUNNING sequences
        take: the blocks past each table's end plus the copy-on-write blocks (a shared
        block written by w of its r holders needs w copies, or w - 1 when they are all
        its holders: the last writer keeps it)."""
        needed = 0
        shared_writes: list[int] = []
        for seq in group.seqs:
            if seq.status is not _RUNNING:
                continue
            record = self._seqs[seq.seq_id]
            # The new tokens go to logical blocks first .. end - 1.
            start = seq.num_computed_tokens
            end = (start + num_new_tokens - 1) // self.block_size + 1
            num_blocks = len(record.table)
            if end > num_blocks:
                needed += end - num_blocks
            first, last = _copied_range(record, start // self.block_size, end)
            if first < last:
                shared_writes += record.table[first:last]
        if shared_writes:
            needed += self._num_copies(shared_writes)
        return needed

    def _num_copies(self, written_blocks: list[int]) -> int:
        """Copy-on-write blocks that one write per entry of `written_blocks` takes."""
        refcounts = self.state.device.refcounts
        num_copies = 0
        for block, num_writers in Counter(written_blocks).items():
            holders = refcounts[block]
            if holders > 1:
                num_copies += num_writers if holders > num_writers else num_writers - 1
        return num_copies

    def _release_out_of_window(self, record: _SeqBlocks, position: int) -> None:
        """Give back the table's blocks wholly before the window of a query at
        `position`, last first; their entries point at the null block."""
        num_released = min(self._window_start_block(position), len(record.table))
        if num_released <= record.num_released:
            return
        table = record.table
        blocks = table.array[record.num_released:num_released].copy()
        self.state = allocator.free(self.state, blocks[::-1])
        for i in range(record.num_released, num_released):
            table.replace(i, 0)
        self._logical_blocks -= len(blocks)
        record.num_released = num_released

    def has_decode_slot(self, seq: Sequence) -> bool:
        """Whether the slot of seq's next token exists and is private: no block work needed."""
        record = self._seqs[seq.seq_id]
        block = seq.num_computed_tokens // self.block_size
        return record.num_shared <= block < len(record.table)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Slots for positions num_computed_tokens .. + num_new_tokens - 1 of `seq`.

        Blocks in that range with other holders are replaced copy-on-write, so
        the step never writes into a shared block; new blocks extend the table.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        record = self._seqs[seq.seq_id]
        table = record.table
        start = seq.num_computed_tokens
        first = start // self.block_size
        end = (start + num_new_tokens - 1) // self.block_size + 1
        num_new_blocks = end - len(table)
        if first >= record.num_shared and num_new_blocks <= 0:
            return  # the common decode step: the slots exist and are private
        if record.on_host:
            raise ValueError(f"sequence {seq.seq_id} is swapped out: swap it in to append")
        refcounts = self.state.device.refcounts
        shared = [i for i in range(*_copied_range(record, first, end))
                  if refcounts[table.block(i)] > 1]
        num_new_blocks = max(0, num_new_blocks)
        if len(shared) + num_new_blocks > self.num_free_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} needs {len(shared) + num_new_blocks} free blocks, "
                f"only {self.num_free_blocks} are free"
            )
        for i in shared:
            written = i * self.block_size < seq.num_computed_tokens
            self.state, private = allocator.copy_on_write(self.state, table.block(i), written)
            self.prefix_cache.evict(np.array([private]))
            table.replace(i, private)
        table.extend(self._allocate(num_new_blocks).tolist())
        self._logical_blocks += num_new_blocks
        if record.owes_copies:
            record.owes_copies, record.num_shared = False, 0

    def adopt_device_blocks(self, pool: BlockPool, seqs: list[Sequence],
                            tables: np.ndarray) -> None:
        """Take what a decode loop allocated on the device: `pool`, the device pool as the
        loop left it (numpy arrays), and each of `seqs`' table row (tables int32 [B, M],
        row i for seqs[i]) with the blocks the loop appended after the host's entries.
        The loop's blocks came from the free queue's head: their cache entries go."""
        self.state = self.state._replace(device=pool)
        appended = []
        for seq, row in zip(seqs, tables, strict=False):
            table = self._seqs[seq.seq_id].table
            blocks = row[len(table):]
            blocks = blocks[: np.count_nonzero(blocks)]
            table.extend(blocks.tolist())
            self._logical_blocks += len(blocks)
            appended.append(blocks)
        if appended:
            self.prefix_cache.evict(np.concatenate(appended).astype(np.int64))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (refcount + 1 each).

        Without `share_blocks` the child owes a copy of every block it shares:
        its next `append_slots` copies them all, not only the ones it writes.
        The copies land in that step's ops, before the child's first write, as
        an eager copy at the fork would; going through the scheduler's
        `can_append_slots` lets a pool too full for them preempt instead of fail.
        """
        if child.seq_id in self._seqs:
            raise ValueError(f"child sequence {child.seq_id} already has a block table")
        source = self._seqs[parent.seq_id]
        table = self.block_table(parent)
        self.state = allocator.share(self.state, table.array[source.num_released:])
        source.num_shared = len(table)
        self._seqs[child.seq_id] = _SeqBlocks(
            source.cache_salt,
            table.copy(),
            list(source.block_hashes),
            list(source.block_tokens),
            list(source.cache_ids),
            num_shared=len(table),
            owes_copies=not self.share_blocks,
            num_released=source.num_released,
        )
        self._logical_blocks += len(table) - source.num_released

    def free(self, seq: Sequence) -> None:
        """Forget `seq`: drop its table (device or host) and its memoised hashes.

        A no-op for a sequence the manager does not know. Blocks are freed last
        first, so a request's tail is evicted before its more shareable prefix.
        """
        record = self._seqs.pop(seq.seq_id, None)
        if record is None:
            return
        if record.on_host:
            self.state = allocator.free_host(self.state, record.table.array[::-1])
            return
        held = record.table.array[record.num_released:]
        self.state = allocator.free(self.state, held[::-1])
        self._logical_blocks -= len(held)

    def mark_computed(self, seq: Sequence) -> None:
        """seq's tokens up to its num_computed_tokens now hold K/V: register its full
        blocks in the prefix cache, and give back the blocks that no later token's
        window reads."""
        record = self._seqs[seq.seq_id]
        if record.on_host:
            raise ValueError(f"sequence {seq.seq_id} is swapped out: its blocks hold no K/V")
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, record)
        if self.sliding_window is not None:
            self._release_out_of_window(record, seq.num_computed_tokens)

    def cache_ids(self, seq: Sequence) -> list[int]:
        """The cache ids of seq's leading blocks' entries (0 where it holds none)."""
        return self._seqs[seq.seq_id].cache_ids

    def _cache_full_blocks(self, seq: Sequence, record: _SeqBlocks) -> None:
        """Register seq's blocks that are now full and computed in the prefix cache.

        A block whose hash another block already holds stays private: the
        first copy serves later hits. If that block holds other tokens (a hash
        collision), no hit could get past it, so registration stops there and
        tries again next time (the other block may have been evicted by then).
        A block released from the window before it was registered ends a chain of
        its own; an anchored group's entries hang on the anchor's chain instead, so it
        goes on past its released blocks.
        """
        num_full = seq.num_computed_tokens // self.block_size
        cache_ids = record.cache_ids
        if num_full <= len(cache_ids):
            return
        num_full = min(num_full, len(record.table))
        self._memoise_blocks(seq, record, num_full)
        parents = cache_ids if self.anchor is None else self.anchor.cache_ids(seq)
        for i in range(len(cache_ids), num_full):
            if i < record.num_released:
                if self.anchor is None:
                    return
                cache_ids.append(0)  # never held here: no entry, and none needed
                continue
            if i and (len(parents) < i or parents[i - 1] == 0):
                return  # the anchor has not registered block i - 1
            parent = parents[i - 1] if i else self._root_parent
            cache_id = self.prefix_cache.register(
                record.table.block(i), record.block_hashes[i],
                parent, record.cache_salt, record.block_tokens[i],
            )
            if cache_id is None:
                return
            cache_ids.append(cache_id)

    # Swapping ----------------------------------------------------------------------

    def _tables(self, seqs: list[Sequence], on_host: bool) -> list[list[int]]:
        """The blocks the tables of `seqs` hold, which must all be on the host (or all on
        the device): a device table's released entries are not blocks, and a host table
        has none."""
        records = [self._seqs[seq.seq_id] for seq in seqs]
        for seq, record in zip(seqs, records, strict=True):
            if record.on_host != on_host:
                where = "on the device" if on_host else "swapped out"
                raise ValueError(f"sequence {seq.seq_id} is {where} already")
        return [record.table.tolist()[0 if on_host else record.num_released:]
                for record in records]

    def _distinct_blocks(self, seqs: list[Sequence], on_host: bool) -> set[int]:
        return {block for table in self._tables(seqs, on_host) for block in table}

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the group's RUNNING sequences can move to host now.

        Their distinct blocks must fit the host pool, and none may be written
        by this step's swap-in or copies (the device swaps out before those).
        """
        num_blocks = self.swap_out_blocks(group)
        return num_blocks is not None and num_blocks <= self.num_free_host_blocks

    def swap_out_blocks(self, group: SequenceGroup) -> int | None:
        """Host blocks that swapping the group's RUNNING sequences out takes; None if
        this step writes one of their blocks."""
        blocks = self._distinct_blocks(group.seqs_with(SequenceStatus.RUNNING), on_host=False)
        written = self.state.ops.written
        if any(written[block] for block in blocks):
            return None
        return len(blocks)

    def swap_out(self, group: SequenceGroup) -> None:
        """Move the RUNNING sequences' tables to host blocks (shared blocks move once)."""
        seqs = group.seqs_with(SequenceStatus.RUNNING)
        self.state, host_tables = allocator.swap_out(self.state, self._tables(seqs, False))
        for seq, host_table in zip(seqs, host_tables, strict=True):
            record = self._seqs[seq.seq_id]
            self._logical_blocks -= len(host_table)
            record.table, record.on_host = BlockTable(host_table), True

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the SWAPPED sequences' distinct blocks fit on the device, with the watermark."""
        required = self.swap_in_blocks(group)
        return self.admission_status(required, lambda: required)

    def swap_in_blocks(self, group: SequenceGroup) -> int:
        """Device blocks that swapping the group's SWAPPED sequences in takes."""
        return len(self._distinct_blocks(group.seqs_with(SequenceStatus.SWAPPED), True))

    def swap_in(self, group: SequenceGroup) -> None:
        """Move the SWAPPED sequences' tables back to fresh device blocks.

        The fresh blocks carry no prefix hash; the next `mark_computed`
        registers them again where no other block holds their hash.
        """
        seqs = group.seqs_with(SequenceStatus.SWAPPED)
        self.state, tables = allocator.swap_in(self.state, self._tables(seqs, True))
        for seq, table in zip(seqs, tables, strict=True):
            self.prefix_cache.evict(np.asarray(table, np.int64))
            record = self._seqs[seq.seq_id]
            released = record.num_released
            record.table = BlockTable([0] * released + list(table))
            record.on_host, record.cache_ids = False, []
            record.num_shared = len(record.table)
            self._logical_blocks += len(table)
