"""HybridBlockManager: the block tables of several KV cache groups over one pool.

A model with global and sliding-window layers (Gemma 2 and 3) has one KV cache group
per `layers_per_block` layers of a kind (jpaged.memory.kv_cache_groups), and each
group a BlockManager of its own: its own table per sequence, its own window, its own
prefix-cache entries, all drawing blocks from one allocator state and one prefix
cache. A sliding group's manager gives back the blocks its window left, so a long
sequence holds every block only in the global groups.

The scheduler sees one manager: a sequence fits when the blocks of all its groups
fit, and every call (append, fork, swap, free, ...) runs in every group. A prefix hit
is one length for all groups: group 0's left-to-right hit, cut to what every other
group holds of it (a sliding group needs only the blocks in the window of the hit's
end, found right to left; see BlockManager.anchored_hits).
"""

from __future__ import annotations

from dataclasses import replace

from jpaged.config import CacheConfig
from jpaged.memory.allocator import AllocatorState, BlockOps
from jpaged.memory.block_manager import BlockManager, Hits, SharedPool
from jpaged.memory.block_table import BlockTable
from jpaged.memory.invariants import holder_problems
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.prefix_cache import PrefixCache, PrefixCacheStats
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


class HybridBlockManager:
    """One BlockManager per KV cache group of `groups`, over one pool of
    `cache_config.num_blocks` blocks (cache_config.sliding_window is ignored: each
    group has its window)."""

    def __init__(self, cache_config: CacheConfig, groups: KVCacheGroups):
        self.groups = groups
        self.pool = SharedPool.create(cache_config)
        anchor = BlockManager(replace(cache_config, sliding_window=groups.windows[0]),
                              pool=self.pool)
        self.managers = [anchor] + [
            BlockManager(replace(cache_config, sliding_window=window), pool=self.pool,
                         group=g, anchor=anchor)
            for g, window in enumerate(groups.windows[1:], start=1)]
        self.block_size = cache_config.block_size
        self.num_device_blocks = anchor.num_device_blocks
        self.num_host_blocks = anchor.num_host_blocks
        self.enable_prefix_caching = anchor.enable_prefix_caching
        self.watermark_blocks = anchor.watermark_blocks

    adopts_device_blocks = False  # a decode loop allocates for one group

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def state(self) -> AllocatorState:
        return self.pool.state

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.pool.prefix_cache

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Group 0's counters: every group admits a sequence with the same hit."""
        return self.managers[0].prefix_cache_stats

    @property
    def num_free_blocks(self) -> int:
        return self.managers[0].num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.managers[0].num_free_host_blocks

    def refcount(self, block: int) -> int:
        return self.managers[0].refcount(block)

    def host_refcount(self, block: int) -> int:
        return self.managers[0].host_refcount(block)

    @property
    def physical_blocks_used(self) -> int:
        return self.managers[0].physical_blocks_used

    @property
    def logical_blocks_used(self) -> int:
        return sum(self.group_blocks_used)

    @property
    def group_blocks_used(self) -> tuple[int, ...]:
        """Each group's logical blocks: the entries its device tables hold."""
        return tuple(manager.logical_blocks_used for manager in self.managers)

    def block_tables(self, seq: Sequence) -> tuple[BlockTable, ...]:
        """The device block table of `seq` in each group."""
        return tuple(manager.block_table(seq) for manager in self.managers)

    def host_block_tables(self, seq: Sequence) -> tuple[BlockTable, ...]:
        return tuple(manager.host_block_table(seq) for manager in self.managers)

    def end_step(self) -> BlockOps:
        return self.managers[0].end_step()

    def reset_prefix_cache(self) -> None:
        """As BlockManager.reset_prefix_cache, for the pool all groups share."""
        for manager in self.managers:
            manager.check_no_device_tables()
        self.managers[0].reset_prefix_cache()

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        """BlockManager.check_invariants over all groups: the refcounts recount every
        group's tables together (a block belongs to one group's table at a time); each
        group's tables keep its window and null-block rules."""
        device = [t.array for seq in running for t in self.block_tables(seq)]
        host = [t.array for seq in swapped for t in self.host_block_tables(seq)]
        problems = holder_problems("device", self.state.device, device, first=1)
        problems += holder_problems("host", self.state.host, host, first=0)
        for g, manager in enumerate(self.managers):
            problems += [f"group {g}: {p}" for p in manager.table_problems(running)]
        if problems:
            raise RuntimeError("KV block invariants violated: " + "; ".join(problems[:5]))

    # Admission -----------------------------------------------------------------

    def prefix_hits(self, seqs: list[Sequence], group: SequenceGroup) -> list[list[Hits]]:
        """Each group's hits of each of `seqs` (indexed [group][seq]): one length in all
        groups, the longest that every group holds."""
        anchor = self.managers[0]
        per_seq = [self._seq_hits(seq, group, hits)
                   for seq, hits in zip(seqs, anchor.prefix_hits(seqs, group), strict=True)]
        return [list(hits) for hits in zip(*per_seq, strict=True)]

    def _seq_hits(self, seq: Sequence, group: SequenceGroup, anchor_hits: Hits) -> list[Hits]:
        anchor_ids = anchor_hits[1]
        num_blocks = len(anchor_ids)
        while True:  # cut to the shortest until every group holds the same length
            others = [manager.anchored_hits(seq, group, anchor_ids, num_blocks)
                      for manager in self.managers[1:]]
            shortest = min((len(hits[0]) for hits in others), default=num_blocks)
            if shortest == num_blocks:
                break
            num_blocks = shortest
        blocks, ids = anchor_hits
        return [(blocks[:num_blocks], ids[:num_blocks]), *others]

    def check_fits(self, group: SequenceGroup) -> None:
        num_tokens = group.seqs[0].num_prompt_tokens
        self.managers[0].check_prompt_fits(
            group, sum(manager.seq_blocks(num_tokens) for manager in self.managers))

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """BlockManager.can_allocate over the blocks of all groups."""
        seqs = group.seqs_with(SequenceStatus.WAITING)
        num_blocks = sum(manager.admission_blocks(seqs) for manager in self.managers)
        return self.managers[0].admission_status(
            num_blocks, lambda: self._admission_cost(seqs, self.prefix_hits(seqs, group)))

    def _admission_cost(self, seqs: list[Sequence], hits: list[list[Hits]]) -> int:
        return sum(manager.admission_cost(seqs, group_hits)
                   for manager, group_hits in zip(self.managers, hits, strict=True))

    def allocate(self, group: SequenceGroup) -> None:
        """BlockManager.allocate in every group; every group's hits are taken before any
        group allocates a block."""
        seqs = group.seqs_with(SequenceStatus.WAITING)
        for manager in self.managers:
            manager.check_unallocated(seqs)
        hits = self.prefix_hits(seqs, group)
        cost = self._admission_cost(seqs, hits)
        if cost > self.num_free_blocks:
            raise ValueError(f"group {group.request_id} needs {cost} free blocks, "
                             f"only {self.num_free_blocks} are free")
        for manager, group_hits in zip(self.managers, hits, strict=True):
            manager.take_hits(group_hits)
        for manager, group_hits in zip(self.managers, hits, strict=True):
            manager.allocate_tables(group, seqs, group_hits)

    # Growth and sharing ----------------------------------------------------------

    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool:
        cost = sum(manager.append_cost(group, num_new_tokens) for manager in self.managers)
        return cost <= self.num_free_blocks

    def has_decode_slot(self, seq: Sequence) -> bool:
        return all(manager.has_decode_slot(seq) for manager in self.managers)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for manager in self.managers:
            manager.append_slots(seq, num_new_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for manager in self.managers:
            manager.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        for manager in self.managers:
            manager.free(seq)

    def mark_computed(self, seq: Sequence) -> None:
        """Every group's full blocks registered (group 0 first: the others' entries hang
        on its cache ids) and its out-of-window blocks given back."""
        for manager in self.managers:
            manager.mark_computed(seq)

    # Swapping ----------------------------------------------------------------------

    def can_swap_out(self, group: SequenceGroup) -> bool:
        counts = [manager.swap_out_blocks(group) for manager in self.managers]
        return None not in counts and sum(counts) <= self.num_free_host_blocks

    def swap_out(self, group: SequenceGroup) -> None:
        for manager in self.managers:
            manager.swap_out(group)

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        required = sum(manager.swap_in_blocks(group) for manager in self.managers)
        return self.managers[0].admission_status(required, lambda: required)

    def swap_in(self, group: SequenceGroup) -> None:
        for manager in self.managers:
            manager.swap_in(group)
