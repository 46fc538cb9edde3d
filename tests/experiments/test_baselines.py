"""The contiguous Orca baselines and the Figure-2 accounting on hand-checkable cases."""

from __future__ import annotations

import pytest

from experiments.baselines import ContiguousArena
from experiments.simulator import MemoryBreakdown, kv_breakdown
from jpaged.config import CacheConfig
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


def request(seq_id: int, prompt_len: int, total_len: int) -> tuple[SequenceGroup, int]:
    """A request whose output length is known in advance: total_len - prompt_len tokens."""
    seq = Sequence(seq_id, list(range(prompt_len)))
    params = SamplingParams(max_tokens=total_len - prompt_len, ignore_eos=True)
    return SequenceGroup(f"r{seq_id}", [seq], params), total_len


def arena(num_slots: int, policy: str, max_model_len: int = 40) -> ContiguousArena:
    return ContiguousArena(num_slots, f"orca-{policy}", max_model_len)


def admit(manager, group: SequenceGroup) -> Sequence:
    assert manager.can_allocate(group) is AllocStatus.OK
    manager.allocate(group)
    group.seqs[0].status = SequenceStatus.RUNNING
    return group.seqs[0]


@pytest.mark.parametrize(
    "policy,prompt_len,total,reserved",
    [
        ("max", 3, 5, 40),
        ("oracle", 3, 9, 9),
        # Pow2 rounds the output only: the paper's 25-token output reserves 32 slots.
        ("pow2", 5, 30, 5 + 32),
        ("pow2", 3, 5, 3 + 2),
        ("pow2", 3, 4, 3 + 1),
        ("pow2", 8, 16, 8 + 8),
        ("pow2", 8, 17, 8 + 16),
        # Never more than the request could ever hold.
        ("pow2", 20, 38, 40),
    ],
)
def test_reservation_policies(policy, prompt_len, total, reserved):
    group, _ = request(1, prompt_len, total)
    manager = arena(100, policy)
    assert manager.reservation(group) == reserved
    assert manager.allocated_slots(admit(manager, group)) == reserved
    assert manager.num_free_slots == 100 - reserved


