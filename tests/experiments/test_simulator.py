"""The model-free simulator: no token lost under pressure, the paper's orderings, sharing."""

from __future__ import annotations

import csv
import json
import math

import pytest

from experiments import sweep
from experiments.simulator import SimConfig, simulate
from experiments.step_cost import StepShape
from experiments.workloads import RequestSpec, make_workload
from jpaged.core.step_shapes import default_buckets


def output_lengths_match(result, requests) -> bool:
    return all(
        len(result.outputs[r.request_id]) == r.n
        and all(len(tokens) == r.output_len for tokens in result.outputs[r.request_id])
        for r in requests
    )


@pytest.mark.parametrize(
    "pressure",
    [
        SimConfig(num_kv_slots=512, max_num_batched_tokens=256),
        SimConfig(num_kv_slots=512, block_size=8, enable_chunked_prefill=False),
        SimConfig(num_kv_slots=512, preemption_mode="swap", num_host_slots=4096),
        SimConfig(num_kv_slots=512, enable_prefix_caching=True, block_size=4),
    ],
)
def test_memory_pressure_changes_no_output(pressure):
    requests = [
        r for r in make_workload("alpaca", 120, request_rate=50.0, seed=1) if r.total_len <= 300
    ]
    roomy = simulate(requests, SimConfig(num_kv_slots=1 << 16))
    pressed = simulate(requests, pressure)
    assert roomy.num_preemptions == 0 and pressed.num_preemptions > 0
    assert pressed.num_finished == len(requests) and pressed.num_ignored == 0
    assert output_lengths_match(pressed, requests)
    assert pressed.outputs == roomy.outputs


def test_a_request_that_cannot_fit_is_ignored_and_the_rest_finish():
    requests = make_workload("alpaca", 120, request_rate=50.0, seed=1)
    too_long = [r.request_id for r in requests if r.total_len > 512]
    result = simulate(requests, SimConfig(num_kv_slots=512))
    assert len(too_long) == result.num_ignored == 1
    assert result.num_finished == len(requests) - 1 and too_long[0] not in result.outputs


@pytest.mark.parametrize("beam_search", [False, True])
def test_orca_on_blocks_serves_samples_and_beams_privately(beam_search):
    """Orca reserves a block table for each of a request's sequences and shares none:
    every sample or beam gets its length, and sharing saves nothing (the blocks held
    for sequences yet to fork even count against it)."""
    requests = make_workload("alpaca", 30, n=3, beam_search=beam_search, seed=2)
    result = simulate(requests, SimConfig(allocator="orca-oracle", num_kv_slots=4096,
                                          orca_blocks=True))
    assert result.num_finished == len(requests)
    assert output_lengths_match(result, requests)
    assert result.sharing_saved <= 0.0


@pytest.mark.parametrize("beam_search", [False, True])
def test_parallel_samples_and_beams_share_blocks(beam_search):
    requests = make_workload("alpaca", 60, n=4, beam_search=beam_search, seed=2)
    result = simulate(requests, SimConfig(num_kv_slots=4096))
    assert result.num_finished == len(requests)
    assert output_lengths_match(result, requests)
    assert 0.0 < result.sharing_saved < 1.0
    assert result.breakdown is None


def test_beams_save_more_than_parallel_samples():
    saved = {
        beam: simulate(make_workload("alpaca", 60, n=4, beam_search=beam, seed=2)).sharing_saved
        for beam in (False, True)
    }
    assert saved[True] > saved[False]


def test_beam_search_survives_pressure():
    requests = make_workload("alpaca", 40, n=4, beam_search=True, seed=3)
    result = simulate(requests, SimConfig(num_kv_slots=1024))
    assert result.num_preemptions > 0
    assert output_lengths_match(result, requests)


