"""BlockManager over KV cache groups: global and sliding-window groups in one pool.

The windows' bounds are checked against the window's arithmetic on positions (which
blocks a query at position p reads), the prefix hits against a brute-force search
over every hit length, and the pool against a recount of the tables.
"""

import numpy as np
import pytest

from jpaged.config import CacheConfig
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

GEMMA3_270M_LAYERS = (512,) * 5 + (None,) + (512,) * 5 + (None,) + (512,) * 5 + (None,)


def cdiv(a, b):
    return -(-a // b)


def test_gemma3_270m_layers_make_six_groups_of_three():
    groups = KVCacheGroups.of(GEMMA3_270M_LAYERS)
    assert groups.windows == (None,) + (512,) * 5
    assert groups.layers_per_block == 3
    # Every (group, slot) buffer holds exactly one layer, of the group's kind.
    buffers = list(zip(groups.layer_groups, groups.layer_slots, strict=True))
    assert sorted(buffers) == [(g, s) for g in range(6) for s in range(3)]
    for window, group in zip(GEMMA3_270M_LAYERS, groups.layer_groups, strict=True):
        assert groups.windows[group] == window
    kept = KVCacheGroups.of(GEMMA3_270M_LAYERS, free_windows=False)
    assert kept.windows == (None,) and kept.layers_per_block == 18


def test_a_kind_the_group_size_does_not_divide_leaves_spare_buffers():
    groups = KVCacheGroups.of((None, None, 4, 4, 4))
    assert groups.windows == (None, 4, 4) and groups.layers_per_block == 2
    assert [(g, s) for g, s in zip(groups.layer_groups, groups.layer_slots, strict=True)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def window_blocks_read(num_tokens, window, block_size, num_new):
    """Blocks a step that computes positions num_tokens - num_new .. num_tokens - 1 reads
    or writes: from the window of its first query to its last token."""
    first_key = max(0, num_tokens - num_new - window + 1)
    return cdiv(num_tokens, block_size) - first_key // block_size


def test_a_4096_token_gemma3_sequence_holds_at_most_the_window_bound_at_every_step():
    """Chunked prefill of 4,096 tokens in chunks of C = 512, then decoding: each sliding
    group holds at most cdiv(W - 1 + C, bs) + 1 blocks after a chunk's append and
    cdiv(W, bs) + 1 while decoding; the global group holds every block; the blocks a
    window left are free in the pool. The global group takes the prompt's blocks at
    admission, a sliding one chunk by chunk."""
    block_size, chunk, window = 16, 512, 512
    groups = KVCacheGroups.of(GEMMA3_270M_LAYERS)
    num_blocks = 1 + 6 * cdiv(4096 + 64, block_size)
    manager = BlockManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                       watermark=0.0, max_num_batched_tokens=chunk),
                           groups)
    seq = Sequence(0, list(range(4096)))
    group = SequenceGroup("long", [seq])
    manager.allocate(group)
    seq.status = SequenceStatus.RUNNING
    steps = [chunk] * (4096 // chunk) + [1] * 64
    for num_new in steps:
        assert manager.can_append_slots(group, num_new)
        manager.append_slots(seq, num_new)
        end = seq.num_computed_tokens + num_new
        held = [len(t) - int(np.count_nonzero(t.array == 0)) for t in manager.block_tables(seq)]
        assert held[0] == cdiv(max(end, 4096), block_size)  # the prompt's, from admission
        bound = cdiv(window - 1 + num_new, block_size) + 1
        for g_held in held[1:]:
            assert g_held <= bound
            assert g_held == window_blocks_read(end, window, block_size, num_new)
        assert manager.physical_blocks_used == sum(held)
        seq.num_computed_tokens = end
        if end >= len(seq):
            seq.append_token(7)
        manager.mark_computed(seq)
        manager.end_step()
        manager.check_invariants([seq], [])
        # After the step the windows are released to the next token's window.
        held = [len(t) - int(np.count_nonzero(t.array == 0)) for t in manager.block_tables(seq)]
        assert manager.num_free_blocks == manager.num_device_blocks - sum(held)
    assert max(held[1:]) <= cdiv(window, block_size) + 1
    kept_per_seq = 6 * cdiv(len(seq), block_size)
    assert kept_per_seq / sum(held) > 3.5  # 18 x 4,160 layer-tokens against 3 x 4,160 + 15 x 528


def computed_manager(layer_windows, prompt, num_blocks, block_size=4):
    """A manager whose first request computed `prompt` in chunks of 8 and finished (its
    blocks free, still cached), and {(group, logical block): the physical block that
    held it}."""
    manager = BlockManager(
        CacheConfig(block_size=block_size, num_blocks=num_blocks, watermark=0.0,
                    max_num_batched_tokens=8),
        KVCacheGroups.of(layer_windows))
    seq = Sequence(0, list(prompt))
    manager.allocate(SequenceGroup("first", [seq]))
    held = {}
    while seq.num_computed_tokens < len(seq):
        num_new = min(8, len(seq) - seq.num_computed_tokens)
        manager.append_slots(seq, num_new)
        for g, table in enumerate(manager.block_tables(seq)):
            held.update({(g, i): block for i, block in enumerate(table) if block})
        seq.num_computed_tokens += num_new
        manager.mark_computed(seq)
        manager.end_step()
    manager.free(seq)
    manager.end_step()
    return manager, held


def oracle_hit(manager, windows, held, taken, num_prompt_blocks, follow_up):
    """The longest hit (in blocks) of `follow_up`, a prompt continuing the first one:
    group 0's blocks 0 .. h - 1 and each other group's blocks of what its layers read
    at position h * block_size (all before it, or a window's) must still hold the
    first prompt's K/V: held by a full block that no later allocation (`taken`) took."""
    bs = manager.block_size

    def cached(g, i):
        return i < num_prompt_blocks and held[g, i] not in taken

    best = 0
    for h in range(1, (len(follow_up) - 1) // bs + 1):
        ok = all(cached(0, i) for i in range(h))
        for g, window in enumerate(windows[1:], start=1):
            first = 0 if window is None else max(0, h * bs - window + 1) // bs
            ok &= all(cached(g, i) for i in range(first, h))
        if ok:
            best = h
    return best


def hit_lengths(manager, seq):
    hits = manager.prefix_hits([seq], SequenceGroup(str(seq.seq_id), [seq]))
    return [len(group_hits[0][0]) for group_hits in hits]


def taken_blocks(manager, seq):
    return {block for table in manager.block_tables(seq) for block in table}


def test_a_prompt_whose_window_blocks_were_evicted_hits_what_every_group_holds():
    """The global group's blocks of a prompt stay cached while the sliding group's
    blocks that its window left early are handed out again: a prompt that reads only
    the still-cached window blocks hits in full, one that reads evicted ones less."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50, 40).tolist()
    # 20 blocks for the prompt, 9 never used: the sliding group's blocks 0 .. 7, which
    # the window released during the prefill, come next in the free queue.
    manager, held = computed_manager((None, 8), prompt, num_blocks=30)
    filler = Sequence(1, rng.integers(50, 99, 60).tolist())  # 15 blocks: 9 + 6 evicted
    manager.allocate(SequenceGroup("filler", [filler]))
    taken = taken_blocks(manager, filler)
    assert {held[1, i] for i in range(6)} <= taken
    assert not {held[0, i] for i in range(10)} & taken
    follow_up = Sequence(2, prompt[:37] + [3])  # reads sliding blocks 7, 8 at position 36
    assert hit_lengths(manager, follow_up) == [9, 9]
    early = Sequence(3, prompt[:21] + [3])  # its window blocks 3, 4 were evicted
    assert hit_lengths(manager, early) == [0, 0]
    assert oracle_hit(manager, (None, 8), held, taken, 10, early.token_ids) == 0


@pytest.mark.parametrize("layer_windows", [(None, 8), (None, None, 4, 4, 4), (4, 8)])
def test_prefix_hits_equal_a_brute_force_search_after_random_evictions(layer_windows):
    rng = np.random.default_rng(len(layer_windows))
    windows = KVCacheGroups.of(layer_windows).windows
    num_groups = len(windows)
    for trial in range(30):
        prompt = rng.integers(0, 4, int(rng.integers(5, 60))).tolist()
        num_blocks = 1 + num_groups * cdiv(len(prompt), 4) + int(rng.integers(0, 10))
        manager, held = computed_manager(layer_windows, prompt, num_blocks)
        filler_tokens = rng.integers(10, 99, int(rng.integers(1, 40))).tolist()
        while True:  # as long a filler as the pool takes
            filler = Sequence(1, filler_tokens)
            if manager.can_allocate(SequenceGroup("filler", [filler])) is AllocStatus.OK:
                break
            manager.free(filler)
            filler_tokens = filler_tokens[:-4]
        manager.allocate(SequenceGroup("filler", [filler]))
        follow_up = Sequence(2, prompt[: int(rng.integers(1, len(prompt) + 1))] + [1])
        expected = oracle_hit(manager, windows, held, taken_blocks(manager, filler),
                              len(prompt) // 4, follow_up.token_ids)
        assert hit_lengths(manager, follow_up) == [expected] * num_groups, trial


def test_the_old_hybrid_manager_name_warns_and_is_the_block_manager():
    from jpaged.memory import hybrid_block_manager

    with pytest.warns(DeprecationWarning, match="HybridBlockManager is deprecated"):
        old = hybrid_block_manager.HybridBlockManager
    assert old is BlockManager
    groups = KVCacheGroups.of((None, 8))
    with pytest.warns(DeprecationWarning):
        manager = hybrid_block_manager.HybridBlockManager(CacheConfig(block_size=4), groups)
    assert manager.num_groups == 2


def test_a_sliding_group_registers_past_the_entries_its_window_released_before_a_swap():
    """A swap-in starts a table's cache ids again while its leading entries stay
    released: a sliding group registers the blocks after them on group 0's chain, so a
    follow-up prompt hits the blocks computed after the swap in every group."""
    manager = BlockManager(CacheConfig(block_size=4, num_blocks=40, num_host_blocks=40,
                                       watermark=0.0, max_num_batched_tokens=8),
                           KVCacheGroups.of((None, 4)))
    seq = Sequence(0, list(range(16)))
    group = SequenceGroup("a", [seq])
    manager.allocate(group)
    seq.status = SequenceStatus.RUNNING

    def compute(num_new):
        manager.append_slots(seq, num_new)
        manager.end_step()
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == len(seq):
            seq.append_token(50 + len(seq))
        manager.mark_computed(seq)

    compute(8)
    compute(8)
    manager.swap_out(group)
    manager.end_step()
    seq.status = SequenceStatus.SWAPPED
    manager.swap_in(group)
    manager.end_step()
    seq.status = SequenceStatus.RUNNING
    assert manager.block_tables(seq)[1][:3] == [0, 0, 0]  # released before the swap
    for _ in range(8):
        compute(1)
    assert seq.num_computed_tokens == 24
    follow_up = Sequence(1, seq.token_slice(0, 24) + [7])
    assert hit_lengths(manager, follow_up) == [6, 6]
    manager.check_invariants([seq], [])
