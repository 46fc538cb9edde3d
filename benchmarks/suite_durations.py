"""Where the test suite's time goes: one tier run, its wall time and slowest tests.

    python -m benchmarks.suite_durations [--full] [--cold] [--python PATH] [--slowest 30]
                                         [-- PYTEST ARGUMENTS]

Runs `python -m pytest -q` (with `--full`, every test) in a process of its own under
the given interpreter, with pytest's JUnit XML report, and prints one JSON object:
the wall time, the tests passed, failed and deselected, each test file's total and
the slowest tests (setup, call and teardown together), beside the load average
before and after (the machine is shared: rerun when it is above 1). `--cold` starts
the run from an empty compilation cache (`JPAGED_TEST_COLD=1`), as a new machine
would; without it the run reads the cache the suite keeps under ~/.cache. Arguments
after `--` go to pytest (a directory, `-k`, ...). Keep a run under docs/data/ to
compare a change's run with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from experiments.report import REPO, new_report, progress, record_end_load


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full tier (every test)")
    parser.add_argument("--cold", action="store_true",
                        help="from an empty compilation cache (JPAGED_TEST_COLD=1)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter to run the tests with (default: this one)")
    parser.add_argument("--slowest", type=int, default=30, help="how many tests to list")
    parser.add_argument("--timeout", type=float, default=5400,
                        help="seconds the run may take before it is stopped")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    return parser.parse_args(argv)


def run_tier(args: argparse.Namespace, junit: Path) -> tuple[float, int]:
    """Run the tier, pytest's output to stderr -> (wall seconds, pytest's exit code)."""
    command = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *(["--full"] if args.full else []), *args.pytest_args]
    env = dict(os.environ, JPAGED_TEST_COLD="1" if args.cold else "0")
    started = time.perf_counter()
    # pytest's output to file descriptor 2: stdout holds the report alone.
    result = subprocess.run(command, cwd=REPO, env=env, stdout=2, timeout=args.timeout)
    return time.perf_counter() - started, result.returncode


def case_times(junit: Path) -> dict[str, float]:
    """{test id: seconds} from a JUnit XML report (pytest puts setup, call and teardown
    in each testcase's time)."""
    times = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        times[f"{path}.py::{case.get('name')}"] = float(case.get("time", 0))
    return times


def outcomes(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot().find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors",
                                                       "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] \
        - counts["skipped"]
    return counts


def by_file(times: dict[str, float]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for test_id, seconds in times.items():
        totals[test_id.split("::")[0]] += seconds
    return {path: round(total, 1) for path, total in
            sorted(totals.items(), key=lambda item: -item[1])}


def interpreter_versions(python: str) -> dict:
    """The versions of the interpreter the tests ran under (it may not be this one)."""
    script = ("import json, platform; from importlib.metadata import version; "
              "print(json.dumps({'python': platform.python_version(), "
              "**{n: version(n) for n in ('jax', 'jaxlib', 'flax', 'numpy', 'torch', "
              "'transformers')}}))")
    found = subprocess.run([python, "-c", script], capture_output=True, text=True,
                           check=True, timeout=120)
    return json.loads(found.stdout)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = new_report("benchmarks.suite_durations", argv)
    report["versions"].update(interpreter_versions(args.python))
    report["settings"] = {"tier": "full" if args.full else "fast", "cold": args.cold,
                          "pytest_args": args.pytest_args}
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        progress(f"running the {report['settings']['tier']} tier")
        wall, status = run_tier(args, junit)
        record_end_load(report)
        times = case_times(junit)
        report |= {"wall_s": round(wall, 1), "pytest_exit_code": status, **outcomes(junit),
                   "test_s": round(sum(times.values()), 1), "files_s": by_file(times),
                   "slowest_s": {test_id: round(seconds, 2) for test_id, seconds in
                                 sorted(times.items(), key=lambda item: -item[1])
                                 [:args.slowest]}}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
