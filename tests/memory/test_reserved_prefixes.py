"""Reserved prefixes in the BlockManager, against what a reservation promises: the blocks
that computed a prefix stay cached and unallocated under any pressure, every prompt
extending the prefix hits them, and once released they are ordinary free cached blocks
that pressure evicts. Which blocks a sliding-window group needs comes from transformers'
window (a query at i sees keys j with i - W < j <= i), not from the code under test."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig
from jpaged.memory import allocator
from jpaged.memory.allocator import free_queue
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.reserved_prefixes import PrefixNotCached
from jpaged.memory.reserving_block_manager import ReservingBlockManager
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4
PREFIX = list(range(100, 110))  # 10 tokens: two full blocks and a partial one


class Pool:
    """A BlockManager and the sequences it runs, each computed whole in one step."""

    def __init__(self, num_blocks=17, layer_windows=(None,), max_model_len=None, **config):
        groups = KVCacheGroups.of(layer_windows)
        config = dict(block_size=BLOCK_SIZE, num_blocks=num_blocks, watermark=0.0,
                      sliding_window=groups.windows[0]) | config
        self.manager = BlockManager(CacheConfig(**config), groups, max_model_len=max_model_len)
        self.seqs: list[Sequence] = []
        self.next_id = 0
        self.next_token = 1000  # filler prompts never share a token with the prefix

    def run(self, prompt, salt=None) -> Sequence | None:
        """Admit `prompt` and compute it; None if it does not fit now."""
        seq = Sequence(self.next_id, list(prompt))
        group = SequenceGroup(str(self.next_id), [seq], cache_salt=salt)
        if self.manager.can_allocate(group) is not AllocStatus.OK:
            self.manager.free(seq)  # the lookup's memoised hashes
            return None
        self.next_id += 1
        self.manager.allocate(group)
        self.hit_tokens = seq.num_computed_tokens  # what the prefix cache served
        seq.status = SequenceStatus.RUNNING
        self.manager.append_slots(seq, len(seq) - seq.num_computed_tokens)
        self.manager.end_step()
        self.written = self.tables(seq)  # before a window releases any of its blocks
        seq.num_computed_tokens = len(seq)
        self.manager.mark_computed(seq)
        self.seqs.append(seq)
        return seq

    def filler(self, num_tokens: int) -> list[int]:
        self.next_token += num_tokens
        return list(range(self.next_token - num_tokens, self.next_token))

    def fill(self, num_tokens: int = BLOCK_SIZE) -> int:
        """Run fresh prompts until none fits: every free block is handed out."""
        count = 0
        while self.run(self.filler(num_tokens)) is not None:
            count += 1
        return count

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq)
        self.seqs.remove(seq)

    def free_all(self) -> None:
        for seq in list(self.seqs):
            self.free(seq)

    def tables(self, seq: Sequence) -> list[list[int]]:
        return [table.tolist() for table in self.manager.block_tables(seq)]

    def check(self) -> None:
        self.manager.check_invariants(self.seqs, [])

    def computed_and_freed(self, prompt, salt=None) -> list[list[int]]:
        """Compute `prompt` in a sequence that then ends; the blocks its tokens were
        written to, in each group."""
        seq = self.run(prompt, salt)
        self.free(seq)
        return self.written


def test_reserved_blocks_survive_a_full_pool_and_serve_every_extension():
    pool = Pool()
    manager = pool.manager
    computed = pool.computed_and_freed(PREFIX)[0][:2]  # the two full blocks
    prefix = manager.reserve(PREFIX)
    assert (prefix.num_tokens, prefix.num_cached_tokens, prefix.num_blocks) == (10, 8, 2)
    assert manager.num_reserved_blocks == 2
    assert manager.num_free_blocks == 16 - 2
    pool.check()

    assert pool.fill() == 14  # every other block went to a filler
    assert all(not set(computed) & set(pool.tables(seq)[0]) for seq in pool.seqs)
    assert all(manager.prefix_cache.holds(block) for block in computed)
    pool.check()
    pool.free_all()
    assert pool.fill(3 * BLOCK_SIZE) == 4  # and again, evicting the first fillers' blocks
    pool.free_all()

    for suffix in ([7], [7, 8, 9, 10, 11, 12, 13]):
        seq = pool.run(PREFIX + suffix)
        assert pool.hit_tokens == 8
        assert pool.tables(seq)[0][:2] == computed
    pool.check()


def test_a_released_prefix_is_cached_until_pressure_evicts_it():
    pool = Pool()
    manager = pool.manager
    computed = pool.computed_and_freed(PREFIX)[0][:2]
    prefix = manager.reserve(PREFIX)
    manager.release(prefix.prefix_id)
    assert manager.num_reserved_blocks == 0 and manager.num_free_blocks == 16
    # Back in the free queue's LRU order as a finished sequence's blocks: at the tail,
    # last first, still cached.
    assert free_queue(manager.state.device)[-2:] == computed[::-1]
    pool.check()
    pool.run(PREFIX + [7])
    assert pool.hit_tokens == 8
    pool.free_all()
    pool.fill()  # now they are handed out like any free block
    assert set(computed) <= {block for seq in pool.seqs for block in pool.tables(seq)[0]}
    pool.free_all()
    pool.run(PREFIX + [7])
    assert pool.hit_tokens == 0


def test_the_invariants_count_a_reservation_as_a_holder():
    pool = Pool()
    pool.computed_and_freed(PREFIX)
    prefix = pool.manager.reserve(PREFIX)
    sharing = pool.run(PREFIX + [1, 2])  # holds the reserved blocks too
    pool.check()
    block = pool.tables(sharing)[0][0]
    assert pool.manager.refcount(block) == 2
    pool.manager.pool.state = allocator.free(pool.manager.state, [block])  # behind its back
    with pytest.raises(RuntimeError, match=f"device block {block}: refcount 1, held by 2"):
        pool.check()
    pool.manager.pool.state = allocator.take(pool.manager.state, block)
    pool.free(sharing)
    pool.manager.release(prefix.prefix_id)
    pool.check()


def snapshot(manager: BlockManager):
    state = manager.state.device
    return (state.refcounts.copy(), free_queue(state), dict(manager.prefix_cache.entries),
            [(r.prefix, r.blocks) for r in manager.reserved_prefixes])


def assert_unchanged(manager: BlockManager, before) -> None:
    refcounts, queue, entries, reserved = before
    np.testing.assert_array_equal(manager.state.device.refcounts, refcounts)
    assert free_queue(manager.state.device) == queue
    assert manager.prefix_cache.entries == entries
    assert [(r.prefix, r.blocks) for r in manager.reserved_prefixes] == reserved


def test_a_prefix_beyond_the_room_left_is_refused_before_anything_changes():
    # 16 blocks, a max_model_len sequence takes 10: reservations may hold 6 together.
    pool = Pool(max_model_len=40)
    manager = pool.manager
    too_long = list(range(28))  # 7 full blocks
    pool.computed_and_freed(too_long)
    before = snapshot(manager)
    with pytest.raises(ValueError, match=r"prefix of 28 tokens needs 7 blocks.* the 6 blocks"):
        manager.reserve(too_long)
    assert_unchanged(manager, before)

    manager.reserve(too_long[:24])  # 6 blocks: exactly the room
    pool.computed_and_freed(range(200, 204))
    before = snapshot(manager)
    with pytest.raises(ValueError, match="prefix of 4 tokens needs 1 blocks; beside the 6"):
        manager.reserve(list(range(200, 204)))
    assert_unchanged(manager, before)
    with pytest.raises(ValueError, match="40 tokens leaves no room within max_model_len=40"):
        manager.check_reservable(list(range(40)))
    # With the reservation held, one max_model_len sequence still runs.
    assert pool.run(pool.filler(40)) is not None


@pytest.mark.parametrize("bad, error, message", [
    ([], ValueError, "empty prefix"),
    ([1, 2.0], TypeError, "token ids must be ints"),
    ([1, True], TypeError, "token ids must be ints"),
    ("text", TypeError, "sequence of token ids"),
    (7, TypeError, "sequence of token ids"),
])
def test_bad_tokens_are_refused_before_anything_changes(bad, error, message):
    pool = Pool()
    pool.computed_and_freed(PREFIX)
    before = snapshot(pool.manager)
    with pytest.raises(error, match=message):
        pool.manager.reserve(bad)
    assert_unchanged(pool.manager, before)


def test_bad_reservations_and_releases_are_refused_before_anything_changes():
    pool = Pool()
    manager = pool.manager
    pool.computed_and_freed(PREFIX)
    prefix = manager.reserve(PREFIX)
    before = snapshot(manager)
    with pytest.raises(PrefixNotCached, match="2 of the prefix's 3 full blocks"):
        manager.reserve(PREFIX[:8] + [5, 6, 7, 8, 9])  # its second block was never computed
    with pytest.raises(PrefixNotCached):
        manager.reserve(PREFIX, cache_salt="another tenant")
    with pytest.raises(TypeError, match="cache_salt must be a str"):
        manager.reserve(PREFIX, cache_salt=3)
    with pytest.raises(ValueError, match=r"no prefix 99 is reserved \(reserved: \[1\]\)"):
        manager.release(99)
    with pytest.raises(TypeError, match="prefix id is an int"):
        manager.release("1")
    with pytest.raises(ValueError, match="not lost"):
        manager.restore(prefix.prefix_id)
    assert_unchanged(manager, before)
    manager.release(prefix.prefix_id)
    before = snapshot(manager)
    with pytest.raises(ValueError, match="no prefix 1 is reserved"):
        manager.release(prefix.prefix_id)  # twice
    assert_unchanged(manager, before)


def test_a_prefix_shorter_than_a_block_holds_nothing():
    pool = Pool()
    prefix = pool.manager.reserve([1, 2, 3])
    assert (prefix.num_cached_tokens, prefix.num_blocks) == (0, 0)
    assert pool.manager.num_reserved_blocks == 0 and pool.manager.num_free_blocks == 16
    pool.manager.release(prefix.prefix_id)


def test_managers_without_a_prefix_cache_refuse():
    pool = Pool(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching is off"):
        pool.manager.reserve(PREFIX)
    orca = ReservingBlockManager(CacheConfig(block_size=4, num_blocks=9), "orca-max", 16)
    for call in (lambda: orca.reserve(PREFIX), lambda: orca.release(1)):
        with pytest.raises(ValueError, match="'orca-max' keeps no prefix cache"):
            call()


def test_a_reset_prefix_cache_loses_the_blocks_until_the_prefix_is_computed_again():
    pool = Pool()
    manager = pool.manager
    pool.computed_and_freed(PREFIX)
    prefix = manager.reserve(PREFIX)
    manager.reset_prefix_cache()  # the device KV is gone
    assert manager.num_reserved_blocks == 0 and manager.num_free_blocks == 16
    assert [r.is_lost for r in manager.reserved_prefixes] == [True]
    pool.check()
    with pytest.raises(PrefixNotCached, match="0 of the prefix's 2"):
        manager.restore(prefix.prefix_id)
    computed = pool.computed_and_freed(PREFIX)[0][:2]
    assert manager.restore(prefix.prefix_id) == prefix
    pool.fill()
    pool.check()
    pool.free_all()
    seq = pool.run(PREFIX + [7])
    assert pool.hit_tokens == 8 and pool.tables(seq)[0][:2] == computed
    pool.free(seq)
    manager.release(prefix.prefix_id)
    assert manager.num_free_blocks == 16
    lost = manager.reserve(PREFIX)
    manager.reset_prefix_cache()
    manager.release(lost.prefix_id)  # a lost prefix is released as any other
    assert len(manager.reserved_prefixes) == 0


def window_blocks(end: int, window: int) -> list[int]:
    """The blocks of keys before `end` that a query at `end` reads under transformers'
    window."""
    return sorted({j // BLOCK_SIZE for j in range(max(0, end - window + 1), end)})


@pytest.mark.parametrize("layer_windows", [(None, 6), (6,), (6, 10)])
def test_sliding_window_groups_hold_what_a_later_hit_reads(layer_windows):
    """With a global group (group 0), a windowed group holds only the prefix's blocks in
    the window of the first token after it. Group 0's every block is held, windowed or
    not: a lookup walks its chain from the first block."""
    prefix = list(range(100, 118))  # 18 tokens: 4 full blocks
    pool = Pool(num_blocks=41, layer_windows=layer_windows)
    manager = pool.manager
    computed = pool.computed_and_freed(prefix)
    reserved = manager.reserve(prefix)
    windows = [getattr(tables, "window", None) for tables in manager.group_tables]
    expected = [list(range(4))] + [window_blocks(16, w) if w else list(range(4))
                                   for w in windows[1:]]
    held = [r.blocks for r in manager.reserved_prefixes][0]
    assert [group.tolist() for group in held] == [
        [computed[g][i] for i in blocks] for g, blocks in enumerate(expected)]
    assert reserved.num_blocks == sum(map(len, expected))
    pool.fill()
    pool.check()
    pool.free_all()
    pool.fill(3 * BLOCK_SIZE)
    pool.free_all()
    pool.run(prefix + [1, 2, 3])
    assert pool.hit_tokens == 16
    pool.check()


@settings(max_examples=25, deadline=None)
@given(num_blocks=st.integers(8, 24), prefix_len=st.integers(1, 17),
       layer_windows=st.sampled_from([(None,), (None, 5), (5,)]),
       operations=st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=30))
def test_no_traffic_evicts_a_reserved_prefix(num_blocks, prefix_len, layer_windows,
                                             operations):
    """Fillers admitted and freed in any order, the pool however small: the reserved
    blocks stay held and cached, the invariants hold, and a prompt extending the prefix
    hits every full block afterwards (the room a reservation leaves lets it run)."""
    pool = Pool(num_blocks=num_blocks, layer_windows=layer_windows,
                max_model_len=prefix_len + 1)
    manager = pool.manager
    prefix = list(range(100, 100 + prefix_len))
    if pool.run(prefix) is None:
        return
    pool.free_all()
    try:
        reserved = manager.reserve(prefix)
    except ValueError:  # no room beside a max_model_len sequence
        return
    held = np.concatenate([np.zeros(0, np.int32),
                           *next(iter(manager.reserved_prefixes)).blocks])
    for admit, length in operations:
        if admit:
            pool.run(pool.filler(length))
        elif pool.seqs:
            pool.free(pool.seqs[length % len(pool.seqs)])
        assert (manager.state.device.refcounts[held] >= 1).all()
        assert all(manager.prefix_cache.holds(block) for block in held.tolist())
        pool.check()
    pool.free_all()
    assert pool.run(prefix + [1]) is not None
    assert pool.hit_tokens == reserved.num_cached_tokens == prefix_len // 4 * 4
