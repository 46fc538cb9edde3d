"""Orca's reservation policies on the reserving block manager and the scheduler above it.

Oracles: the policies' definitions written out here (max_model_len; prompt plus
the least power of two not below the output, found by doubling; prompt plus
output), block counts derived from them, and a brute-force count of how many
waiting requests fit the pool first come, first served. tests/engine/test_allocation.py
holds the engine to the same definitions.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import BeamChoice, SampledTokens
from jpaged.memory.reservation import reserved_tokens
from jpaged.memory.reserving_block_manager import ReservingBlockManager
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

ORCA = ("orca-max", "orca-pow2", "orca-oracle")
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4


def by_definition(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    if policy == "orca-max":
        return max_model_len
    if policy == "orca-oracle":
        return min(prompt_len + output_len, max_model_len)
    output_slots = 1
    while output_slots < output_len:
        output_slots *= 2
    return min(prompt_len + output_slots, max_model_len)


@pytest.mark.parametrize("policy", ORCA)
def test_reserved_tokens_follow_the_definitions(policy):
    for prompt_len in range(1, 40):
        for output_len in range(1, 80):
            assert reserved_tokens(policy, prompt_len, output_len, 100) == by_definition(
                policy, prompt_len, output_len, 100), (prompt_len, output_len)


def test_pow2_over_reserves_the_output_not_the_total():
    assert reserved_tokens("orca-pow2", 100, 25, 2048) == 132
    assert reserved_tokens("orca-pow2", 100, 32, 2048) == 132
    assert reserved_tokens("orca-pow2", 100, 33, 2048) == 164
    assert reserved_tokens("orca-pow2", 2000, 33, 2048) == 2048


def test_paged_reserves_nothing():
    assert reserved_tokens("paged", 10, None, 64) == 0


@pytest.mark.parametrize("policy", ["orca-pow2", "orca-oracle"])
def test_unknown_output_length_is_rejected(policy):
    with pytest.raises(ValueError, match=f"{policy}.*ignore_eos"):
        reserved_tokens(policy, 10, None, 64)


def test_unknown_allocation_is_rejected():
    with pytest.raises(ValueError, match="paged.*got 'orca'"):
        reserved_tokens("orca", 10, 5, 64)


def test_the_reserving_manager_takes_only_orca_policies():
    config = CacheConfig(block_size=4, num_blocks=20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="'paged' reserves nothing"):
        ReservingBlockManager(config, "paged", 64)
    with pytest.raises(ValueError, match="allocation must be one of"):
        ReservingBlockManager(config, "orca", 64)


class Driver:
    """Runs a scheduler as an engine would; request i emits output_lens[i] tokens per
    sequence (its max_tokens), beams keep their width by forking the first and dropping
    the last."""

    def __init__(self, num_blocks: int, policy: str = "orca-oracle", max_num_seqs: int = 64,
                 max_tokens: int = 4096):
        self.manager = ReservingBlockManager(CacheConfig(
            block_size=BLOCK_SIZE, num_blocks=num_blocks + 1, enable_prefix_caching=False),
            policy, MAX_MODEL_LEN)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
            max_model_len=MAX_MODEL_LEN), self.manager)
        self.groups: dict[str, SequenceGroup] = {}

    def add(self, request_id: str, prompt_len: int, output_len: int, n: int = 1,
            beam: bool = False) -> SequenceGroup:
        params = (BeamSearchParams(beam_width=n, max_tokens=output_len, ignore_eos=True) if beam
                  else SamplingParams(n=n, max_tokens=output_len, ignore_eos=True))
        group = SequenceGroup(request_id, [Sequence(0, list(range(1, prompt_len + 1)))], params)
        self.scheduler.add_request(group)
        self.groups[request_id] = group
        return group

    def step(self):
        output = self.scheduler.schedule()
        assert not output.preempted and not output.ignored
        self.update(output)
        return output

    def update(self, output) -> None:
        beams = {group.request_id: self._beams(group) for group, _ in output.draws
                 if group.is_beam_search}
        num_draws = output.num_draws
        self.scheduler.update_from_output(output, SampledTokens(
            np.full(num_draws, 7), np.ones(num_draws, bool), beams))

    @staticmethod
    def _beams(group: SequenceGroup) -> BeamChoice:
        width = group.max_seqs
        if len(group.seqs) == 1:
            return BeamChoice([0] * width, [7] * width)
        return BeamChoice([*range(width - 1), 0], [7] * width)

    def running(self) -> list[SequenceGroup]:
        return [g for g in self.scheduler.running if g.seqs_with(SequenceStatus.RUNNING)]

    def held_blocks(self) -> int:
        return self.manager.num_device_blocks - self.manager.num_free_blocks


def random_requests(rng: random.Random, num: int) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs that fit max_model_len."""
    pairs = []
    for _ in range(num):
        prompt_len = rng.randint(1, MAX_MODEL_LEN - 1)
        pairs.append((prompt_len, rng.randint(1, MAX_MODEL_LEN - prompt_len)))
    return pairs


