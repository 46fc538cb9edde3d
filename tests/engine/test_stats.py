"""EngineStats in constant memory: a long run's summary against numpy over every recorded value.

The recorder is fed through the duck-typed views an engine passes it (block
manager, scheduler, step plan), with random values; the oracle is numpy over
the full series, kept by the test, not by the code under test.
"""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from jpaged.core.scheduler_output import SchedulerStats
from jpaged.engine.stats import (
    LATENCY_WINDOW,
    CombinedStats,
    EngineStats,
    KVBlockCounts,
    LoRACounts,
)
from jpaged.memory.host_tier import HostPoolCounts
from jpaged.outputs import RequestMetrics

NUM_BLOCKS = 100


def _record_steps(stats: EngineStats, rng: np.random.Generator, num_steps: int,
                  num_blocks: int = NUM_BLOCKS, start: float = 1.0) -> dict:
    """Record num_steps random steps, the first at time `start`, on a pool of num_blocks;
    returns every recorded value by series."""
    used = rng.integers(0, num_blocks, num_steps)
    running = rng.integers(0, 64, num_steps)
    waiting = rng.integers(0, 300, num_steps)
    query_tokens = np.cumsum(rng.integers(0, 50, num_steps))
    hit_tokens = np.cumsum(rng.integers(0, 10, num_steps))
    for step in range(num_steps):
        stats.record_blocks(KVBlockCounts(total=num_blocks, physical=int(used[step]),
                                          logical=int(used[step]) + 3))
        queues = SchedulerStats(num_running=int(running[step]), num_waiting=int(waiting[step]),
                                num_swapped=0, num_preemptions=step)
        prefix_cache = SimpleNamespace(query_tokens=int(query_tokens[step]),
                                       hit_tokens=int(hit_tokens[step]), tier_hit_tokens=0)
        stats.record_step(SimpleNamespace(num_batched_tokens=8, adapter_loads=[]), queues,
                          prefix_cache, HostPoolCounts(), start + step, start + step + 0.5)
    return {"kv_utilization": used / num_blocks, "used": used,
            "pool": np.full(num_steps, num_blocks), "running": running, "waiting": waiting,
            "query_tokens": query_tokens, "hit_tokens": hit_tokens}


def _record_finished(stats: EngineStats, rng: np.random.Generator, num_requests: int
                     ) -> tuple[list[float], list[float], list[int]]:
    """Record num_requests finished requests of random timing; returns (ttfts, tpots,
    output token counts)."""
    ttfts, tpots, lengths = [], [], []
    for _ in range(num_requests):
        arrival, ttft, decode = rng.uniform(0, 100), rng.uniform(0, 2), rng.uniform(0, 5)
        num_tokens = int(rng.integers(1, 50))
        metrics = RequestMetrics(arrival, arrival + ttft, arrival + ttft + decode)
        stats.record_finished(metrics, [num_tokens])
        ttfts.append(metrics.first_token_time - metrics.arrival_time)
        lengths.append(num_tokens)
        if num_tokens > 1:
            tpots.append((metrics.finished_time - metrics.first_token_time) / (num_tokens - 1))
    return ttfts, tpots, lengths


def _expected_percentiles(values: list[float]) -> dict:
    window = np.asarray(values[-LATENCY_WINDOW:])
    return {"mean": pytest.approx(window.mean(), rel=1e-12),
            "p50": pytest.approx(np.percentile(window, 50), rel=1e-12),
            "p99": pytest.approx(np.percentile(window, 99), rel=1e-12)}


@pytest.mark.parametrize("num_requests", [50, LATENCY_WINDOW + 2500])
def test_summary_equals_numpy_over_the_recorded_values(num_requests):
    rng = np.random.default_rng(num_requests)
    stats = EngineStats()
    series = _record_steps(stats, rng, 3000)
    ttfts, tpots, _ = _record_finished(stats, rng, num_requests)
    summary = stats.summary()
    assert summary["steps"] == 3000 and summary["finished_requests"] == num_requests
    assert summary["kv_utilization_mean"] == pytest.approx(series["kv_utilization"].mean(),
                                                           rel=1e-12)
    assert summary["kv_utilization_peak"] == series["kv_utilization"].max()
    assert summary["running_mean"] == pytest.approx(series["running"].mean(), rel=1e-12)
    assert summary["running_peak"] == series["running"].max()
    assert summary["waiting_peak"] == series["waiting"].max()
    assert summary["preemptions"] == 2999
    assert summary["prefix_cache_hit_rate"] == pytest.approx(
        series["hit_tokens"][-1] / series["query_tokens"][-1], rel=1e-12)
    # Below the window every finished request counts; above it, the most recent ones.
    assert summary["ttft_s"] == _expected_percentiles(ttfts)
    assert summary["tpot_s"] == _expected_percentiles(tpots)


