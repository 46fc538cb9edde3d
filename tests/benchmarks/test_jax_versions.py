"""benchmarks.jax_versions: the two sides' medians and ratios, and a quick run with this
interpreter on both sides (two worker processes)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import jax_versions


def test_each_side_is_the_median_of_its_workers_and_b_over_a_their_ratio():
    def worker(value):
        return {"figures": dict.fromkeys(jax_versions.FIGURES, value)}

    runs = {"A": [worker(2.0), worker(4.0), worker(3.0)],
            "B": [worker(9.0), worker(6.0), worker(1.0)]}
    results = jax_versions.compare(runs)
    assert set(results) == set(jax_versions.FIGURES)
    for row in results.values():
        assert (row["A"], row["B"], row["B_over_A"]) == (3.0, 6.0, 2.0)
        assert row["A_runs"] == [2.0, 4.0, 3.0] and row["B_runs"] == [9.0, 6.0, 1.0]


@pytest.mark.full
def test_quick_run_against_this_interpreter():
    report = jax_versions.main(["--quick", "--other-python", sys.executable])
    json.loads(json.dumps(report, allow_nan=False))
    assert report["sides"]["A"]["versions"] == report["sides"]["B"]["versions"]
    for row in report["results"].values():
        assert row["A"] > 0 and row["B"] > 0 and len(row["A_runs"]) == 1
    assert "load_average_end" in report["machine"]