def test_figure2_orderings_on_sharegpt():
    requests = make_workload("sharegpt", 150, seed=0)
    results = {
        allocator: simulate(requests, SimConfig(allocator=allocator))
        for allocator in ("orca-max", "orca-pow2", "orca-oracle", "paged")
    }
    token_states = {a: r.breakdown.percentages()["token_states"] for a, r in results.items()}
    assert (
        token_states["orca-max"]
        < token_states["orca-pow2"]
        < token_states["orca-oracle"]
        < token_states["paged"]
    )
    for result in results.values():
        assert sum(result.breakdown.percentages().values()) == pytest.approx(100.0)
        assert output_lengths_match(result, requests)
    assert results["paged"].token_states_of_allocated >= 0.96
    assert results["orca-oracle"].breakdown.internal_fragmentation == 0
    assert results["orca-max"].num_preemptions == 0
    assert results["orca-max"].peak_running_seqs == 16384 // 2048
    assert results["paged"].mean_running_seqs > results["orca-oracle"].mean_running_seqs


@pytest.mark.parametrize("allocator", ["orca-pow2", "orca-oracle"])
@pytest.mark.parametrize("admitted", [3, 10])
def test_orca_slabs_as_the_paper_sizes_them(allocator, admitted):
    """An arena that holds exactly the first `admitted` requests' slabs, sized by hand
    (Pow2: the prompt plus the output rounded up to a power of two; Oracle: prompt
    plus output), runs exactly that many at once, and one more request waits."""
    def slots(r) -> int:
        if allocator == "orca-oracle":
            return r.total_len
        return len(r.prompt_token_ids) + 2 ** math.ceil(math.log2(r.output_len))

    workload = make_workload("alpaca", 40, seed=6)
    arena = sum(slots(r) for r in workload[:admitted])
    # The next request that fits the arena alone (a larger one would be refused).
    extra = next(r for r in workload[admitted:] if slots(r) <= arena)
    requests = [*workload[:admitted], extra]
    result = simulate(requests, SimConfig(allocator=allocator, num_kv_slots=arena))
    assert result.peak_running_seqs == admitted
    assert output_lengths_match(result, requests)


@pytest.mark.parametrize("allocator", ["orca-pow2", "orca-oracle"])
def test_orca_on_blocks_rounds_each_reservation_up_to_blocks(allocator):
    """orca_blocks: the engine's reserving blocks, each reservation in whole blocks (by
    hand as above, then rounded up to block_size 16); a pool one block short of the
    five requests' blocks never runs all five at once, where an arena of as many slots
    does (their slots fit)."""
    def blocks(r) -> int:
        reserved = r.total_len if allocator == "orca-oracle" else (
            len(r.prompt_token_ids) + 2 ** math.ceil(math.log2(r.output_len)))
        return math.ceil(reserved / 16)

    workload = make_workload("alpaca", 40, seed=6)[:5]
    pool = 16 * (sum(blocks(r) for r in workload) - 1)
    on_blocks = simulate(workload, SimConfig(allocator=allocator, num_kv_slots=pool,
                                             orca_blocks=True))
    on_slots = simulate(workload, SimConfig(allocator=allocator, num_kv_slots=pool))
    assert on_blocks.peak_running_seqs == 4
    assert on_slots.peak_running_seqs >= 5
    assert output_lengths_match(on_blocks, workload)