def test_replicas_summarize_as_numpy_over_all_their_recorded_values():
    """Data-parallel replicas (pools of different sizes, runs at different times, one
    idle) summarize as one: counts summed, step figures over all their steps together,
    KV use as blocks used over blocks of the pools stepped, latencies over all requests."""
    rng = np.random.default_rng(7)
    runs = [(100, 1.0, 300, 40), (60, 50.0, 500, 70), (100, 20.0, 0, 0)]
    replicas, series, ttfts, tpots, lengths = [], [], [], [], []
    for num_blocks, start, num_steps, num_requests in runs:
        stats = EngineStats()
        series.append(_record_steps(stats, rng, num_steps, num_blocks, start))
        replica_ttfts, replica_tpots, replica_lengths = _record_finished(stats, rng, num_requests)
        ttfts += replica_ttfts
        tpots += replica_tpots
        lengths += replica_lengths
        replicas.append(stats)
    summary = CombinedStats(tuple(replicas)).summary()

    def together(name: str) -> np.ndarray:
        return np.concatenate([s[name] for s in series])

    used, pool, logical = together("used"), together("pool"), together("used") + 3
    last_end = max(start + n - 0.5 for _, start, n, _ in runs if n)
    assert summary["steps"] == 800 and summary["finished_requests"] == 110
    assert summary["output_tokens"] == sum(lengths)
    assert summary["output_tokens_per_s"] == pytest.approx(sum(lengths) / (last_end - 1.0),
                                                           rel=1e-12)
    assert summary["kv_utilization_mean"] == pytest.approx(used.sum() / pool.sum(), rel=1e-12)
    assert summary["kv_utilization_peak"] == (used / pool).max()
    assert summary["running_mean"] == pytest.approx(together("running").mean(), rel=1e-12)
    assert summary["running_peak"] == together("running").max()
    assert summary["waiting_peak"] == together("waiting").max()
    assert summary["preemptions"] == 299 + 499
    final_hits = sum(s["hit_tokens"][-1] for s in series if len(s["hit_tokens"]))
    final_queries = sum(s["query_tokens"][-1] for s in series if len(s["query_tokens"]))
    assert summary["prefix_cache_hit_rate"] == pytest.approx(final_hits / final_queries,
                                                             rel=1e-12)
    assert summary["kv_blocks_logical_mean"] == pytest.approx(logical.mean(), rel=1e-12)
    assert summary["kv_blocks_physical_mean"] == pytest.approx(used.mean(), rel=1e-12)
    assert summary["kv_memory_saved"] == pytest.approx(1 - used.sum() / logical.sum(),
                                                       rel=1e-12)
    assert summary["ttft_s"] == _expected_percentiles(ttfts)
    assert summary["tpot_s"] == _expected_percentiles(tpots)


def test_an_empty_run_summarizes_to_zeros_and_nones():
    summary = EngineStats().summary()
    assert summary["kv_utilization_mean"] == summary["kv_utilization_peak"] == 0.0
    assert summary["running_peak"] == summary["waiting_peak"] == 0
    assert summary["ttft_s"] == {"mean": None, "p50": None, "p99": None}


def test_memory_does_not_grow_with_steps_or_requests():
    rng = np.random.default_rng(0)
    stats = EngineStats()
    tracemalloc.start()  # before the windows fill, so that what they hold is traced
    try:
        _record_steps(stats, rng, 1000)
        _record_finished(stats, rng, LATENCY_WINDOW + 500)
        after_first, _ = tracemalloc.get_traced_memory()
        _record_steps(stats, rng, 20_000)
        _record_finished(stats, rng, 20_000)
        after_more, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(stats.ttft) == len(stats.tpot) == LATENCY_WINDOW
    # 40 times the steps and requests: growth would be megabytes (a float per value).
    assert after_more - after_first < 64 * 1024, (after_first, after_more)


def test_lora_counts_of_two_replicas_keep_one_devices_slot_bytes():
    one = LoRACounts(slot_bytes=1000, slots_total=2, slots_loaded=1, loads=3, reads=1,
                     read_seconds=0.5, running={"a": 1}, waiting={"b": 2})
    other = LoRACounts(slot_bytes=1000, slots_total=2, slots_loaded=2, loads=1, reads=2,
                       read_seconds=0.25, running={"a": 2, "c": 1})
    both = one.add(other)
    assert both.slot_bytes == 1000  # each replica's device holds its own slots
    assert (both.slots_total, both.slots_loaded, both.loads, both.reads) == (4, 3, 4, 3)
    assert both.read_seconds == 0.75
    assert both.running == {"a": 3, "c": 1} and both.waiting == {"b": 2}
