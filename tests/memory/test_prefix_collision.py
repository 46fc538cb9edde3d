"""Prefix caching must not trust its hash: blocks made to collide.

With `hash_block` replaced by a constant, or by the block's depth in its
chain, lookups find index entries of other content, so only the comparison of
the entry's content key (parent entry, salt, token ids) can tell a hit from a
collision. The oracles: the BlockManager state machine's model of the K/V
memory (every computed position must read back its own prefix), a hand-built
eviction case, and the scheduler's hit counters on prompts that share no prefix.
tests/engine/test_prefix_collision.py makes the engine's blocks collide.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SampledTokens
from jpaged.memory.block_manager import BlockManager
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.memory.test_block_manager import LAYER_WINDOWS, BlockManagerMachine


class CachingBlockManagerMachine(BlockManagerMachine):
    """The BlockManager state machine with prefix caching always on."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 40),
        num_host_blocks=st.integers(0, 20),
        watermark=st.sampled_from([0.0, 0.1]),
        share_blocks=st.booleans(),
        layer_windows=st.sampled_from(LAYER_WINDOWS),
    )
    def setup(self, block_size, num_blocks, num_host_blocks, watermark, share_blocks,
              layer_windows):
        super().setup(block_size, num_blocks, num_host_blocks, True, watermark, share_blocks,
                      layer_windows)


@pytest.mark.parametrize("hash_fixture", ["colliding_hash", "depth_hash"])
def test_block_manager_state_machine_with_colliding_hashes(request, hash_fixture):
    """Tokens 0..2 make genuine shared prefixes common: those may hit, nothing else."""
    request.getfixturevalue(hash_fixture)
    run_state_machine_as_test(
        CachingBlockManagerMachine,
        settings=settings(max_examples=60, stateful_step_count=80, deadline=None),
    )


def compute(manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Compute the next `num_tokens` tokens of a running `seq` and cache its full blocks."""
    manager.append_slots(seq, num_tokens)
    manager.end_step()
    seq.num_computed_tokens += num_tokens
    manager.mark_computed(seq)


def admit(manager: BlockManager, seq_id: int, prompt: list[int]) -> Sequence:
    seq = Sequence(seq_id, prompt)
    manager.allocate(SequenceGroup(str(seq_id), [seq]))
    seq.status = SequenceStatus.RUNNING
    return seq


def test_equal_tokens_after_another_parent_are_a_miss(depth_hash):
    """A cached block keeps the parent it was computed after, even once that parent is
    evicted and its physical block and its place in the index hold other tokens."""
    manager = BlockManager(CacheConfig(block_size=2, num_blocks=12, watermark=0.0))
    first = admit(manager, 0, [1, 1, 2, 2, 9])
    second = admit(manager, 1, [1, 1, 2, 2, 8])
    compute(manager, first, 2)  # caches (1, 1)
    compute(manager, second, 5)  # its (1, 1) stays private; caches (2, 2) after first's (1, 1)
    parent_block = manager.block_table(first)[0]
    manager.free(first)
    filler = admit(manager, 2, [90] * 2 * manager.num_free_blocks)  # evicts first's (1, 1)
    manager.free(filler)
    other = admit(manager, 3, [3, 3, 2, 2, 7])
    compute(manager, other, 5)  # caches (3, 3) at depth 1; its (2, 2) collides with second's
    assert manager.block_table(other)[0] == parent_block  # a block id is no proof of content
    later = admit(manager, 4, [3, 3, 2, 2, 5])
    # (3, 3) is cached, but the cached (2, 2) was computed after (1, 1): a miss.
    assert later.num_computed_tokens == 2
    assert manager.block_table(later)[0] == manager.block_table(other)[0]


def distinct_prompts(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
    """Random prompts whose first tokens differ: no two share a prefix."""
    rng = np.random.default_rng(seed)
    return [[i, *rng.integers(0, vocab_size, n - 1).tolist()] for i, n in enumerate(lengths)]


def check_tables_against_refcounts(manager: BlockManager, seqs: list[Sequence]) -> None:
    """Refcounts equal a recount of the device tables; free + used = total; block 0 unused."""
    tables = [
        manager.block_table(seq).tolist() for seq in seqs if seq.status is SequenceStatus.RUNNING
    ]
    holders = np.bincount(sum(tables, []), minlength=manager.num_device_blocks + 1)
    assert holders[0] == 0, "the null block is handed out"
    for block, count in enumerate(holders):
        assert manager.refcount(block) == count, block
    assert manager.num_free_blocks + np.count_nonzero(holders) == manager.num_device_blocks


def test_scheduler_serves_no_hit_across_prompts_without_a_shared_prefix(colliding_hash):
    manager = BlockManager(CacheConfig(block_size=4, num_blocks=40, watermark=0.0))
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64)
    scheduler = Scheduler(config, manager)
    prompts = distinct_prompts(0, [9, 17, 13, 22, 10, 30, 5, 18], vocab_size=1000)
    six_tokens = SamplingParams(max_tokens=6, ignore_eos=True)
    groups = [SequenceGroup(f"r{i}", [Sequence(0, prompt)], six_tokens)
              for i, prompt in enumerate(prompts)]
    seqs = [group.seqs[0] for group in groups]
    for group in groups:
        scheduler.add_request(group)
    for _ in range(500):
        if not scheduler.has_unfinished_requests:
            break
        output = scheduler.schedule()
        check_tables_against_refcounts(manager, seqs)
        scheduler.update_from_output(output, SampledTokens(
            np.full(output.num_draws, 7), np.ones(output.num_draws, bool)))
    manager.end_step()
    assert all(seq.status is SequenceStatus.FINISHED_LENGTH for seq in seqs)
    assert manager.num_free_blocks == manager.num_device_blocks, "leaked blocks"
    stats = manager.prefix_cache_stats
    assert stats.query_blocks == sum((len(p) - 1) // 4 for p in prompts) > 0
    assert (stats.hit_blocks, stats.hit_tokens) == (0, 0)
