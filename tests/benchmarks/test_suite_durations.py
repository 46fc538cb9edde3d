"""benchmarks.suite_durations on one small test module: the report counts its tests and
adds their times up."""

from __future__ import annotations

import pytest

from benchmarks import suite_durations

MODULE = "tests/memory/test_prefix_cache.py"


@pytest.mark.full
def test_a_run_of_one_module_counts_and_times_its_tests(capsys):
    report = suite_durations.main(["--slowest", "3", "--", MODULE])
    capsys.readouterr()
    assert report["pytest_exit_code"] == 0
    assert report["tests"] == report["passed"] > 0
    assert report["failures"] == report["errors"] == 0
    assert list(report["files_s"]) == [MODULE]
    assert len(report["slowest_s"]) == 3
    assert all(name.startswith(MODULE + "::") for name in report["slowest_s"])
    assert report["files_s"][MODULE] == pytest.approx(report["test_s"], abs=0.1)
    assert 0 < report["test_s"] <= report["wall_s"]
