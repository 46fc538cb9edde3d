"""Prefix caching: the hash chain, the map of cached blocks, and hits through the BlockManager."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig
from jpaged.memory.allocator import free_queue
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.prefix_cache import NO_HASH, PrefixCache, hash_block, pack_tokens
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


def test_hash_depends_on_parent_tokens_and_salt():
    base = hash_block(NO_HASH, pack_tokens([1, 2, 3, 4]), None)
    assert base == hash_block(NO_HASH, pack_tokens((1, 2, 3, 4)), None)
    variants = [
        hash_block(base, pack_tokens([1, 2, 3, 4]), None),
        hash_block(NO_HASH, pack_tokens([1, 2, 3, 5]), None),
        hash_block(NO_HASH, pack_tokens([1, 2, 3, 4]), "tenant"),
        hash_block(NO_HASH, pack_tokens([1, 2, 3, 4]), ""),
        hash_block(NO_HASH, pack_tokens([1, 2, 3]), None),
        hash_block(NO_HASH, pack_tokens([1, 2, 3, 4 + 2**32]), None),
    ]
    assert len({base, *variants}) == 7
    assert NO_HASH not in variants


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(2, 16),
    operations=st.lists(st.one_of(
        st.tuples(st.just("register"), st.integers(1, 15), st.integers(1, 6), st.integers(0, 2)),
        st.tuples(st.just("evict"), st.lists(st.integers(1, 15), max_size=4, unique=True)),
    ), max_size=30),
)
def test_the_cache_map_matches_a_dict(num_blocks, operations):
    """Registrations and evictions against a dict of hash -> (block, cache id, key) and
    the block -> hash it implies."""
    cache, model, next_id = PrefixCache(num_blocks), {}, 1
    for operation in operations:
        if operation[0] == "register":
            _, block, block_hash, parent = operation
            block %= num_blocks
            key = (parent, None, b"t")
            entry = model.get(block_hash)
            if entry is not None:
                expected = entry[1] if entry[2:] == key else None
                assert cache.register(block, block_hash, *key) == expected
            elif any(e[0] == block for e in model.values()):
                with pytest.raises(ValueError, match="already cached"):
                    cache.register(block, block_hash, *key)
            else:
                assert cache.register(block, block_hash, *key) == next_id
                model[block_hash] = (block, next_id, *key)
                next_id += 1
        else:
            blocks = sorted({b % num_blocks for b in operation[1]})
            cache.evict(np.array(blocks, np.int64))
            model = {h: e for h, e in model.items() if e[0] not in blocks}
        assert cache.entries == model
        for block in range(num_blocks):
            hashes = [h for h, e in model.items() if e[0] == block]
            assert cache.block_hashes[block] == (hashes[0] if hashes else NO_HASH)
            assert cache.holds(block) == bool(hashes)


def make_manager(num_blocks=64, block_size=4, caching=True):
    config = CacheConfig(block_size, num_blocks, enable_prefix_caching=caching, watermark=0.0)
    return BlockManager(config)


def run_prompt(manager, seq_id, prompt, salt=None):
    """Admit a request and compute its whole prompt; returns (seq, tokens served by the cache)."""
    seq = Sequence(seq_id, list(prompt))
    manager.allocate(SequenceGroup(str(seq_id), [seq], cache_salt=salt))
    seq.status = SequenceStatus.RUNNING
    hit_tokens = seq.num_computed_tokens
    manager.append_slots(seq, len(seq) - hit_tokens)
    manager.end_step()
    seq.num_computed_tokens = len(seq)
    manager.mark_computed(seq)
    return seq, hit_tokens


def test_hits_cover_whole_shared_blocks_but_never_the_last_token():
    manager = make_manager()
    first, hit = run_prompt(manager, 0, range(10))
    assert hit == 0
    _, hit = run_prompt(manager, 1, [*range(8), 50, 51])
    assert hit == 8
    _, hit = run_prompt(manager, 2, range(8))  # the last token's block is not looked up
    assert hit == 4
    _, hit = run_prompt(manager, 3, [*range(4), 99, *range(5, 10)])
    assert hit == 4
    _, hit = run_prompt(manager, 4, range(10), salt="other tenant")
    assert hit == 0
    _, hit = run_prompt(manager, 5, range(10), salt="other tenant")
    assert hit == 8
    stats = manager.prefix_cache_stats
    assert stats.query_tokens == 10 + 10 + 8 + 10 + 10 + 10
    assert stats.hit_tokens == 8 + 4 + 4 + 8
    assert stats.query_blocks == 2 + 2 + 1 + 2 + 2 + 2 and stats.hit_blocks == 6
    assert stats.hit_rate == stats.hit_tokens / stats.query_tokens


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    manager = make_manager(num_blocks=9, block_size=2)  # 8 usable blocks
    seq, _ = run_prompt(manager, 0, range(8))  # blocks 1..4, all full and cached
    manager.free(seq)
    manager.end_step()
    # Free queue: 5 6 7 8 then seq's blocks last first: 4 3 2 1.
    assert free_queue(manager.state.device) == [5, 6, 7, 8, 4, 3, 2, 1]
    filler = Sequence(1, [90] * 10)  # five blocks: 5, 6, 7, 8 and 4, evicting its hash
    manager.allocate(SequenceGroup("filler", [filler]))
    assert manager.block_table(filler) == [5, 6, 7, 8, 4]
    manager.free(filler)
    seq, hit = run_prompt(manager, 2, range(9))
    assert hit == 6 and manager.block_table(seq) == [1, 2, 3, 4, 8]


def test_no_hits_when_prefix_caching_is_off():
    manager = make_manager(caching=False)
    run_prompt(manager, 0, range(10))
    _, hit = run_prompt(manager, 1, range(10))
    assert hit == 0 and manager.prefix_cache_stats.query_tokens == 0


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3]),
    prompts=st.lists(
        st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=10), st.sampled_from("ab")),
        min_size=1,
        max_size=12,
    ),
)
def test_hits_are_the_longest_cached_block_prefix(block_size, prompts):
    """Brute force: the most leading full blocks equal to an earlier same-salt prompt's."""
    manager = make_manager(num_blocks=256, block_size=block_size)
    earlier: list[tuple[list[int], str]] = []
    for seq_id, (prompt, salt) in enumerate(prompts):
        eligible = (len(prompt) - 1) // block_size
        expected = 0
        for other, other_salt in earlier:
            if other_salt != salt:
                continue
            blocks = min(eligible, len(other) // block_size)
            size = 0
            while (
                size < blocks
                and prompt[: (size + 1) * block_size] == other[: (size + 1) * block_size]
            ):
                size += 1
            expected = max(expected, size)
        _, hit = run_prompt(manager, seq_id, prompt, salt)
        assert hit == expected * block_size
        earlier.append((prompt, salt))
