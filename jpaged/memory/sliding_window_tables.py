"""Sliding-window group tables: the block tables of a KV cache group whose layers read
only the last W keys.

A query at position p reads keys p - W + 1 .. p only: after each step that computes a
sequence's tokens (`mark_computed`), the blocks wholly before its next token's window
go back to the pool, last first, and their table entries point at the null block.
Those released entries are always a table's leading ones; the kernels never read them
(pages before a window are skipped). So a table holds at most the window before a
step's chunk and the chunk, and it takes its blocks chunk by chunk rather than all at
admission. A prefix hit needs only the blocks in the window of its end: group 0's chain
of cache ids vouches for the rest.
"""

from __future__ import annotations

from jpaged.config import CacheConfig
from jpaged.memory import allocator
from jpaged.memory.group_tables import (
    FullAttentionTables,
    Hits,
    SeqBlocks,
    SharedPool,
    cdiv,
)
from jpaged.sequence import Sequence, SequenceGroup


class SlidingWindowTables(FullAttentionTables):
    """The block tables of one KV cache group whose layers slide by
    `cache_config.sliding_window` tokens."""

    def __init__(self, cache_config: CacheConfig, pool: SharedPool, group: int):
        super().__init__(cache_config, pool, group)
        self.window = cache_config.sliding_window

    @classmethod
    def max_blocks(cls, cache_config: CacheConfig, num_tokens: int) -> int:
        """At most those of the window before a step's chunk of at most
        max_num_batched_tokens tokens, and the chunk's:
        cdiv(W - 1 + chunk, block_size) + 1."""
        block_size = cache_config.block_size
        return min(super().max_blocks(cache_config, num_tokens),
                   cdiv(cache_config.sliding_window - 1 + cache_config.max_num_batched_tokens,
                        block_size) + 1)

    def window_start_block(self, position: int) -> int:
        """The blocks wholly before key position - W + 1."""
        return max(0, position - self.window + 1) // self.block_size

    def new_blocks_at_admission(self, seq: Sequence, num_hit_blocks: int) -> int:
        """None: `append_slots` adds blocks chunk by chunk, so a long prompt never holds
        blocks its window has left."""
        return 0

    def hit_on_chain(self, seq: Sequence, group: SequenceGroup, chain_ids: list[int],
                     num_blocks: int) -> Hits:
        """The longest hit of at most `num_blocks` blocks whose blocks in the window of
        the hit's end this group holds, searched right to left. Entries before that
        window are 0 (never taken)."""
        record = self._record(seq, group.cache_salt)
        self._memoise_blocks(seq, record, num_blocks)
        end = num_blocks
        found: dict[int, tuple] = {}
        i = end - 1
        while i >= self.window_start_block(end * self.block_size):
            hit = self._find(record, i, chain_ids)
            if hit is None:
                end, i = i, i - 1  # no hit reaches past a missing window block
                continue
            found[i] = hit
            i -= 1
        start = self.window_start_block(end * self.block_size)
        return ([0] * start + [found[i][0] for i in range(start, end)],
                [0] * start + [found[i][1] for i in range(start, end)])

    def mark_computed(self, seq: Sequence, chain_ids: list[int] | None = None) -> None:
        """Register seq's full blocks, then give back the blocks that no later token's
        window reads."""
        super().mark_computed(seq, chain_ids)
        self._release_out_of_window(self._seqs[seq.seq_id], seq.num_computed_tokens)

    def _release_out_of_window(self, record: SeqBlocks, position: int) -> None:
        """Give back the table's blocks wholly before the window of a query at
        `position`, last first; their entries point at the null block."""
        num_released = min(self.window_start_block(position), len(record.table))
        if num_released <= record.num_released:
            return
        table = record.table
        blocks = table.array[record.num_released:num_released].copy()
        self.state = allocator.free(self.state, blocks[::-1])
        for i in range(record.num_released, num_released):
            table.replace(i, 0)
        self.num_logical_blocks -= len(blocks)
        record.num_released = num_released


def tables_type(cache_config: CacheConfig) -> type[FullAttentionTables]:
    """The group-table type of a group whose window is `cache_config.sliding_window`."""
    if cache_config.sliding_window is None:
        return FullAttentionTables
    return SlidingWindowTables
