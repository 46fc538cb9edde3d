"""The serving benchmark's load generator, short, against the tiny model's server: every
request completes, the metrics are consistent, and the HTTP outputs equal the offline
engine's (greedy), so the script cannot rot unnoticed."""

from __future__ import annotations

import json

import pytest

from benchmarks import serving
from tests.plugins.http_server import SERVER_API_KEY

# A benchmark run: the full tier.
pytestmark = pytest.mark.full


def test_quick_run_measures_every_rate_and_the_http_overhead(server, offline):
    base_url, _ = server
    argv = ["--quick", "--request-rates", "40,inf", "--scale", "0.05", "--overhead-runs", "1",
            "--max-model-len", "256", "--api-key", SERVER_API_KEY]
    args = serving.parse_args(argv)
    assert args.num_requests == 16
    header = serving.new_serving_report(argv)
    result = serving.report(header, args, serving.measure(args, base_url, offline))
    json.loads(json.dumps(result, allow_nan=False))  # strict JSON: no Infinity or NaN
    assert result["script"] == "benchmarks.serving"
    assert result["command"] == "python -m benchmarks.serving " + " ".join(argv)
    assert {"fastapi", "uvicorn", "openai"} <= set(result["versions"])
    workload = result["workload"]
    assert set(result["by_rate"]) == {"40.0", "inf"}
    for run in result["by_rate"].values():
        assert run["completed"] == 16
        assert run["output_tokens"] == round(16 * workload["mean_output_tokens"])
        assert run["request_throughput"] == pytest.approx(16 / run["duration_s"])
        assert run["output_tokens_per_s"] == pytest.approx(
            run["output_tokens"] / run["duration_s"])
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            latency = run[name]
            assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"], (name, latency)
        assert run["ttft_s"]["p99"] <= run["e2e_s"]["p99"]
        assert 0 < run["normalized_latency_s_per_token"] <= run["e2e_s"]["p99"]
    overhead = result["overhead"]
    assert len(overhead["runs"]) == 1 and overhead["greedy_mismatches"] == 0
    run = overhead["runs"][0]
    assert overhead["http_overhead_pct"] == pytest.approx(
        100 * (1 - run["http_output_tokens_per_s"] / run["offline_output_tokens_per_s"]))
    abort = result["abort_latency"]
    assert len(abort["trials_s"]) == serving.ABORT_TRIALS
    assert 0 < abort["median_s"] < 60