def test_the_clock_adds_each_steps_cost_of_its_shape():
    """One request of a 20-token prompt and 5 output tokens: a prefill step of the
    prompt, then 4 decode steps over 21..24 tokens; the clock is their costs' sum."""
    config = SimConfig(num_kv_slots=1024)
    result = simulate([RequestSpec("r", 0.0, tuple(range(20)), 5)], config)
    buckets = default_buckets("xla", 1, config.max_num_seqs)
    steps = [StepShape.of([20], [20], buckets, 16)] + [
        StepShape.of([1], [context], buckets, 16) for context in range(21, 25)]
    assert result.num_steps == 5
    assert result.simulated_s == pytest.approx(sum(config.step_cost.seconds(s) for s in steps))
    assert result.mean_normalized_latency_s == pytest.approx(result.simulated_s / 5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_peak_kv_slots_counts_the_growing_burst(block_size):
    """Requests that all arrive at once and all fit: the prefill step writes every
    prompt; decode step k writes token k of each request still running (it holds
    prompt + k slots, in whole blocks); the peak is the largest such sum."""
    requests = [RequestSpec(r.request_id, 0.0, r.prompt_token_ids, r.output_len)
                for r in make_workload("alpaca", 6, seed=7)]
    result = simulate(requests, SimConfig(block_size=block_size, num_kv_slots=1 << 16,
                                          max_num_batched_tokens=4096))

    def held(r, step: int) -> int:
        if step > r.output_len - 1:
            return 0
        return math.ceil((len(r.prompt_token_ids) + step) / block_size) * block_size

    longest = max(r.output_len for r in requests)
    expected = max(sum(held(r, step) for r in requests) for step in range(longest))
    assert result.num_preemptions == 0
    assert result.peak_kv_slots == expected


def test_prefix_caching_hits_the_shared_prefix():
    requests = make_workload("alpaca", 80, prefix="five-shot", seed=4)
    cached = simulate(requests, SimConfig(enable_prefix_caching=True))
    uncached = simulate(requests, SimConfig())
    prefix_share = 341 / (sum(len(r.prompt_token_ids) for r in requests) / len(requests))
    # The first request misses; the others hit the prefix's full blocks (336 tokens).
    assert 0.8 * prefix_share < cached.prefix_cache_hit_rate <= prefix_share
    assert cached.sharing_saved > 0.3
    assert uncached.prefix_cache_hit_rate is None and uncached.sharing_saved == 0.0
    assert cached.outputs == uncached.outputs


def test_timeline_and_summary():
    result = simulate(make_workload("alpaca", 300, request_rate=20.0, seed=5))
    times = [point["time_s"] for point in result.timeline]
    assert 0 < len(times) <= 200 and times == sorted(times)
    assert result.simulated_s >= times[-1]
    summary = result.summary()
    assert "outputs" not in summary and summary["config"]["allocator"] == "paged"
    assert summary["num_finished"] == 300


def test_bad_configurations():
    with pytest.raises(ValueError, match="allocator"):
        SimConfig(allocator="orca-min")
    with pytest.raises(ValueError, match="num_kv_slots"):
        SimConfig(num_kv_slots=8, block_size=16)
    with pytest.raises(ValueError, match="one sequence per request"):
        simulate(make_workload("alpaca", 2, n=2), SimConfig(allocator="orca-oracle"))


def test_sweep_writes_its_tables(tmp_path, capsys):
    sweep.main(
        "--studies memory --block-sizes 8,64 --sharegpt-requests 20 --alpaca-requests 30 "
        "--figure2-requests 20 "
        f"--sharing-requests 20 --num-kv-slots 4096 --jobs 1 --out-dir {tmp_path}".split()
    )
    printed = capsys.readouterr().out
    assert "Figure 2" in printed and "synthetic" in printed
    with (tmp_path / "sweep_block_size.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["workload"], r["block_size"]) for r in rows] == [
        (w, b) for w in ("sharegpt", "alpaca", "alpaca+one-shot") for b in ("8", "64")
    ]
    with (tmp_path / "sweep_figure2.csv").open() as f:
        figure2 = {r["system"]: r for r in csv.DictReader(f)}
    assert set(figure2) == {"orca-max", "orca-pow2", "orca-oracle", "paged"}
    assert float(figure2["paged"]["paper_token_states_pct"]) == 96.3
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert len(report["runs"]) == 6 + 4 + 8 + 3 + 4
    with (tmp_path / "sweep_window.csv").open() as f:
        window = {r["model"]: r for r in csv.DictReader(f)}
    assert set(window) == {"dense", "gemma3-like", "all-sliding"}
    with (tmp_path / "sweep_kv_dtype.csv").open() as f:
        by_dtype = {r["kv_dtype"]: r for r in csv.DictReader(f)}
    # One pool of 4096 float16 tokens of head_dim 128, in the bytes each dtype's token takes.
    assert {d: int(r["token_slots"]) for d, r in by_dtype.items()} == {
        "float32": 2048, "bfloat16": 4096, "int8": 4096 * 256 // 132,
        "fp8_e4m3": 4096 * 256 // 132}
    peaks = [int(by_dtype[d]["peak_running_seqs"]) for d in ("float32", "bfloat16", "int8")]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    timelines = json.loads((tmp_path / "sweep_timelines.json").read_text())
    assert len(timelines) == len(report["runs"]) and all(timelines)
    assert all("timeline" not in run for run in report["runs"])
