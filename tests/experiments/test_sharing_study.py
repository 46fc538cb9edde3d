"""The sharing study's pools and its per-request reading, model-free: the simulator runs
the engine's scheduler and block manager, so what preempts there preempts on the engine."""

from __future__ import annotations

import dataclasses

import pytest

from experiments import sharing_study
from experiments.sharing_study import SharingSettings
from experiments.simulator import SimConfig, simulate

# Seed 0's 16 Alpaca-like requests at n = 6 are 96 sequences: more than the throughput
# pool holds at once with sharing (it preempts there), all of which the private pool holds.
SETTINGS = SharingSettings(num_requests=16)


def simulated(settings: SharingSettings, pool_tokens: int, kind: str, degree: int):
    requests = sharing_study.workload(settings, vocab_size=49152)
    requests = [dataclasses.replace(r, n=degree, beam_search=kind == "beam") for r in requests]
    return simulate(requests, SimConfig(
        block_size=settings.block_size, num_kv_slots=pool_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len))


@pytest.mark.parametrize("kind", sharing_study.KINDS)
@pytest.mark.parametrize("degree", sharing_study.DEGREES)
def test_the_private_pool_never_preempts(kind, degree):
    requests = sharing_study.workload(SETTINGS, vocab_size=49152)
    pool = sharing_study.private_pool_tokens(requests, SETTINGS)
    assert simulated(SETTINGS, pool, kind, degree).num_preemptions == 0


def test_the_throughput_pool_binds_where_the_memory_figure_must_not_be_taken():
    requests = sharing_study.workload(SETTINGS, vocab_size=49152)
    pool = sharing_study.throughput_pool_tokens(requests, SETTINGS)
    assert pool < sharing_study.private_pool_tokens(requests, SETTINGS)
    pressed = simulated(SETTINGS, pool, "parallel", 6)
    private = simulated(SETTINGS, sharing_study.private_pool_tokens(requests, SETTINGS),
                        "parallel", 6)
    # A preempted group is computed again one sequence at a time: it loses its sharing.
    assert pressed.num_preemptions > 0
    assert pressed.sharing_saved < private.sharing_saved


def test_common_prefix_counts_the_tokens_every_output_starts_with():
    assert sharing_study.common_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert sharing_study.common_prefix_len([[7, 8], [9, 8]]) == 0
    assert sharing_study.common_prefix_len([[4, 5, 6]]) == 3


def test_paper_ranges_ride_on_every_row():
    assert sharing_study.case_fields(SETTINGS, "beam", 4) == {
        "dataset": "alpaca", "kind": "beam", "degree": 4, "paper_memory_saved_pct": "37.6-55.2"}
    sharegpt = dataclasses.replace(SETTINGS, dataset="sharegpt")
    assert sharing_study.case_fields(sharegpt, "parallel", 2)["paper_memory_saved_pct"] \
        == "16.2-30.5"
