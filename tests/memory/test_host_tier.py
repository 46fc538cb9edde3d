"""The prefix cache's host tier: the BlockManager state machine with a small device pool
beside a host pool, so prefixes leave the device and come back from the host, and
hand-built cases of what the tier keeps, gives up and never serves.

The state machine's oracle is its model of the K/V memory (tests/memory/
test_block_manager.py): stores, loads and swaps move its slots as the block ops say,
and every computed position of a live sequence must read back its own prefix, so a
block loaded from the tier that holds another prefix fails there.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from jpaged.config import CacheConfig
from jpaged.memory.block_manager import BlockManager
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.memory.test_block_manager import (
    LAYER_WINDOWS,
    BlockManagerMachine,
    setup_strategies,
)


class HostTierMachine(BlockManagerMachine):
    """The BlockManager state machine with prefix caching on, a device pool of a few
    blocks and a host pool larger than it: conversations' next rounds find their
    prefixes in the tier."""

    @initialize(**(setup_strategies(LAYER_WINDOWS) | dict(
        num_blocks=st.integers(3, 8), num_host_blocks=st.integers(4, 24),
        caching=st.just(True))))
    def setup(self, **config):
        super().setup(**config)

    def teardown(self):
        if hasattr(self, "bm"):
            HostTierMachine.loaded_blocks += self.bm.tier.stats.loaded_blocks
        super().teardown()

    loaded_blocks = 0  # over every run: whether the runs reached the tier at all


def test_block_manager_state_machine_with_a_host_tier():
    run_state_machine_as_test(
        HostTierMachine, settings=settings(max_examples=40, stateful_step_count=120,
                                           deadline=None))


@pytest.mark.full
def test_block_manager_state_machine_with_a_host_tier_long_runs():
    """Rounds of 200 examples until one loads a block from the tier: a round misses it
    about one time in six (its random rules seldom meet a prefix the device had to give
    up), so five misses in a row say the tier cannot be reached."""
    HostTierMachine.loaded_blocks = 0
    for _ in range(5):
        run_state_machine_as_test(
            HostTierMachine, settings=settings(max_examples=200, stateful_step_count=200,
                                               deadline=None))
        if HostTierMachine.loaded_blocks:
            break
    assert HostTierMachine.loaded_blocks > 0, "no run loaded a block from the tier"


def manager(num_blocks=6, num_host_blocks=8, block_size=2) -> BlockManager:
    return BlockManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                    num_host_blocks=num_host_blocks, watermark=0.0))


def serve(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """Admit, compute and free one request: its full blocks are registered (and stored)."""
    group = SequenceGroup(str(seq_id), [Sequence(seq_id, tokens)])
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    hit = seq.num_computed_tokens
    bm.append_slots(seq, len(tokens) - hit)
    bm.end_step()
    seq.num_computed_tokens = len(tokens)
    bm.mark_computed(seq)
    bm.free(seq)
    seq.num_computed_tokens = hit  # what admission found cached
    return seq


PROMPT = [1, 2, 3, 4, 5, 6, 7]  # three full blocks of 2 and one token
OTHER = [9, 9, 8, 8, 7, 7, 6]


def test_a_prefix_evicted_from_the_device_is_loaded_back_from_the_tier():
    bm = manager()
    serve(bm, 0, PROMPT)
    serve(bm, 1, OTHER)  # the device's 5 blocks go round: PROMPT's first blocks are evicted
    again = serve(bm, 2, PROMPT)
    assert again.num_computed_tokens == 6  # every full block, from either tier
    stats = bm.prefix_cache_stats
    assert stats.tier_hit_tokens == bm.tier.stats.loaded_blocks * 2 > 0
    assert stats.hit_tokens == 6


def test_swapping_takes_the_tiers_blocks_and_their_copies_are_gone():
    bm = manager(num_host_blocks=4)
    serve(bm, 0, PROMPT)  # 3 blocks stored; OTHER's 4 need every host block
    assert bm.tier.num_cached_blocks == 3
    group = SequenceGroup("1", [Sequence(1, OTHER)])
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.append_slots(seq, len(OTHER))
    bm.end_step()
    assert bm.can_swap_out(group)  # the tier's copies are free host blocks
    bm.swap_out(group)
    assert bm.tier.num_cached_blocks == 0
    bm.end_step()
    bm.check_invariants([], [seq])


def test_a_full_host_pool_of_swapped_blocks_stores_nothing():
    bm = manager(num_host_blocks=4)
    group = SequenceGroup("0", [Sequence(0, OTHER + [5])])  # 4 blocks
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.append_slots(seq, 8)
    bm.end_step()
    bm.swap_out(group)
    bm.end_step()
    assert bm.num_free_host_blocks == 0
    serve(bm, 1, PROMPT)
    assert bm.tier.num_cached_blocks == 0 and bm.tier.stats.stored_blocks == 0
    bm.check_invariants([], [seq])


def test_a_salted_prefix_is_not_served_from_the_tier_to_another_salt():
    bm = manager()
    group = SequenceGroup("0", [Sequence(0, PROMPT)], cache_salt="a")
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.append_slots(seq, len(PROMPT))
    bm.end_step()
    seq.num_computed_tokens = len(PROMPT)
    bm.mark_computed(seq)
    bm.free(seq)
    serve(bm, 1, OTHER)
    assert serve(bm, 2, PROMPT).num_computed_tokens == 0
    assert bm.tier.stats.loaded_blocks == 0


def test_a_failed_steps_stores_and_loads_are_forgotten():
    bm = manager()
    serve(bm, 0, PROMPT)
    serve(bm, 1, OTHER)
    group = SequenceGroup("2", [Sequence(2, PROMPT)])
    bm.allocate(group)  # loads PROMPT's evicted blocks; the step then fails
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.append_slots(seq, 1)
    ops = bm.end_step()
    assert len(ops.load) and len(ops.store)
    bm.forget_unapplied(ops)
    bm.free(seq)
    loaded = ops.load[:, 1]
    assert not np.isin(loaded, np.flatnonzero(bm.prefix_cache.block_hashes)).any()
    assert not np.isin(ops.store[:, 1], np.flatnonzero(bm.tier.cache.block_hashes)).any()
