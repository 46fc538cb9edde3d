"""What every benchmark's JSON report carries beside its figures, and its progress lines.

A report starts as `new_report(script)` when the run starts, so that its date
and load average describe the machine the measurements met, and the benchmark
adds its figures to it:

    {"script": "benchmarks.scheduler",
     "command": "python -m benchmarks.scheduler --steps 40",
     "date": "2026-01-01T12:00:00+00:00",          # UTC, when the run started
     "machine": {"platform", "processor", "cpu_count", "usable_cpu_count",
                 "load_average"},                   # 1, 5 and 15 min, at the start
     "versions": {"python", "jax", "jaxlib", "numpy", "flax", "jpaged",
                  ...the peers the benchmark runs}, # "jpaged": the git revision
     ...figures}

`record_end_load` adds "load_average_end" to the machine where a benchmark
reports the load after its runs too. `python -m experiments.sweep` starts its
sweep.json the same way; benchmarks.results_page places each report by these keys.
It lives in experiments/ because the studies use it too, and imports run downward:
benchmarks/ may import experiments/, never the other way.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jax", "jaxlib", "numpy", "flax")


def progress(message: str) -> None:
    """One line on stderr, flushed: stdout holds the JSON report alone."""
    print(message, file=sys.stderr, flush=True)


def git_revision() -> str | None:
    """This tree's commit, "-dirty" when it has uncommitted changes; None outside git."""
    try:
        described = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=40"],
            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return described.stdout.strip() or None


def versions(peers: Sequence[str] = ()) -> dict:
    """Python's, jpaged's revision and the installed packages' versions (None if absent):
    JAX's stack and the `peers` a benchmark measures against (torch, transformers, ...)."""
    found: dict = {"python": platform.python_version()}
    for name in (*PACKAGES, *peers):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    found["jpaged"] = git_revision()
    return found


def machine() -> dict:
    """The host, and its load average (1, 5 and 15 min) now."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpu_count": len(usable) if usable is not None else os.cpu_count(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }


def new_report(script: str, argv: Sequence[str] | None = None,
               peers: Sequence[str] = ()) -> dict:
    """The report's common part, taken now. script: the module run with `python -m`;
    argv: its arguments (default sys.argv[1:]); peers: packages the benchmark runs
    beside JAX's (their versions are recorded)."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    return {
        "script": script,
        "command": shlex.join(["python", "-m", script, *arguments]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(peers),
    }


def record_end_load(report: dict) -> None:
    """The load average once the runs are done, beside the one at the start."""
    report["machine"]["load_average_end"] = [round(load, 2) for load in os.getloadavg()]


def call_seconds(call: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of call() (which waits for its result), after one
    untimed call that compiles."""
    call()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return seconds
