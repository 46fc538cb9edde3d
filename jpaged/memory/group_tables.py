"""Group tables: the block tables of one KV cache group, for layers with full attention.

A sequence's table maps logical block i (positions i*block_size ..
(i+1)*block_size - 1) to a physical block of the device pool, or of the host
pool while the sequence is swapped out. Sequences of a request share blocks
after a fork (and copy them at their next write, with `share_blocks` off);
requests share full blocks through the prefix cache.

What the tables remember of a sequence (its table, its hash chain) lives here,
keyed by seq_id, until `free(seq)`; that includes a WAITING sequence whose
prompt a prefix lookup has already hashed.

The coordinator (jpaged.memory.block_manager.BlockManager) runs one group-table
object per KV cache group, all over one pool (`SharedPool`: the allocator's
state and the prefix cache). A sliding window's group has the subclass of
jpaged.memory.sliding_window_tables, which gives blocks back as the window
moves; everything else about a table is here.

A prefix hit needs a cached block whose key (parent entry, salt, tokens) equals
the sequence's, block after block from the first: the hash only finds the
candidate, so a collision is a miss and the chain of hits stops there. Blocks
the allocator hands out lose their cache entries (`PrefixCache.evict`). With a
host tier (jpaged.memory.host_tier), each block a table registers is also
written through to host memory, and a block the device cache misses may hit
there: the hit holds a `TierBlock`, which admission loads into a fresh device
block before the tables take it. Group
g's entries are keyed apart from other groups': its hash chain starts at hash g
and its first block's parent id is -g. Group 0's chain of cache ids vouches for
a prefix, so it keys every group's entries: block i's parent is group 0's entry
of block i - 1 (group 0's own, for group 0).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from jpaged.config import CacheConfig
from jpaged.memory import allocator
from jpaged.memory.allocator import AllocatorState
from jpaged.memory.block_table import BlockTable
from jpaged.memory.host_tier import HostTier
from jpaged.memory.prefix_cache import PrefixCache, hash_block, pack_tokens
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

_RUNNING = SequenceStatus.RUNNING  # an enum attribute lookup costs as much as the check


class TierBlock(NamedTuple):
    """A prefix hit in the host tier: the host block holding the copy to load."""

    host_block: int


Hits = tuple[list["int | TierBlock"], list[int]]
"""A sequence's prefix-cache hit: the cached blocks of its prefix (device blocks, or
host-tier copies until admission loads them) and their cache ids."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class SharedPool:
    """The allocator state, prefix cache and host tier of the pool all KV cache groups
    draw from."""

    state: AllocatorState
    prefix_cache: PrefixCache
    tier: HostTier

    @classmethod
    def create(cls, cache_config: CacheConfig) -> SharedPool:
        return cls(allocator.create(cache_config.num_blocks, cache_config.num_host_blocks),
                   PrefixCache(cache_config.num_blocks), HostTier(cache_config.num_host_blocks))

    def find(self, block_hash: int, parent: int, cache_salt: str | None, tokens: bytes
             ) -> tuple[int | TierBlock, int] | None:
        """The block holding this content key, on the device or else in the host tier,
        and its cache id; None if neither holds it."""
        entry = self.prefix_cache.lookup(block_hash, parent, cache_salt, tokens)
        if entry is not None:
            return entry[0], entry[1]
        entry = self.tier.lookup(block_hash, parent, cache_salt, tokens)
        if entry is not None:
            return TierBlock(entry[0]), entry[1]
        return None


