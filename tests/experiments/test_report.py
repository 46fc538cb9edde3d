"""experiments.report: every benchmark's JSON starts with the run's description, under
the keys the results page reads."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from benchmarks.results_page import RUN_KEYS
from experiments.report import new_report, record_end_load


def test_a_new_report_describes_the_run_under_the_results_page_keys():
    report = new_report("benchmarks.scheduler", ["--steps", "3", "two words"],
                        peers=("numpy", "no-such-package"))
    assert tuple(report) == RUN_KEYS
    assert report["script"] == "benchmarks.scheduler"
    assert report["command"] == "python -m benchmarks.scheduler --steps 3 'two words'"
    started = datetime.fromisoformat(report["date"])
    assert started.utcoffset() == timedelta(0)
    machine = report["machine"]
    assert {"platform", "processor", "cpu_count", "load_average"} <= set(machine)
    assert len(machine["load_average"]) == 3 and machine["cpu_count"] >= 1
    versions = report["versions"]
    assert {"python", "jax", "jaxlib", "numpy", "flax", "jpaged"} <= set(versions)
    assert versions["jax"] and versions["no-such-package"] is None
    json.dumps(report, allow_nan=False)


def test_the_end_load_sits_beside_the_start_load():
    report = new_report("benchmarks.cli_start", [])
    record_end_load(report)
    assert report["command"] == "python -m benchmarks.cli_start"
    assert len(report["machine"]["load_average_end"]) == 3
