"""`python -m experiments.sweep --quick` writes every figure, table and JSON section,
and its numbers sit in the ranges the paper's mechanisms imply.

The bounds are consequences of the definitions, not the sweep's own output:
a share of the KV pool lies in (0, 100] %; rounding every sequence up to a whole
block can only waste more as blocks grow; a max_model_len reservation holds at
least as many slots as a true-length one; the simulator runs the engine's own
scheduler and block manager, so for paged allocation it must take the engine's
steps with the same running requests.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks import results_page
from experiments import sweep
from experiments.block_size_study import block_tables_for
from tests.test_docs import unaccounted_numbers

pytestmark = pytest.mark.default_model
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("sweep")
    sweep.main(["--quick", "--jobs", "1", "--out-dir", str(out_dir)])
    return out_dir, json.loads((out_dir / "sweep.json").read_text())


@pytest.mark.full
def test_every_figure_and_table_is_written(quick_sweep):
    out_dir, report = quick_sweep
    assert set(report["figures"]) == {
        "figure2_memory_breakdown.png", "block_size_simulator.png",
        "figure12_latency_vs_rate.png", "figure18_block_size_engine.png",
        "figure19_preemption_cost.png", "figures14_15_sharing.png",
        "accelerators_cpu_check.png", "accelerators_figure12_a100.png",
        "accelerators_projections.png"}
    for name in report["figures"]:
        assert (out_dir / name).read_bytes()[:8] == PNG_SIGNATURE
    for table in ("block_size", "figure2", "sharing", "window", "kv_dtype", "figure12",
                  "capacity", "validation", "figure18", "figure19_operations", "figure19_runs",
                  "kv_dtype_engine", "figures14_15", "accelerators_calibration",
                  "accelerators_rates", "accelerators_decode_steps", "accelerators_devices"):
        with (out_dir / f"sweep_{table}.csv").open() as f:
            assert list(csv.DictReader(f)), table
    assert report["versions"]["jax"] and report["args"]["quick"] == "True"
    assert set(report["study_wall_s"]) == set(sweep.DEFAULT_STUDIES)


@pytest.mark.full
def test_the_report_describes_its_run(quick_sweep):
    out_dir, report = quick_sweep
    assert report["script"] == "experiments.sweep"
    assert report["command"] == f"python -m experiments.sweep --quick --jobs 1 --out-dir {out_dir}"
    assert report["date"].endswith("+00:00")
    assert {"platform", "processor", "cpu_count", "load_average"} <= set(report["machine"])
    assert {"python", "jax", "jaxlib", "numpy", "flax", "jpaged", "matplotlib"} <= set(
        report["versions"])


@pytest.mark.full
def test_memory_shares_are_shares_and_orca_max_wastes_most(quick_sweep):
    _, report = quick_sweep
    figure2 = {r["config"]["allocator"]: r["breakdown_pct"] for r in report["runs"]
               if r["table"] == "figure2"}
    for breakdown in figure2.values():
        assert 0 < breakdown["token_states"] <= 100
        assert math.isclose(sum(breakdown.values()), 100.0, abs_tol=1e-6)
    assert figure2["orca-max"]["internal_fragmentation"] > \
        figure2["orca-oracle"]["internal_fragmentation"]
    assert figure2["orca-max"]["token_states"] < figure2["orca-oracle"]["token_states"] \
        < figure2["paged"]["token_states"]


@pytest.mark.full
def test_internal_fragmentation_grows_with_block_size(quick_sweep):
    _, report = quick_sweep
    for dataset in ("sharegpt", "alpaca"):
        rows = sorted((r["config"]["block_size"], r["breakdown_pct"]["internal_fragmentation"])
                      for r in report["runs"]
                      if r["table"] == "block_size" and r["dataset"] == dataset
                      and not r["workload"])
        fragmentation = [frag for _, frag in rows]
        assert fragmentation == sorted(fragmentation), rows


@pytest.mark.full
def test_engine_rate_study_is_in_sane_ranges(quick_sweep):
    _, report = quick_sweep
    result = report["figure12"]["sharegpt"]
    for policy, points in result["curves"].items():
        rates = [p["request_rate"] for p in points]
        assert rates == sorted(rates) and rates[0] > 0, policy
        assert 1.0 in [p["capacity_fraction"] for p in points], policy
        for point in points:
            assert 0 < point["mean_kv_utilization_pct"] <= 100, (policy, point)
            assert point["normalized_latency_s_mean"] > 0
    for key in ("rate_ratio_vs_orca_oracle", "rate_ratio_vs_orca_max"):
        assert report[key] > 0 and report[key + "_bound"] in (
            "interpolated", "at least", "at most", "unknown")


@pytest.mark.full
def test_capacity_falls_with_what_a_policy_reserves(quick_sweep):
    # All queued at once on one pool: the quick burst fits whole in it for paged and
    # Oracle (the pool is sized for 16 mean requests), so paged takes no more steps;
    # Max reserves max_model_len, which the pool holds once, so it takes more.
    _, report = quick_sweep
    result = report["figure12"]["sharegpt"]
    at_once, capacity = result["all_at_once"], result["capacity_requests_per_s"]
    steps = [at_once[policy]["num_steps"] for policy in ("paged", "orca-oracle", "orca-max")]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    assert capacity["orca-max"] < capacity["orca-oracle"]
    assert at_once["orca-max"]["mean_kv_utilization_pct"] \
        > at_once["orca-oracle"]["mean_kv_utilization_pct"]
    assert report["capacity_ratio_vs_orca_max"] > 1
    assert set(result["capacity_ratios"]) == {
        "capacity_ratio_vs_orca_oracle", "capacity_ratio_vs_orca_pow2",
        "capacity_ratio_vs_orca_max"}


@pytest.mark.full
def test_kv_dtype_study_buys_each_dtype_the_tokens_its_bytes_hold(quick_sweep):
    """SmolLM2 (30 layers, 3 KV heads of 64): K and V of a token, with int8's float32
    scale per head; one pool of bytes, so int8 holds 256 / 68 of float32's tokens."""
    _, report = quick_sweep
    result = report["kv_dtype"]
    assert result["bytes_per_token"] == {"float32": 2 * 30 * 3 * 64 * 4,
                                         "bfloat16": 2 * 30 * 3 * 64 * 2,
                                         "int8": 2 * 30 * 3 * (64 + 4)}
    assert {d: result["pool_bytes"] // b for d, b in result["bytes_per_token"].items()} \
        == result["pool_tokens"]
    for dtype, points in result["curves"].items():
        rates = [p["request_rate"] for p in points]
        assert rates == sorted(rates) and rates[0] > 0, dtype
    assert set(result["rate_ratios_vs_float32"]) == {"bfloat16", "int8"}
    at_once = result["all_at_once"]
    assert at_once["int8"]["peak_running_requests"] >= at_once["float32"]["peak_running_requests"]


@pytest.mark.full
def test_simulator_follows_the_engine_under_paging(quick_sweep):
    _, report = quick_sweep
    paged = report["validation"]["sharegpt"]["paged"]
    assert paged["num_steps"]["simulator"] == paged["num_steps"]["engine"]
    assert abs(report["sim_vs_engine_gap_pct"]["paged"]) <= 5.0
    assert set(report["sim_vs_engine_gap_pct"]) == {"paged", "orca-oracle"}


@pytest.mark.full
def test_block_size_and_sharing_studies_are_in_sane_ranges(quick_sweep):
    _, report = quick_sweep
    assert [r["block_size"] for r in report["figure18"]] == [8, 32]
    for row in report["figure18"]:
        assert row["attention_s_per_step"] > 0 and row["normalized_latency_s_mean"] > 0
    for row in report["figure19"]["runs"]:
        # The pool is half of what the burst holds at its peak: both modes preempt.
        for mode in ("recompute", "swap"):
            assert row[mode]["virtual_s"] > 0 and row[mode]["num_preemptions"] > 0
    assert [r["block_size"] for r in report["figure19"]["operations"]] == [8, 32]
    for ops in report["figure19"]["operations"]:
        assert ops["blocks"] == math.ceil(ops["tokens"] / ops["block_size"])
        assert min(ops["swap_out_s"], ops["swap_in_s"], ops["recompute_s"]) > 0
    saved = {r["kind"]: r["memory_saved_pct"] for r in report["figures14_15"]}
    assert 0 < saved["parallel"] < saved["beam"] < 100
    for row in report["figures14_15"]:
        # Memory saved comes from a run nothing preempted: the throughput run with
        # sharing, or else a run on the pool that holds every sequence privately.
        if row["preemptions_sharing"] == 0:
            assert row["memory_pool_tokens"] == row["pool_tokens"]
        else:
            assert row["memory_pool_tokens"] > row["pool_tokens"]
        requests = row["by_request"]
        assert len(requests) == 3
        assert math.isclose(sum(r["block_steps_share_pct"] for r in requests), 100.0)
        assert all(0 <= r["memory_saved_pct"] < 100 for r in requests)
        assert all(0 <= r["common_output_prefix"] <= r["output_len"] for r in requests)


@pytest.mark.full
def test_accelerators_study_is_in_sane_ranges(quick_sweep):
    """Fractions of a peak lie in (0, 1]; a step's modelled time grows with its batch; the
    paper's pool is Figure 1's 30% of 40 GiB over OPT-13B's 2 x 40 layers x 5,120 x 2
    bytes a token; every policy's search brackets on ascending rates; the engine steps
    it was fitted to are all the rate study's, each run's log in sweep_steps.json."""
    out_dir, report = quick_sweep
    section = report["accelerators"]
    for phase in ("decode", "prefill"):
        fitted = section["calibration"]["calibration"][phase]
        assert 0 < fitted["compute"] <= 1 and 0 < fitted["bandwidth"] <= 1, phase
        assert fitted["overhead_s"] > 0
        error = section["calibration"]["held_out_error"][phase]
        assert error["num_steps"] > 0 and 0 <= error["median_pct"] <= error["p90_pct"], phase
    scenarios = section["scenarios"]
    assert scenarios["a100-opt13b-sharegpt"]["pool_tokens"] == int(
        0.30 * 40 * 2**30 // (2 * 40 * 5120 * 2))
    for name, result in scenarios.items():
        steps = list(result["decode_step_ms"].values())
        assert steps == sorted(steps) and steps[0] > 0, name
        for policy, points in result["curves"].items():
            rates = [p["request_rate"] for p in points]
            assert rates == sorted(rates) and rates[0] > 0, (name, policy)
            assert all(p["normalized_latency_s_mean"] > 0 for p in points)
        assert result["capacity_requests_per_s"]["orca-max"] \
            <= result["capacity_requests_per_s"]["paged"], name
    assert {d["source"] != "" for d in section["devices"].values()} == {True}
    assert 0 < report["study_wall_s"]["accelerators"] < report["wall_s"]
    steps = json.loads((out_dir / "sweep_steps.json").read_text())
    engine_steps = sum(len(columns["seconds"]) for columns in steps.values())
    assert section["calibration"]["num_steps"] <= engine_steps
    assert section["calibration"]["num_runs"] == sum(1 for key in steps if key.startswith(
        "figure12."))


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_block_tables_for_lay_out_every_context_on_distinct_blocks(block_size):
    context_lens = np.array([0, 1, 17, 300, 256, 5], np.int32)
    tables, num_blocks = block_tables_for(context_lens, block_size, np.random.default_rng(1))
    needed = [math.ceil(c / block_size) for c in context_lens]
    assert num_blocks == sum(needed) + 1
    assert tables.shape[1] >= max(needed) and tables.shape[1] & (tables.shape[1] - 1) == 0
    used = np.concatenate([row[:n] for row, n in zip(tables, needed, strict=True)])
    assert sorted(used) == list(range(1, num_blocks))  # each pool block once, none null
    assert all((row[n:] == 0).all() for row, n in zip(tables, needed, strict=True))


@pytest.mark.full
def test_the_results_page_places_the_quick_sweep(quick_sweep, tmp_path):
    out_dir, _ = quick_sweep
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(out_dir / "sweep.json", data / "sweep.json")
    reports = results_page.load_reports(data)
    page = results_page.render(reports)
    for title in ("Figure 2 in simulation", "Figure 12 on the engine", "Figure 18 on the engine",
                  "Figure 12 in simulation: sustained request rates under the rate study's rules",
                  "Figure 19 (a) on the engine", "Figures 14 and 15 on the engine", "Summary"):
        assert f"### {title}" in page
    assert unaccounted_numbers(page, reports) == []
    assert unaccounted_numbers(page + "| 12345.678 |\n", reports) == ["12345.678"]


@pytest.mark.full
def test_the_results_page_refuses_a_report_it_cannot_place(quick_sweep, tmp_path):
    out_dir, report = quick_sweep
    (tmp_path / "unknown.json").write_text(json.dumps(report | {"script": "benchmarks.nope"}))
    with pytest.raises(results_page.UnplacedResult, match="benchmarks.nope"):
        results_page.load_reports(tmp_path)
    undescribed = {key: value for key, value in report.items() if key != "date"}
    (tmp_path / "unknown.json").write_text(json.dumps(undescribed))
    with pytest.raises(results_page.UnplacedResult, match="no date"):
        results_page.load_reports(tmp_path)
