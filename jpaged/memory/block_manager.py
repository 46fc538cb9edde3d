"""BlockManager: the paged KV cache manager, coordinating the block tables of one KV cache
group or of several over one pool.

The scheduler asks it whether a request fits, then allocates, appends, forks, swaps
and frees; each call runs the allocator's transitions (jpaged.memory.allocator) on
one state of arrays, and `end_step()` commits the step and returns its device ops.

Each KV cache group (jpaged.memory.kv_cache_groups) has group tables of its layers'
attention type: full attention (jpaged.memory.group_tables) or a sliding window
(jpaged.memory.sliding_window_tables), with a table per sequence, all drawing blocks
from one allocator state and one prefix cache. A model whose layers attend alike is
one group; a model with global and sliding-window layers (Gemma 2 and 3) has several,
and a long sequence holds every block only in the global ones.

The scheduler sees one manager: a sequence fits when the blocks of all its groups fit,
and every call runs in every group, group 0 first. A prefix hit is one length for all
groups: group 0's left-to-right hit on its own chain of cache ids, cut to what every
other group holds of it (a sliding group needs only the blocks in the window of the
hit's end). Group 0's cache ids key every group's prefix-cache entries, so the manager
hands them to the other groups when they look up and register blocks.

The host pool is swap space and the prefix cache's host tier (jpaged.memory.host_tier):
every block a group registers is copied to a free host block, and a hit may continue
past the device cache into the tier, whose copies admission loads into fresh device
blocks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from jpaged.config import CacheConfig
from jpaged.memory import allocator
from jpaged.memory.allocator import AllocatorState, BlockOps, BlockPool
from jpaged.memory.block_table import BlockTable
from jpaged.memory.group_tables import FullAttentionTables, Hits, SharedPool, TierBlock
from jpaged.memory.host_tier import HostPoolCounts, HostTier
from jpaged.memory.invariants import holder_problems
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.prefix_cache import PrefixCache, PrefixCacheStats
from jpaged.memory.sliding_window_tables import tables_type
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


class BlockManager:
    """Block tables, prefix cache and swap space of a KV cache of `cache_config.num_blocks`
    blocks, for the KV cache groups `groups` (None: one group whose window is
    `cache_config.sliding_window`; given groups, each has its own window instead)."""

    def __init__(self, cache_config: CacheConfig, groups: KVCacheGroups | None = None):
        windows = (cache_config.sliding_window,) if groups is None else groups.windows
        self.block_size = cache_config.block_size
        self.num_device_blocks = cache_config.num_blocks - 1
        self.num_host_blocks = cache_config.num_host_blocks
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.watermark_blocks = int(cache_config.watermark * self.num_device_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self.pool = SharedPool.create(cache_config)
        group_configs = [replace(cache_config, sliding_window=window) for window in windows]
        self.group_tables: list[FullAttentionTables] = [
            tables_type(config)(config, self.pool, g) for g, config in enumerate(group_configs)]
        if len(self.group_tables) == 1:
            self._call_one_group_directly(self.group_tables[0])

    def _call_one_group_directly(self, tables: FullAttentionTables) -> None:
        """With one group (most models) a step's calls per sequence go straight to its
        tables: looping over one group costs a quarter of a host step at 256 sequences."""
        self.has_decode_slot = tables.has_decode_slot
        self.free = tables.free
        self.block_tables = lambda seq: (tables.block_table(seq),)
        self.mark_computed = tables.mark_computed  # group 0's chain: its own

    @property
    def num_groups(self) -> int:
        return len(self.group_tables)

    @property
    def adopts_device_blocks(self) -> bool:
        """Whether a decode loop may allocate on the device and hand its blocks over
        (`adopt_device_blocks`): one group, whose tables the loop grows (a window's
        blocks it left are given back once the host takes the loop's tokens)."""
        return self.num_groups == 1

    @property
    def state(self) -> AllocatorState:
        return self.pool.state

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.pool.prefix_cache

    @property
    def tier(self) -> HostTier:
        return self.pool.tier

    @property
    def num_free_blocks(self) -> int:
        """Free device blocks, cached ones included (allocation evicts them)."""
        return int(self.state.device.num_free)

    @property
    def num_free_host_blocks(self) -> int:
        return int(self.state.host.num_free)

    def host_pool_counts(self, block_bytes: int) -> HostPoolCounts:
        """The host pool's blocks and the tier's traffic; block_bytes: one host block's."""
        host = self.state.host
        return HostPoolCounts(
            self.num_host_blocks, int(np.count_nonzero(host.refcounts)),
            self.tier.num_cached_blocks, block_bytes, self.tier.stats.stored_blocks,
            self.tier.stats.loaded_blocks)

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
        """Sum of device block-table lengths in every group: what the tables would hold
        without sharing."""
        return sum(self.group_blocks_used)

    @property
    def group_blocks_used(self) -> tuple[int, ...]:
        """Each group's logical blocks: the entries its device tables hold."""
        return tuple(tables.num_logical_blocks for tables in self.group_tables)

    def block_tables(self, seq: Sequence) -> tuple[BlockTable, ...]:
        """The device block table of `seq` in each group."""
        return tuple(tables.block_table(seq) for tables in self.group_tables)

    def block_table(self, seq: Sequence) -> BlockTable:
        """The device block table of `seq` in group 0, the only one of a single group
        (read-only to callers)."""
        return self.group_tables[0].block_table(seq)

    def host_block_tables(self, seq: Sequence) -> tuple[BlockTable, ...]:
        """The host block table of a swapped-out `seq` in each group."""
        return tuple(tables.host_block_table(seq) for tables in self.group_tables)

    def host_block_table(self, seq: Sequence) -> BlockTable:
        """The host block table of a swapped-out `seq` in group 0."""
        return self.group_tables[0].host_block_table(seq)

    def cache_ids(self, seq: Sequence) -> list[int]:
        """The cache ids of seq's leading blocks' entries in group 0, whose chain keys
        every group's entries (0 where it holds none)."""
        return self.group_tables[0].cache_ids(seq)

    def end_step(self) -> BlockOps:
        """Commit this step; the device applies the returned ops."""
        self.pool.state, ops = allocator.commit(self.state)
        return ops

    def reset_prefix_cache(self) -> None:
        """Forget every cached device block: the device KV they held is gone (the engine
        reallocated its cache). Every device block must be free; swapped sequences keep
        their host blocks and the host tier its copies, but those the pending device ops
        were to store, which are dropped."""
        for tables in self.group_tables:
            on_device = tables.seqs_on_device()
            if on_device:
                raise RuntimeError(
                    f"the prefix cache can only be reset with every device block free; "
                    f"sequences {on_device[:5]} hold device blocks")
        committed, pending = allocator.commit(self.state)
        self.tier.forget_stores(pending)
        num_blocks = self.num_device_blocks + 1
        self.pool.state = allocator.create(num_blocks, 0)._replace(host=committed.host,
                                                                   ops=committed.ops)
        self.pool.prefix_cache = PrefixCache(num_blocks, self.prefix_cache.next_cache_id)

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        """Check the blocks against the live sequences; RuntimeError on a violation.

        Every device and host block's reference count equals the number of the
        running (device) and swapped (host) sequences' tables holding it, in every
        group together (a block belongs to one group's table at a time), so a block
        is free exactly when none does; the free counts agree; the null block is in
        no table but as its released leading entries, which are all the entries
        before the window of the sequence's next token; each group's logical block
        count is its tables' total, released entries excepted.
        """
        device = [table.array for seq in running for table in self.block_tables(seq)]
        host = [table.array for seq in swapped for table in self.host_block_tables(seq)]
        problems = holder_problems("device", self.state.device, device, first=1)
        problems += holder_problems("host", self.state.host, host, first=0)
        problems += self.tier.problems(self.state)
        for g, tables in enumerate(self.group_tables):
            where = f"group {g}: " if self.num_groups > 1 else ""
            problems += [where + problem for problem in tables.table_problems(running)]
        if problems:
            raise RuntimeError("KV block invariants violated: " + "; ".join(problems[:5]))

    # Admission -----------------------------------------------------------------

    def prefix_hits(self, seqs: list[Sequence], group: SequenceGroup) -> list[list[Hits]]:
        """Each group's prefix-cache hit of each of `seqs` (indexed [group][seq]): one
        length in all groups, the longest that every group holds, never covering a
        sequence's last token (none for a request that must compute every token)."""
        per_seq = [self._seq_hits(seq, group) for seq in seqs]
        return [list(hits) for hits in zip(*per_seq, strict=True)]

    def _seq_hits(self, seq: Sequence, group: SequenceGroup) -> list[Hits]:
        blocks, chain_ids = self.group_tables[0].prefix_hit(seq, group)
        num_blocks = len(chain_ids)
        while True:  # cut to the shortest until every group holds the same length
            others = [tables.hit_on_chain(seq, group, chain_ids, num_blocks)
                      for tables in self.group_tables[1:]]
            shortest = min((len(hits[0]) for hits in others), default=num_blocks)
            if shortest == num_blocks:
                break
            num_blocks = shortest
        return [(blocks[:num_blocks], chain_ids[:num_blocks]), *others]

    def seq_blocks(self, num_tokens: int) -> int:
        """The most blocks, over all groups, that a sequence of `num_tokens` holds at once."""
        return sum(tables.max_blocks(tables.config, num_tokens) for tables in self.group_tables)

    def check_fits(self, group: SequenceGroup) -> None:
        """Raise ValueError if the group's prompt needs more blocks than the pool holds
        beside the watermark."""
        num_tokens = group.seqs[0].num_prompt_tokens
        if self.seq_blocks(num_tokens) > self.num_device_blocks - self.watermark_blocks:
            raise ValueError(
                f"prompt of request {group.request_id!r} ({num_tokens} "
                "tokens) needs more KV blocks than the whole pool holds"
            )

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the group's WAITING sequences fit now, later, or never.

        Counts blocks for all of each sequence's tokens (prompt, plus outputs of
        a recomputed group; with a window those it holds at once) in every group,
        minus prefix hits, and keeps `watermark_blocks` free so running sequences
        can still grow.
        """
        seqs = group.seqs_with(SequenceStatus.WAITING)
        num_blocks = sum(self.seq_blocks(len(seq)) for seq in seqs)
        return self._admission_status(
            num_blocks, lambda: self._admission_cost(seqs, self.prefix_hits(seqs, group)))

    def _admission_status(self, num_blocks: int, cost) -> AllocStatus:
        """NEVER if `num_blocks` exceed the pool beside the watermark; else OK if
        `cost()` free blocks leave the watermark free, LATER if not."""
        if num_blocks > self.num_device_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_blocks - cost() >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def _admission_cost(self, seqs: list[Sequence], hits: list[list[Hits]]) -> int:
        return sum(tables.admission_cost(seqs, group_hits)
                   for tables, group_hits in zip(self.group_tables, hits, strict=True))

    def allocate(self, group: SequenceGroup) -> None:
        """Block tables in every group for the group's WAITING sequences.

        Prefix-cache hits become the leading blocks and set
        `seq.num_computed_tokens` (never covering the last token); the other
        sequences of a recomputed group get blocks of their own. Every group's hits
        are taken before any group allocates a block.
        """
        seqs = group.seqs_with(SequenceStatus.WAITING)
        for tables in self.group_tables:
            tables.check_unallocated(seqs)
        hits = self.prefix_hits(seqs, group)
        cost = self._admission_cost(seqs, hits)
        if cost > self.num_free_blocks:
            raise ValueError(f"group {group.request_id} needs {cost} free blocks, "
                             f"only {self.num_free_blocks} are free")
        for tables, group_hits in zip(self.group_tables, hits, strict=True):
            tables.take_hits(group_hits)
        if group.use_prefix_cache:
            for seq, seq_hits in zip(seqs, hits[0], strict=True):
                self._count_query(seq, seq_hits[0])
        chain_ids = [cache_ids for _, cache_ids in hits[0]]
        for tables, group_hits in zip(self.group_tables, hits, strict=True):
            tables.load_tier_hits(seqs, group_hits, chain_ids)
        for tables, group_hits in zip(self.group_tables, hits, strict=True):
            tables.allocate_tables(group, seqs, group_hits)
        for seq, (seq_hits, _) in zip(seqs, hits[0], strict=True):
            seq.num_computed_tokens = len(seq_hits) * self.block_size

    def _count_query(self, seq: Sequence, hit_blocks: list[int | TierBlock]) -> None:
        if not self.enable_prefix_caching:
            return
        stats = self.prefix_cache_stats
        num_tier_blocks = sum(isinstance(block, TierBlock) for block in hit_blocks)
        stats.query_tokens += len(seq)
        stats.hit_tokens += len(hit_blocks) * self.block_size
        stats.tier_hit_tokens += num_tier_blocks * self.block_size
        stats.query_blocks += (len(seq) - 1) // self.block_size
        stats.hit_blocks += len(hit_blocks)

    def forget_unapplied(self, ops: BlockOps) -> None:
        """A step failed, its `ops` maybe half applied: drop the tier copies they were to
        store and the device entries of the blocks they were to load, so no later hit
        reads a block they left half written (those prefixes are computed again)."""
        self.tier.forget_stores(ops)
        self.prefix_cache.evict(ops.load[:, 1].astype(np.int64))

    # Growth and sharing ----------------------------------------------------------

    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool:
        """Whether every RUNNING sequence of the group can take `num_new_tokens` more
        tokens in every group (new blocks and copy-on-write copies)."""
        cost = sum(tables.append_cost(group, num_new_tokens) for tables in self.group_tables)
        return cost <= self.num_free_blocks

    def has_decode_slot(self, seq: Sequence) -> bool:
        """Whether the slot of seq's next token exists and is private in every group."""
        return all(tables.has_decode_slot(seq) for tables in self.group_tables)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Slots for positions num_computed_tokens .. + num_new_tokens - 1 of `seq` in
        every group, copying its shared blocks in that range first."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        for tables in self.group_tables:
            tables.append_slots(seq, num_new_tokens)

    def adopt_device_blocks(self, pool: BlockPool, seqs: list[Sequence],
                            tables: np.ndarray) -> None:
        """Take what a decode loop allocated on the device (only where
        `adopts_device_blocks`): `pool`, the device pool as the loop left it (numpy
        arrays), and each of `seqs`' table row (tables int32 [B, M], row i for seqs[i])
        with the blocks the loop appended after the host's entries."""
        self.pool.state = self.state._replace(device=pool)
        self.group_tables[0].adopt_device_blocks(seqs, tables)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` in every group (see
        FullAttentionTables.fork)."""
        for tables in self.group_tables:
            tables.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        """Forget `seq` in every group (a no-op for a sequence the manager does not know)."""
        for tables in self.group_tables:
            tables.free(seq)

    def mark_computed(self, seq: Sequence) -> None:
        """seq's tokens up to its num_computed_tokens now hold K/V: every group registers
        its full blocks (group 0 first: the others' entries hang on its cache ids) and
        gives back the blocks its window left."""
        chain_ids = self.group_tables[0].cache_ids(seq)
        for tables in self.group_tables:
            tables.mark_computed(seq, chain_ids)

    # Swapping ----------------------------------------------------------------------

    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the group's RUNNING sequences can move to host now.

        Their distinct blocks in every group must fit the host pool, and none may be
        written by this step's swap-in or copies (the device swaps out before those).
        """
        counts = [tables.swap_out_blocks(group) for tables in self.group_tables]
        return None not in counts and sum(counts) <= self.num_free_host_blocks

    def swap_out(self, group: SequenceGroup) -> None:
        """Move the RUNNING sequences' tables to host blocks (shared blocks move once)."""
        for tables in self.group_tables:
            tables.swap_out(group)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the SWAPPED sequences' distinct blocks fit on the device, with the watermark."""
        required = sum(tables.swap_in_blocks(group) for tables in self.group_tables)
        return self._admission_status(required, lambda: required)

    def swap_in(self, group: SequenceGroup) -> None:
        """Move the SWAPPED sequences' tables back to fresh device blocks."""
        for tables in self.group_tables:
            tables.swap_in(group)
