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

Reserved prefixes (jpaged.memory.reserved_prefixes) hold computed prefixes' blocks
beside the tables: `reserve`, `release`, and `restore` after `reset_prefix_cache`.
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
from jpaged.memory.reserved_prefixes import (
    PrefixNotCached,
    ReservedPrefixes,
    check_cache_salt,
    check_prefix_id,
    check_token_ids,
)
from jpaged.memory.sliding_window_tables import tables_type
from jpaged.outputs import ReservedPrefix
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

# The seq_id of the sequence a reservation's lookup makes (the scheduler's count from 0).
_PROBE_SEQ_ID = -1


class BlockManager:
    """Block tables, prefix cache and swap space of a KV cache of `cache_config.num_blocks`
    blocks, for the KV cache groups `groups` (None: one group whose window is
    `cache_config.sliding_window`; given groups, each has its own window instead).

    max_model_len: the longest sequence the scheduler admits, in tokens; reserved
    prefixes leave room for one (None: reservations may fill the pool beside the
    watermark).
    """

    def __init__(self, cache_config: CacheConfig, groups: KVCacheGroups | None = None, *,
                 max_model_len: int | None = None):
        windows = (cache_config.sliding_window,) if groups is None else groups.windows
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.num_device_blocks = cache_config.num_blocks - 1
        self.num_host_blocks = cache_config.num_host_blocks
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.watermark_blocks = int(cache_config.watermark * self.num_device_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self.pool = SharedPool.create(cache_config)
        group_configs = [replace(cache_config, sliding_window=window) for window in windows]
        self.group_tables: list[FullAttentionTables] = [
            tables_type(config)(config, self.pool, g) for g, config in enumerate(group_configs)]
        self.reserved_prefixes = ReservedPrefixes()
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
        """Device blocks held by at least one table or reserved prefix (free cached
        blocks excluded)."""
        return self.num_device_blocks - self.num_free_blocks

    @property
    def num_reserved_blocks(self) -> int:
        """Device blocks some reserved prefix holds (some tables may hold them too)."""
        return self.reserved_prefixes.num_held_blocks

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
        reallocated its cache). No table may hold a device block; swapped sequences keep
        their host blocks and the host tier its copies, but those the pending device ops
        were to store, which are dropped. Every reserved prefix loses its blocks but stays
        reserved, lost, until its prefix is computed again and `restore`d (or it is
        released)."""
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
        self.reserved_prefixes.lose_all()

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        """Check the blocks against the live sequences; RuntimeError on a violation.

        Every device and host block's reference count equals the number of the
        running (device) and swapped (host) sequences' tables holding it, in every
        group together (a block belongs to one group's table at a time), plus the
        reserved prefixes holding it, so a block is free exactly when none does; the
        free counts agree; every reserved block is in the prefix cache; the null block
        is in no table but as its released leading entries, which are all the entries
        before the window of the sequence's next token; each group's logical block
        count is its tables' total, released entries excepted.
        """
        device = [table.array for seq in running for table in self.block_tables(seq)]
        host = [table.array for seq in swapped for table in self.host_block_tables(seq)]
        reserved = self.reserved_prefixes.held()
        problems = holder_problems("device", self.state.device, device + reserved, first=1)
        problems += holder_problems("host", self.state.host, host, first=0)
        problems += self.tier.problems(self.state)
        problems += [f"reserved block {block} is not in the prefix cache"
                     for group in reserved for block in group.tolist()
                     if not self.prefix_cache.holds(block)]
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

    def _seq_hits(self, seq: Sequence, group: SequenceGroup, num_blocks: int | None = None
                  ) -> list[Hits]:
        """seq's hit in each group, of at most `num_blocks` blocks (None: never its last
        token)."""
        blocks, chain_ids = self.group_tables[0].prefix_hit(seq, group, num_blocks)
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
        """Move the RUNNING sequences' tables to host blocks (shared blocks move once).
        ValueError, changing nothing, if this step writes one of their blocks in any
        group (checked for every group before the first moves)."""
        if any(tables.swap_out_blocks(group) is None for tables in self.group_tables):
            raise ValueError(f"group {group.request_id}: a block of it is written by this "
                             "step (its swap-in or copies); swap it out in another step")
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

    # Reserved prefixes -------------------------------------------------------------

    def reserve(self, token_ids: list[int], cache_salt: str | None = None) -> ReservedPrefix:
        """Hold the full blocks of a computed prefix until `release`: no allocation evicts
        them, and every request whose prompt extends the prefix (with the same
        cache_salt) hits them.

        token_ids: the prefix, whose full blocks some sequence computed and
        `mark_computed` registered in the prefix cache under cache_salt. Which blocks
        it holds: those a prefix lookup of its full blocks must find (`_lookup_blocks`).
        Raises, changing nothing, what `check_reservable` raises, and PrefixNotCached (a
        ValueError) if not every full block is in the prefix cache.
        """
        token_ids = check_token_ids(token_ids)
        self.check_reservable(token_ids, cache_salt)
        blocks = self._cached_prefix_blocks(token_ids, cache_salt)
        self._hold(blocks)
        num_cached_tokens = len(token_ids) // self.block_size * self.block_size
        return self.reserved_prefixes.add(token_ids, cache_salt, blocks,
                                          num_cached_tokens).prefix

    def check_reservable(self, token_ids: list[int], cache_salt: str | None = None) -> None:
        """Raise, naming the limit, unless a prefix of these tokens may be reserved once
        computed: TypeError for anything but int token ids and a str or None salt;
        ValueError for an empty prefix, with prefix caching off, for a prefix of
        max_model_len tokens or more (no request could extend it), and for one whose
        blocks, with those the reservations hold (`ReservedPrefixes.num_blocks`), are
        more than `reservable_blocks`."""
        num_tokens = len(check_token_ids(token_ids))
        check_cache_salt(cache_salt)
        if not self.enable_prefix_caching:
            raise ValueError("prefix caching is off: a reserved prefix is held in the prefix "
                             "cache (enable_prefix_caching=True)")
        if self.max_model_len is not None and num_tokens >= self.max_model_len:
            raise ValueError(f"a prefix of {num_tokens} tokens leaves no room within "
                             f"max_model_len={self.max_model_len} for a request extending it")
        num_blocks = self.prefix_blocks(num_tokens)
        reserved = self.reserved_prefixes.num_blocks
        if reserved + num_blocks > self.reservable_blocks:
            raise ValueError(
                f"a prefix of {num_tokens} tokens needs {num_blocks} blocks; beside the "
                f"{reserved} blocks of the prefixes reserved already that is more than the "
                f"{self.reservable_blocks} blocks reserved prefixes may hold (the pool's "
                f"{self.num_device_blocks} blocks less the watermark's {self.watermark_blocks} "
                f"and the {self._longest_seq_blocks} of one max_model_len="
                f"{self.max_model_len} sequence)")

    @property
    def _longest_seq_blocks(self) -> int:
        return self.seq_blocks(self.max_model_len or 0)

    @property
    def reservable_blocks(self) -> int:
        """The most blocks reserved prefixes may hold together: the pool less the
        watermark and the blocks of one max_model_len sequence, so that every request the
        scheduler admits can still run once the others end."""
        return self.num_device_blocks - self.watermark_blocks - self._longest_seq_blocks

    def prefix_blocks(self, num_tokens: int) -> int:
        """Blocks a reserved prefix of `num_tokens` tokens holds, over every group."""
        num_full = num_tokens // self.block_size
        return sum(map(len, self._lookup_blocks([list(range(num_full))] * self.num_groups)))

    def _lookup_blocks(self, hits: list[list[int]]) -> list[list[int]]:
        """Of each group's blocks of a prefix hit, those a later lookup of that length must
        find in the cache: every one of group 0's (a lookup walks its chain of cache ids
        from the first block) and, in another group, those in the window of the hit's
        end (`held_hits`: every one without a window)."""
        first, *others = hits
        return [first, *(tables.held_hits(blocks)
                         for tables, blocks in zip(self.group_tables[1:], others, strict=True))]

    def _cached_prefix_blocks(self, token_ids: tuple[int, ...], cache_salt: str | None
                              ) -> tuple[np.ndarray, ...]:
        """Each group's cached blocks that a lookup of the prefix's full blocks must find
        (int32 [K_g] each); PrefixNotCached, changing nothing, if one is missing."""
        num_blocks = len(token_ids) // self.block_size
        probe = Sequence(_PROBE_SEQ_ID, list(token_ids))
        hits = self._seq_hits(probe, SequenceGroup("reserved prefix", [probe],
                                                   cache_salt=cache_salt), num_blocks)
        self.free(probe)  # its records (memoised hashes) go
        num_hit = len(hits[0][0])
        if num_hit < num_blocks:
            raise PrefixNotCached(
                f"{num_hit} of the prefix's {num_blocks} full blocks are in the prefix cache; "
                "a prefix is reserved once a sequence computed it")
        blocks = self._lookup_blocks([group_blocks for group_blocks, _ in hits])
        if any(isinstance(block, TierBlock) for group_blocks in blocks for block in group_blocks):
            raise PrefixNotCached("some of the prefix's full blocks are in the host tier, "
                                  "not on the device: a prefix is reserved once a sequence "
                                  "computed or loaded it")
        return tuple(np.asarray(group_blocks, np.int32) for group_blocks in blocks)

    def _hold(self, blocks: tuple[np.ndarray, ...]) -> None:
        for group_blocks in blocks:
            for block in group_blocks.tolist():
                self.pool.state = allocator.take(self.state, block)

    def release(self, prefix_id: int) -> None:
        """Drop reservation `prefix_id`'s holder of its blocks: those no table holds join
        the free queue's tail, last first, still cached. Raises, changing nothing,
        ValueError for a prefix not reserved (or released already), TypeError for an id
        that is not an int."""
        reservation = self.reserved_prefixes.remove(check_prefix_id(prefix_id))
        for group_blocks in reservation.blocks or ():
            self.pool.state = allocator.free(self.state, group_blocks[::-1])

    def restore(self, prefix_id: int) -> ReservedPrefix:
        """Hold again the blocks of a reservation whose KV was lost (`reset_prefix_cache`),
        once its prefix is computed again. Raises, changing nothing, ValueError for a
        prefix not reserved or not lost, PrefixNotCached if a block is missing."""
        reservation = self.reserved_prefixes.get(prefix_id)
        if not reservation.is_lost:
            raise ValueError(f"reserved prefix {prefix_id} holds its blocks: it is not lost")
        blocks = self._cached_prefix_blocks(reservation.token_ids, reservation.cache_salt)
        self._hold(blocks)
        reservation.blocks = blocks
        return reservation.prefix
