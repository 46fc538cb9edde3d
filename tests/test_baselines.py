"""The contiguous Orca baselines and the Figure-2 accounting on hand-checkable cases."""

from __future__ import annotations

import pytest

from experiments.baselines import ContiguousKVManager
from experiments.simulator import MemoryBreakdown, kv_breakdown
from jpaged.config import CacheConfig
from jpaged.memory.block_manager import AllocStatus, BlockManager
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


def request(seq_id: int, prompt_len: int, total_len: int) -> tuple[SequenceGroup, int]:
    seq = Sequence(seq_id, list(range(prompt_len)))
    return SequenceGroup(f"r{seq_id}", [seq]), total_len


def arena(num_slots: int, policy: str, totals: dict[str, int], max_model_len: int = 40):
    return ContiguousKVManager(num_slots, policy, max_model_len, lambda g: totals[g.request_id])


def admit(manager, group: SequenceGroup) -> Sequence:
    assert manager.can_allocate(group) is AllocStatus.OK
    manager.allocate(group)
    group.seqs[0].status = SequenceStatus.RUNNING
    return group.seqs[0]


@pytest.mark.parametrize(
    "policy,total,reserved",
    [("max", 5, 40), ("pow2", 5, 8), ("pow2", 8, 8), ("pow2", 9, 16), ("oracle", 9, 9)],
)
def test_reservation_policies(policy, total, reserved):
    group, _ = request(1, 3, total)
    manager = arena(100, policy, {"r1": total})
    assert manager.reservation(group) == reserved
    assert manager.allocated_slots(admit(manager, group)) == reserved
    assert manager.num_free_slots == 100 - reserved


def test_first_fit_leaves_holes_and_coalesces_them():
    totals = {f"r{i}": 30 for i in range(3)} | {"r3": 20, "r4": 15}
    manager = arena(100, "oracle", totals)
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
    manager = arena(30, "max", {}, max_model_len=40)
    assert manager.can_allocate(request(1, 3, 10)[0]) is AllocStatus.NEVER


def test_appends_stay_inside_the_slab():
    group, total = request(1, 6, 9)
    manager = arena(100, "oracle", {"r1": total})
    seq = admit(manager, group)
    assert manager.can_append_slots(group, 9)
    assert not manager.can_append_slots(group, 10)
    end_step = manager.end_step()
    assert end_step.copies.shape == end_step.swap_in.shape == end_step.swap_out.shape == (0, 2)
    manager.free(seq)
    manager.free(seq)  # freeing twice is a no-op
    assert manager.holes == [(0, 100)]


def test_contiguous_breakdown_by_hand():
    # Two requests in a 64-slot arena under Pow2: totals 30 and 10 reserve 32 and 16.
    (a, total_a), (b, total_b) = request(1, 10, 30), request(2, 4, 10)
    manager = arena(64, "pow2", {"r1": total_a, "r2": total_b})
    seq_a, seq_b = admit(manager, a), admit(manager, b)
    seq_a.num_computed_tokens, seq_b.num_computed_tokens = 15, 4
    seqs = [(seq_a, total_a), (seq_b, total_b)]
    # token states 15 + 4; reserved (30 - 15) + (10 - 4); internal 2 + 6; free 16.
    assert kv_breakdown(manager, seqs, requests_waiting=True) == MemoryBreakdown(19, 21, 8, 16)
    assert kv_breakdown(manager, seqs, requests_waiting=False) == MemoryBreakdown(19, 21, 8, 0)


def test_paged_breakdown_by_hand():
    manager = BlockManager(CacheConfig(block_size=4, num_blocks=11, enable_prefix_caching=False))
    (a, total_a), (b, total_b) = request(1, 10, 11), request(2, 5, 20)
    seq_a, seq_b = admit(manager, a), admit(manager, b)
    seq_a.num_computed_tokens, seq_b.num_computed_tokens = 10, 5
    # a: 3 blocks = 12 slots, 10 computed, will reach 11 -> reserved 1, internal 1.
    # b: 2 blocks = 8 slots, 5 computed, will reach 20 -> reserved 3, internal 0.
    # 10 usable blocks, 5 taken: 20 free slots.
    seqs = [(seq_a, total_a), (seq_b, total_b)]
    breakdown = kv_breakdown(manager, seqs, requests_waiting=True)
    assert breakdown == MemoryBreakdown(15, 4, 1, 20)
    assert breakdown.total == 40 and breakdown.allocated == 20
    assert breakdown.percentages()["token_states"] == pytest.approx(37.5)
