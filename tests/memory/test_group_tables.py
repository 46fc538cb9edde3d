"""The contract every group-table type keeps, and the coordinator over one group or many.

Each kind of KV cache layout runs the BlockManager state machine of
tests/memory/test_block_manager.py on its own: full attention, a sliding window (each
as one group, given as KV cache groups or as the config's window alone), and mixed
groups of both. The machine drives random admissions, chunked and speculative
appends, forks, beams, swaps, recomputes, aborts and frees; after every step the
coordinator's `check_invariants` holds, every table is exactly as long as its
definition says and released exactly the blocks before its next token's window, the
refcounts equal a recount of the tables, the K/V each position reads back is its own,
and once every sequence is freed every block is free.

Each table type's block bound (`max_blocks`, what admission and the engine's pool
sizing count) is checked against the blocks a step touches by definition, for every
chunk start.
"""

import pytest
from hypothesis import settings
from hypothesis.stateful import initialize

from jpaged.config import CacheConfig
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.group_tables import FullAttentionTables
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.reserving_block_manager import ReservingBlockManager
from jpaged.memory.sliding_window_tables import SlidingWindowTables, tables_type
from tests.memory.test_block_manager import (
    FULL_ATTENTION,
    MIXED_GROUPS,
    SLIDING_WINDOW,
    BlockManagerMachine,
    cdiv,
    setup_strategies,
)

CONTRACT_SETTINGS = settings(max_examples=10, stateful_step_count=200, deadline=None)


def machine_over(layer_windows):
    """The BlockManager state machine over the models of `layer_windows` only."""

    class Machine(BlockManagerMachine):
        @initialize(**setup_strategies(layer_windows))
        def setup(self, **kwargs):
            super().setup(**kwargs)

    return Machine


class TestFullAttentionTables(machine_over(FULL_ATTENTION).TestCase):
    settings = CONTRACT_SETTINGS


class TestSlidingWindowTables(machine_over(SLIDING_WINDOW).TestCase):
    settings = CONTRACT_SETTINGS


class TestMixedGroups(machine_over(MIXED_GROUPS).TestCase):
    settings = CONTRACT_SETTINGS


def blocks_touched(start, num_new, num_tokens, block_size, window):
    """Blocks of one table that a step computing positions start .. start + num_new - 1
    of a sequence of num_tokens reads or writes: from the first block holding a key of
    its first query's window (position start - W + 1; position 0 without a window) to
    the block of its last token."""
    first_key = 0 if window is None else max(0, start - window + 1)
    return min(cdiv(start + num_new, block_size), cdiv(num_tokens, block_size)) - (
        first_key // block_size)


@pytest.mark.parametrize("window", [None, 1, 2, 3, 7, 16])
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 16])
def test_a_tables_bound_covers_every_step_and_is_at_most_one_block_loose(window, block_size):
    """The most blocks a step of at most `chunk` tokens touches, over every chunk start:
    the bound never falls below it, and is exact without a window (every block)."""
    for chunk in range(1, 12):
        config = CacheConfig(block_size=block_size, sliding_window=window,
                             max_num_batched_tokens=chunk)
        table_type = tables_type(config)
        assert table_type is (FullAttentionTables if window is None else SlidingWindowTables)
        for num_tokens in range(1, 80):
            touched = max(blocks_touched(start, min(chunk, num_tokens - start), num_tokens,
                                         block_size, window) for start in range(num_tokens))
            bound = table_type.max_blocks(config, num_tokens)
            if window is None:
                assert bound == touched == cdiv(num_tokens, block_size)
            else:
                assert touched <= bound <= touched + 1, (chunk, num_tokens, touched, bound)


@pytest.mark.parametrize("layer_windows", FULL_ATTENTION + SLIDING_WINDOW + MIXED_GROUPS)
def test_pool_sizing_and_admission_count_the_same_bound(layer_windows):
    """The engine sizes its pool with KVCacheGroups.seq_blocks; admission asks the
    manager's seq_blocks: the sum of each group's table bound, in both."""
    groups = KVCacheGroups.of(layer_windows)
    config = CacheConfig(block_size=4, num_blocks=64, max_num_batched_tokens=9)
    manager = BlockManager(config, groups)
    for num_tokens in range(1, 100):
        expected = sum(tables.max_blocks(tables.config, num_tokens)
                       for tables in manager.group_tables)
        assert manager.seq_blocks(num_tokens) == expected
        assert groups.seq_blocks(num_tokens, 4, chunk_tokens=9) == expected


def test_only_one_group_adopts_a_decode_loops_blocks():
    config = CacheConfig(block_size=4, num_blocks=16)
    assert BlockManager(config).adopts_device_blocks
    assert BlockManager(config, KVCacheGroups.of((None, None))).adopts_device_blocks
    assert BlockManager(CacheConfig(block_size=4, num_blocks=16,
                                    sliding_window=8)).adopts_device_blocks
    assert not BlockManager(config, KVCacheGroups.of((None, 8))).adopts_device_blocks
    assert not ReservingBlockManager(config, "orca-max", 32).adopts_device_blocks