@dataclass
class SeqBlocks:
    """What one group's tables know of one sequence.

    table:        physical blocks, logical order (host blocks while on_host).
    block_hashes: hash chain of the sequence's leading full blocks, computed once.
    block_tokens: `pack_tokens` of those blocks' token ids, as content keys hold them.
    cache_ids:    cache ids of the entries holding the K/V of the leading table
                  entries (theirs, or equal blocks cached first; 0 for a released
                  entry that never had one); a fork's child inherits them. They stop
                  before a block whose hash holds other content (a collision).
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


def _copied_range(record: SeqBlocks, first: int, end: int) -> tuple[int, int]:
    """Table entries [start, stop) that a write into entries first .. end - 1 must copy
    where shared: the written ones, or every shared one for a sequence owing copies."""
    if record.owes_copies:
        return 0, record.num_shared
    return first, min(end, record.num_shared)


class FullAttentionTables:
    """The block tables of one KV cache group whose layers read every earlier key.

    cache_config: the pool's config, with this group's window as `sliding_window`.
    pool: the state every group shares. group: this group's index, which keys its
    prefix-cache entries apart from other groups'.
    """

    def __init__(self, cache_config: CacheConfig, pool: SharedPool, group: int):
        self.config = cache_config
        self.block_size = cache_config.block_size
        self.pool = pool
        self._root_hash, self._root_parent = group, -group
        self._seqs: dict[int, SeqBlocks] = {}
        self.num_logical_blocks = 0  # device table entries, released ones excepted

    @property
    def state(self) -> AllocatorState:
        return self.pool.state

    @state.setter
    def state(self, state: AllocatorState) -> None:
        self.pool.state = state

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.pool.prefix_cache

    @classmethod
    def max_blocks(cls, cache_config: CacheConfig, num_tokens: int) -> int:
        """The most blocks of a group's table that a sequence of `num_tokens` holds at
        once: one per block of its tokens."""
        return cdiv(num_tokens, cache_config.block_size)

    def window_start_block(self, position: int) -> int:
        """Leading table entries that a query at `position`, and every later one, no
        longer reads: none."""
        return 0

    # Tables ------------------------------------------------------------------------

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

    def cache_ids(self, seq: Sequence) -> list[int]:
        """The cache ids of seq's leading blocks' entries (0 where it holds none)."""
        return self._seqs[seq.seq_id].cache_ids

    def seqs_on_device(self) -> list[int]:
        """The seq_ids of the sequences whose tables hold device blocks."""
        return [seq_id for seq_id, record in self._seqs.items()
                if len(record.table) and not record.on_host]

    def table_problems(self, running: list[Sequence]) -> list[str]:
        """Where the running sequences' tables break the null-block and window rules, or
        their length disagrees with the logical block count (see
        BlockManager.check_invariants)."""
        problems = []
        device = [self.block_table(seq).array for seq in running]
        for seq, table in zip(running, device, strict=True):
            released = self._seqs[seq.seq_id].num_released
            if (table[:released] != 0).any() or (table[released:] == 0).any():
                problems.append(f"sequence {seq.seq_id}: the null block outside its "
                                f"{released} released entries")
            out_of_window = min(self.window_start_block(seq.num_computed_tokens), len(table))
            if released != out_of_window:
                problems.append(f"sequence {seq.seq_id}: {released} entries released, "
                                f"{out_of_window} out of its window")
        logical = sum(len(table) for table in device) - sum(
            self._seqs[seq.seq_id].num_released for seq in running)
        if self.num_logical_blocks != logical:
            problems.append(f"logical blocks {self.num_logical_blocks}, tables hold {logical}")
        return problems

    # Admission -----------------------------------------------------------------

    def _record(self, seq: Sequence, cache_salt: str | None) -> SeqBlocks:
        record = self._seqs.get(seq.seq_id)
        if record is None:
            record = self._seqs[seq.seq_id] = SeqBlocks(cache_salt)
        return record

    def _memoise_blocks(self, seq: Sequence, record: SeqBlocks, num_blocks: int) -> None:
        """Extend the memoised hash chain and block tokens to at least `num_blocks` blocks."""
        hashes, size = record.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else self._root_hash
            tokens = pack_tokens(seq.token_slice(i * size, (i + 1) * size))
            hashes.append(hash_block(parent, tokens, record.cache_salt))
            record.block_tokens.append(tokens)

    def prefix_hit(self, seq: Sequence, group: SequenceGroup, num_blocks: int | None = None
                   ) -> Hits:
        """The cached blocks holding seq's longest cached prefix of at most `num_blocks`
        blocks (None: never its last token) on this group's own chain of cache ids, left
        to right (none for a request that must compute every token), and their cache
        ids: group 0's hit."""
        if not self.config.enable_prefix_caching or not group.use_prefix_cache:
            return [], []
        record = self._record(seq, group.cache_salt)
        num_eligible = (len(seq) - 1) // self.block_size if num_blocks is None else num_blocks
        self._memoise_blocks(seq, record, num_eligible)
        blocks: list[int | TierBlock] = []
        cache_ids: list[int] = []
        find, parent, salt = self.pool.find, self._root_parent, record.cache_salt
        chain = zip(record.block_hashes[:num_eligible], record.block_tokens, strict=False)
        for block_hash, tokens in chain:
            found = find(block_hash, parent, salt, tokens)
            if found is None:
                break
            blocks.append(found[0])
            parent = found[1]  # this entry's cache id, the next block's parent
            cache_ids.append(parent)
        return blocks, cache_ids

    def hit_on_chain(self, seq: Sequence, group: SequenceGroup, chain_ids: list[int],
                     num_blocks: int) -> Hits:
        """The longest hit of at most `num_blocks` blocks whose blocks this group holds in
        the cache, keyed by group 0's cache ids `chain_ids` (its hit's): every block,
        left to right."""
        record = self._record(seq, group.cache_salt)
        self._memoise_blocks(seq, record, num_blocks)
        blocks: list[int | TierBlock] = []
        cache_ids: list[int] = []
        for i in range(num_blocks):
            found = self._find(record, i, chain_ids)
            if found is None:
                break
            blocks.append(found[0])
            cache_ids.append(found[1])
        return blocks, cache_ids

    def _find(self, record: SeqBlocks, i: int, chain_ids: list[int]
              ) -> tuple[int | TierBlock, int] | None:
        """The block holding block i of the record's sequence, keyed by group 0's chain,
        and its cache id (SharedPool.find)."""
        return self.pool.find(record.block_hashes[i], self._parent(i, chain_ids),
                              record.cache_salt, record.block_tokens[i])

    def _parent(self, i: int, chain_ids: list[int]) -> int:
        """The parent of block i's entry: group 0's entry of block i - 1."""
        return chain_ids[i - 1] if i else self._root_parent

    def admission_cost(self, seqs: list[Sequence], hits: list[Hits]) -> int:
        """Free blocks that admitting `seqs` with these prefix hits may consume; a hit
        before the window of the first token to compute is not taken, and a hit in the
        host tier takes a free block to load into."""
        num_blocks, taken = 0, []
        for seq, (seq_hits, _) in zip(seqs, hits, strict=True):
            num_hit_tokens = len(seq_hits) * self.block_size
            released = self.window_start_block(num_hit_tokens)
            num_blocks += min(
                cdiv(len(seq), self.block_size) - released,
                len(seq_hits) - released + self.max_blocks(self.config,
                                                           len(seq) - num_hit_tokens))
            taken += seq_hits[released:]
        refcounts = self.state.device.refcounts
        free_hits = {block for block in taken
                     if isinstance(block, TierBlock) or refcounts[block] == 0}
        return num_blocks - len(taken) + len(free_hits)

    def check_unallocated(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            record = self._seqs.get(seq.seq_id)
            if record is not None and record.table:
                raise ValueError(f"sequence {seq.seq_id} already has a block table")

    def held_hits(self, hit_blocks: list[int]) -> list[int]:
        """The blocks of a prefix hit that a sequence holds: those in the window of the
        hit's end (every one without a window)."""
        return hit_blocks[self.window_start_block(len(hit_blocks) * self.block_size):]

    def take_hits(self, hits: list[Hits]) -> None:
        """Hold the hit blocks within the window. Every group's hits must be taken before
        any block is allocated: a free cached hit must not be handed out as another
        sequence's new block."""
        for seq_hits, _ in hits:
            for block in self.held_hits(seq_hits):
                if not isinstance(block, TierBlock):
                    self.state = allocator.take(self.state, block)

    def load_tier_hits(self, seqs: list[Sequence], hits: list[Hits],
                       chain_ids: list[list[int]]) -> None:
        """Load the host-tier hits within the window into fresh device blocks, each
        copy once (a later hit on it shares the block), registered under their
        entries' keys; `hits` then hold the device blocks. chain_ids: group 0's cache
        ids of each sequence's hit. Every group's device hits must be taken first: a
        load takes a block from the free queue's head.
        """
        loaded: dict[int, int] = {}
        for seq, (seq_hits, cache_ids), chain in zip(seqs, hits, chain_ids, strict=True):
            released = self.window_start_block(len(seq_hits) * self.block_size)
            for i in range(released, len(seq_hits)):
                hit = seq_hits[i]
                if not isinstance(hit, TierBlock):
                    continue
                if hit.host_block in loaded:
                    seq_hits[i] = loaded[hit.host_block]
                    self.state = allocator.take(self.state, seq_hits[i])
                    continue
                seq_hits[i] = loaded[hit.host_block] = self._load(
                    self._seqs[seq.seq_id], i, hit, chain, cache_ids[i])

    def _load(self, record: SeqBlocks, i: int, hit: TierBlock, chain_ids: list[int],
              cache_id: int) -> int:
        """Load the tier's copy of block i of the record's sequence into a fresh device
        block, registered in the device cache under its entry's cache id."""
        self.state, block = self.pool.tier.load(self.state, hit.host_block)
        self.prefix_cache.evict(np.array([block]))
        self.prefix_cache.register(block, record.block_hashes[i], self._parent(i, chain_ids),
                                   record.cache_salt, record.block_tokens[i], cache_id)
        return block

    def new_blocks_at_admission(self, seq: Sequence, num_hit_blocks: int) -> int:
        """Blocks a new table takes beyond its hits: every other block of its tokens."""
        return cdiv(len(seq), self.block_size) - num_hit_blocks

    def allocate_tables(self, group: SequenceGroup, seqs: list[Sequence], hits: list[Hits]
                        ) -> None:
        """The tables of `seqs`, from their hits (already taken) and new blocks; the hits
        before the window are released entries."""
        for seq, (seq_hits, cache_ids) in zip(seqs, hits, strict=True):
            released = self.window_start_block(len(seq_hits) * self.block_size)
            new_blocks = self._allocate(self.new_blocks_at_admission(seq, len(seq_hits)))
            record = self._record(seq, group.cache_salt)
            record.table = BlockTable([0] * released + seq_hits[released:]
                                      + new_blocks.tolist())
            record.cache_ids = cache_ids
            record.num_shared = len(seq_hits)
            record.num_released = released
            self.num_logical_blocks += len(record.table) - released

    def _allocate(self, num_blocks: int) -> np.ndarray:
        """int32 [num_blocks] blocks from the free queue's head; their cache entries go."""
        self.state, blocks = allocator.allocate(self.state, num_blocks)
        self.prefix_cache.evict(blocks)
        return blocks

    # Growth and sharing ----------------------------------------------------------

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
        num_free = int(self.state.device.num_free)
        if len(shared) + num_new_blocks > num_free:
            raise ValueError(
                f"sequence {seq.seq_id} needs {len(shared) + num_new_blocks} free blocks, "
                f"only {num_free} are free"
            )
        for i in shared:
            written = i * self.block_size < seq.num_computed_tokens
            self.state, private = allocator.copy_on_write(self.state, table.block(i), written)
            self.prefix_cache.evict(np.array([private]))
            table.replace(i, private)
        table.extend(self._allocate(num_new_blocks).tolist())
        self.num_logical_blocks += num_new_blocks
        if record.owes_copies:
            record.owes_copies, record.num_shared = False, 0

    def adopt_device_blocks(self, seqs: list[Sequence], tables: np.ndarray) -> None:
        """Extend the tables of `seqs` by the blocks a decode loop appended on the device
        after the host's entries (tables int32 [B, M], row i for seqs[i]; the pool's
        state is already the loop's). The loop's blocks came from the free queue's
        head: their cache entries go."""
        appended = []
        for seq, row in zip(seqs, tables, strict=False):
            table = self._seqs[seq.seq_id].table
            blocks = row[len(table):]
            blocks = blocks[: np.count_nonzero(blocks)]
            table.extend(blocks.tolist())
            self.num_logical_blocks += len(blocks)
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
        self._seqs[child.seq_id] = SeqBlocks(
            source.cache_salt,
            table.copy(),
            list(source.block_hashes),
            list(source.block_tokens),
            list(source.cache_ids),
            num_shared=len(table),
            owes_copies=not self.config.share_blocks,
            num_released=source.num_released,
        )
        self.num_logical_blocks += len(table) - source.num_released

    def free(self, seq: Sequence) -> None:
        """Forget `seq`: drop its table (device or host) and its memoised hashes.

        A no-op for a sequence the tables do not know. Blocks are freed last
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
        self.num_logical_blocks -= len(held)

    def mark_computed(self, seq: Sequence, chain_ids: list[int] | None = None) -> None:
        """seq's tokens up to its num_computed_tokens now hold K/V: register its full
        blocks in the prefix cache under group 0's cache ids `chain_ids` (None: these
        tables are group 0's)."""
        record = self._seqs[seq.seq_id]
        if record.on_host:
            raise ValueError(f"sequence {seq.seq_id} is swapped out: its blocks hold no K/V")
        if self.config.enable_prefix_caching:
            self._cache_full_blocks(seq, record,
                                    record.cache_ids if chain_ids is None else chain_ids)

    def _cache_full_blocks(self, seq: Sequence, record: SeqBlocks, chain_ids: list[int]
                           ) -> None:
        """Register seq's blocks that are now full and computed in the prefix cache.

        A block whose hash another block already holds stays private: the
        first copy serves later hits. If that block holds other tokens (a hash
        collision), no hit could get past it, so registration stops there and
        tries again next time (the other block may have been evicted by then).
        A block released from the window before it was registered gets no entry
        (cache id 0): group 0's chain, which keys every group's entries, ends there,
        so group 0 registers nothing past it while another group goes on as far as
        group 0 has registered.
        """
        num_full = seq.num_computed_tokens // self.block_size
        cache_ids = record.cache_ids
        if num_full <= len(cache_ids):
            return
        num_full = min(num_full, len(record.table))
        self._memoise_blocks(seq, record, num_full)
        for i in range(len(cache_ids), num_full):
            if i < record.num_released:
                cache_ids.append(0)  # never held here: no entry, and none needed
                continue
            if i and (len(chain_ids) < i or chain_ids[i - 1] == 0):
                return  # group 0 has not registered block i - 1
            parent = self._parent(i, chain_ids)
            block, key = record.table.block(i), (parent, record.cache_salt,
                                                 record.block_tokens[i])
            cache_id = self.prefix_cache.register(block, record.block_hashes[i], *key)
            if cache_id is None:
                return
            cache_ids.append(cache_id)
            self.state = self.pool.tier.store(self.state, block, record.block_hashes[i],
                                              cache_id, *key)

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

    def swap_out_blocks(self, group: SequenceGroup) -> int | None:
        """Host blocks that swapping the group's RUNNING sequences out takes; None if
        this step writes one of their blocks (the device swaps out before the step's
        swap-ins and copies)."""
        blocks = self._distinct_blocks(group.seqs_with(SequenceStatus.RUNNING), on_host=False)
        written = self.state.ops.written
        if any(written[block] for block in blocks):
            return None
        return len(blocks)

    def swap_out(self, group: SequenceGroup) -> None:
        """Move the RUNNING sequences' tables to host blocks (shared blocks move once)."""
        seqs = group.seqs_with(SequenceStatus.RUNNING)
        self.state, host_tables = allocator.swap_out(self.state, self._tables(seqs, False))
        self.pool.tier.evict(np.fromiter({b for table in host_tables for b in table}, np.int64))
        for seq, host_table in zip(seqs, host_tables, strict=True):
            record = self._seqs[seq.seq_id]
            self.num_logical_blocks -= len(host_table)
            record.table, record.on_host = BlockTable(host_table), True

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
            self.num_logical_blocks += len(table)