@pytest.mark.parametrize("policy", ORCA)
def test_each_running_request_holds_its_reservation_until_it_ends(policy):
    rng = random.Random(1)
    driver = Driver(num_blocks=48, policy=policy)
    expected_blocks = {}
    for i, (prompt_len, output_len) in enumerate(random_requests(rng, 25)):
        reserved = by_definition(policy, prompt_len, output_len, MAX_MODEL_LEN)
        driver.add(f"r{i}", prompt_len, output_len)
        expected_blocks[f"r{i}"] = math.ceil(reserved / BLOCK_SIZE)
    while driver.scheduler.has_unfinished_requests:
        driver.step()
        running = driver.running()
        for group in running:
            (seq,) = group.seqs_with(SequenceStatus.RUNNING)
            assert len(driver.manager.block_table(seq)) == expected_blocks[group.request_id]
        assert driver.held_blocks() == sum(expected_blocks[g.request_id] for g in running)
    assert driver.scheduler.num_preemptions == 0
    assert driver.manager.num_free_blocks == driver.manager.num_device_blocks
    assert driver.manager.logical_blocks_used == 0


@pytest.mark.parametrize("seed", range(5))
def test_admission_stops_exactly_when_the_next_reservation_does_not_fit(seed):
    rng = random.Random(seed)
    pool = rng.randint(16, 80)
    driver = Driver(num_blocks=pool)
    blocks = []
    for i, (prompt_len, output_len) in enumerate(random_requests(rng, 30)):
        reserved = by_definition("orca-oracle", prompt_len, output_len, MAX_MODEL_LEN)
        driver.add(f"r{i}", prompt_len, output_len)
        blocks.append(math.ceil(reserved / BLOCK_SIZE))
    admitted: list[int] = []  # request indices in admission order
    while driver.scheduler.has_unfinished_requests:
        before = {g.request_id for g in driver.running()}
        free = pool - sum(blocks[int(r[1:])] for r in before)
        running_in_step = driver.step().running
        # Brute force: first come, first served, the waiting requests fit while
        # their running sum of blocks stays within the free blocks.
        waiting = [i for i in range(len(blocks)) if i not in admitted and f"r{i}" not in before]
        expected = []
        for i in waiting:
            if blocks[i] > free:
                break
            free -= blocks[i]
            expected.append(i)
        now = {int(g.request_id[1:]) for g in running_in_step}
        assert sorted(now - {int(r[1:]) for r in before}) == expected
        admitted += expected


@pytest.mark.parametrize("policy", ORCA)
def test_samples_and_beams_each_hold_a_reservation(policy):
    """Orca gives every sequence a slab of its own: a request with n samples (or a
    beam width) holds n reservations from admission to its end, whatever its
    sequences share, fork or drop; forks copy the parent's computed blocks."""
    driver = Driver(num_blocks=120, policy=policy)
    requests = {"n3": (9, 6, 3, False), "beam4": (5, 7, 4, True), "single": (3, 2, 1, False)}
    expected = {}
    for request_id, (prompt_len, output_len, n, beam) in requests.items():
        reserved = by_definition(policy, prompt_len, output_len, MAX_MODEL_LEN)
        driver.add(request_id, prompt_len, output_len, n=n, beam=beam)
        expected[request_id] = n * math.ceil(reserved / BLOCK_SIZE)
    copies = 0
    while driver.scheduler.has_unfinished_requests:
        output = driver.scheduler.schedule()
        copies += len(output.block_ops.copies)
        # Counted as the step commits them: blocks freed in the step of their fork's
        # copy stay pinned until then.
        running = driver.running()
        assert driver.held_blocks() == sum(expected[g.request_id] for g in running)
        for group in running:
            for seq in group.seqs_with(SequenceStatus.RUNNING):
                assert len(driver.manager.block_table(seq)) == expected[group.request_id] // (
                    group.max_seqs)
        tables = [b for g in running for s in g.seqs_with(SequenceStatus.RUNNING)
                  for b in driver.manager.block_table(s)]
        assert len(tables) == len(set(tables)), "reserved sequences share no block"
        driver.update(output)
    assert copies > 0
    driver.manager.end_step()  # commits the frees of the last step
    assert driver.manager.num_free_blocks == driver.manager.num_device_blocks
    assert driver.manager.spare_blocks == []


def test_a_reservation_larger_than_the_pool_is_never_admitted():
    driver = Driver(num_blocks=10)  # orca-oracle: prompt + output
    with pytest.raises(ValueError, match="'big'.*44 tokens = 11 blocks"):
        driver.add("big", 3, 41)
    driver.add("fits", 3, 37)
    driver.step()
    assert driver.held_blocks() == 10


def test_a_fork_beyond_the_reservation_is_refused():
    driver = Driver(num_blocks=20)
    group = driver.add("r0", 3, 5, n=2)
    driver.scheduler.schedule()  # the prompt's blocks: two reservations of 8 tokens
    parent = group.seqs[0]
    driver.manager.fork(parent, Sequence(100, parent.prompt_token_ids))
    with pytest.raises(ValueError, match="no blocks left for another sequence"):
        driver.manager.fork(parent, Sequence(101, parent.prompt_token_ids))
