"""The pieces of jpaged.engine.lockstep that one process can check: which layouts of
replicas over processes run, the digest of a plan, and the gathers (over one process,
the identity). tests/test_multihost.py runs them across processes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.engine import lockstep
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.block_table import BlockTable
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup


@pytest.mark.parametrize("holders, num_processes", [
    ([{0}, {1}], 2),                 # a replica per process
    ([{0}, {0}, {1}, {1}], 2),       # two per process
    ([{0, 1}], 2),                   # one across both
    ([{0, 1}, {2, 3}], 4),           # two, each across two
])
def test_layouts_that_run(holders, num_processes):
    lockstep.check_replica_processes(holders, num_processes)


@pytest.mark.parametrize("holders, num_processes, message", [
    ([{0, 1}, {1}], 2, r"replica 0 spans processes \[0, 1\] and shares them with replicas \[1\]"),
    ([{0}, {0}, {1}], 2, r"as many replicas .* \{0: 2, 1: 1\}"),
    ([{0}], 2, r"at least one; replicas per process: \{0: 1, 1: 0\}"),
])
def test_layouts_that_cannot_run_name_the_replicas(holders, num_processes, message):
    with pytest.raises(ValueError, match=message):
        lockstep.check_replica_processes(holders, num_processes)


@pytest.mark.parametrize("length", [0, 1, 1023, 1024, 1025, 4096, 70000])
def test_payloads_travel_in_the_smallest_power_of_two_that_holds_them(length):
    bucket = lockstep.padded_bytes(length)
    candidates = [2**k for k in range(32) if 2**k >= max(length, lockstep.MIN_PAYLOAD_BYTES)]
    assert bucket == candidates[0]


def planned(prompts: list[list[int]]):
    """The first plan of a scheduler given these prompts, and its block tables."""
    manager = BlockManager(CacheConfig(block_size=4, num_blocks=32))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                          max_model_len=64), manager)
    for index, prompt in enumerate(prompts):
        scheduler.add_request(SequenceGroup(str(index), [Sequence(0, prompt)],
                                            SamplingParams(max_tokens=4)))
    return scheduler.schedule(), manager.block_tables


def test_plans_alike_have_one_digest_and_any_difference_changes_it():
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    plan, tables = planned(prompts)
    digest = lockstep.schedule_digest(plan, tables)
    assert len(digest) == lockstep.DIGEST_BYTES
    assert lockstep.schedule_digest(*planned(prompts)) == digest  # another scheduler
    assert lockstep.schedule_digest(*planned([[1, 2, 3, 4, 9], [6, 7, 8]])) != digest
    assert lockstep.schedule_digest(*planned([[6, 7, 8], [1, 2, 3, 4, 5]])) != digest
    assert lockstep.schedule_digest(*planned(prompts[:1])) != digest

    def moved(seq):  # the same blocks but the last one elsewhere in the pool
        table = list(tables(seq)[0])
        return (BlockTable(table[:-1] + [table[-1] + 10]),)

    assert lockstep.schedule_digest(plan, moved) != digest


def test_a_process_group_of_one_gathers_its_own_rows():
    group = lockstep.ProcessGroup(jax.devices())
    assert group.processes == [0]
    row = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(group.allgather(row), row[None])
    for payload in (b"", b"x", bytes(range(256)) * 5):
        assert group.allgather_bytes(payload) == [payload]