def brute_force_pow2_slots(prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Prompt plus the smallest of 1, 2, 4, ... that holds the output, capped."""
    output_slots = 1
    while output_slots < output_len:
        output_slots *= 2
    return min(prompt_len + output_slots, max_model_len)


def test_pow2_over_reserves_the_output_less_than_twice():
    max_model_len = 300
    for prompt_len in (1, 7, 64, 200):
        for output_len in range(1, max_model_len - prompt_len + 1):
            group, total = request(1, prompt_len, prompt_len + output_len)
            manager = arena(1000, "pow2", max_model_len)
            reserved = manager.reservation(group)
            assert reserved == brute_force_pow2_slots(prompt_len, output_len, max_model_len)
            assert total <= reserved < prompt_len + 2 * output_len


@pytest.mark.parametrize("policy", ["pow2", "oracle"])
def test_an_unknown_output_length_is_rejected(policy):
    group = SequenceGroup("r1", [Sequence(1, [1, 2, 3])], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match=f"'r1'.*orca-{policy}.*ignore_eos"):
        arena(100, policy).check_fits(group)


def test_first_fit_leaves_holes_and_coalesces_them():
    manager = arena(100, "oracle")
    groups = [request(i, 5, 30)[0] for i in range(3)]
    seqs = [admit(manager, group) for group in groups]
    assert [manager.slab(seq) for seq in seqs] == [(0, 30), (30, 30), (60, 30)]
    assert manager.holes == [(90, 10)]
    manager.free(seqs[1])
    assert manager.holes == [(30, 30), (90, 10)]
    small = admit(manager, request(3, 5, 20)[0])
    assert manager.slab(small) == (30, 20)
    assert manager.holes == [(50, 10), (90, 10)]
    # 20 slots are free, but no hole holds 15: external fragmentation.
    assert manager.can_allocate(request(4, 5, 15)[0]) is AllocStatus.LATER
    for seq in (seqs[0], small, seqs[2]):
        manager.free(seq)
    assert manager.holes == [(0, 100)]


def test_a_request_larger_than_the_arena_never_fits():
    manager = arena(30, "max", max_model_len=40)
    assert manager.can_allocate(request(1, 3, 10)[0]) is AllocStatus.NEVER


def test_appends_stay_inside_the_slab():
    group, total = request(1, 6, 9)
    manager = arena(100, "oracle")
    seq = admit(manager, group)
    assert manager.can_append_slots(group, 9)
    assert not manager.can_append_slots(group, 10)
    end_step = manager.end_step()
    assert end_step.copies.shape == end_step.swap_in.shape == end_step.swap_out.shape == (0, 2)
    manager.free(seq)
    manager.free(seq)  # freeing twice is a no-op
    assert manager.holes == [(0, 100)]


def test_contiguous_breakdown_by_hand():
    # Two requests in a 64-slot arena under Pow2: prompts 10 and 4 with outputs 20
    # and 6 reserve 10 + 32 and 4 + 8 slots.
    (a, total_a), (b, total_b) = request(1, 10, 30), request(2, 4, 10)
    manager = arena(64, "pow2", max_model_len=64)
    seq_a, seq_b = admit(manager, a), admit(manager, b)
    seqs = [(seq_a, 15, total_a), (seq_b, 4, total_b)]
    # token states 15 + 4; reserved (30 - 15) + (10 - 4); internal 12 + 2; free 10.
    assert kv_breakdown(manager, seqs, requests_waiting=True) == MemoryBreakdown(19, 21, 14, 10)
    assert kv_breakdown(manager, seqs, requests_waiting=False) == MemoryBreakdown(19, 21, 14, 0)


def test_paged_breakdown_by_hand():
    manager = BlockManager(CacheConfig(block_size=4, num_blocks=11, enable_prefix_caching=False))
    (a, total_a), (b, total_b) = request(1, 10, 11), request(2, 5, 20)
    seq_a, seq_b = admit(manager, a), admit(manager, b)
    # a: 3 blocks = 12 slots, 10 computed, will reach 11 -> reserved 1, internal 1.
    # b: 2 blocks = 8 slots, 5 computed, will reach 20 -> reserved 3, internal 0.
    # 10 usable blocks, 5 taken: 20 free slots.
    seqs = [(seq_a, 10, total_a), (seq_b, 5, total_b)]
    breakdown = kv_breakdown(manager, seqs, requests_waiting=True)
    assert breakdown == MemoryBreakdown(15, 4, 1, 20)
    assert breakdown.total == 40 and breakdown.allocated == 20
    assert breakdown.percentages()["token_states"] == pytest.approx(37.5)


def test_windowed_breakdown_by_hand():
    """One global and one sliding layer (window 3), 2 layers a model: a block of 4 tokens
    of one layer holds 2 token slots of every layer."""
    from experiments.simulator import SimConfig, make_manager

    config = SimConfig(block_size=4, num_kv_slots=40, layer_windows=(None, 3),
                       enable_prefix_caching=False, watermark=0.0)
    assert config.block_slots == 2
    manager = make_manager(config)
    assert manager.num_device_blocks == 20  # 40 slots of both layers
    a, total_a = request(1, 12, 14)
    seq = admit(manager, a)
    manager.append_slots(seq, 12)
    seq.num_computed_tokens = 12
    manager.mark_computed(seq)
    # Global: 3 blocks, 12 computed of 12 held -> 12 token states, 6 slots. Sliding:
    # blocks 0 and 1 left the window of position 12 (keys 10 ..), block 2 holds
    # positions 8 .. 11 -> 4 token states, 2 slots. 16 of 20 blocks free: 32 slots.
    breakdown = kv_breakdown(manager, [(seq, 12, total_a)], True, config.block_slots)
    assert breakdown == MemoryBreakdown(8, 0, 0, 32)
    # Position 12 opens block 3 of each table: of its 4 positions 1 is computed, 1 will
    # be, 2 never (the request ends at 14 tokens); each position is half a slot.
    manager.append_slots(seq, 1)
    breakdown = kv_breakdown(manager, [(seq, 13, total_a)], False, config.block_slots)
    assert breakdown == MemoryBreakdown(6.5 + 2.5, 0.5 + 0.5, 1 + 1, 0)
