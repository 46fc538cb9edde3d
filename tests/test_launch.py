"""python -m jpaged.launch on plain Python processes (no JAX): what each process is
told, the exit status of a job, and how it ends processes that do not."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jpaged import launch

# A child that prints what it was told.
REPORT = ("import os; print(*(os.environ[name] for name in ('JPAGED_PROCESS_ID', "
          "'JPAGED_NUM_PROCESSES', 'JAX_COORDINATOR_ADDRESS', 'XLA_FLAGS')))")
SLEEP = "import time; time.sleep(60)"


def run_launcher(*args: str, env: dict | None = None, timeout: float = 60):
    command = [sys.executable, "-m", "jpaged.launch", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def exits(stderr: str) -> dict[int, int]:
    return {int(p): int(s) for p, s in re.findall(r"process (\d+) exited with status (\d+)",
                                                  stderr)}


@pytest.mark.full
def test_every_process_is_told_the_job(tmp_path):
    port = launch.free_port()
    result = run_launcher("--num-processes", "3", "--devices-per-process", "4", "--port",
                          str(port), "--log-dir", str(tmp_path), "--", "-c", REPORT,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=9 --xla_x=1"})
    assert result.returncode == 0, result.stderr
    assert exits(result.stderr) == {0: 0, 1: 0, 2: 0}
    for process in range(3):
        told = (tmp_path / f"process_{process}.log").read_text().split()
        assert told == [str(process), "3", f"127.0.0.1:{port}", "--xla_x=1",
                        "--xla_force_host_platform_device_count=4"]


@pytest.mark.full
def test_a_job_exits_with_its_first_failure():
    result = run_launcher("--num-processes", "3", "--", "-c",
                          "import os, sys, time; p = int(os.environ['JPAGED_PROCESS_ID']); "
                          "time.sleep(0.5 * p); sys.exit((0, 7, 9)[p])")
    assert result.returncode == 7, result.stderr
    assert exits(result.stderr) == {0: 0, 1: 7, 2: 9}
    assert "exit statuses [0, 7, 9]" in result.stderr


@pytest.mark.full
def test_processes_that_do_not_stop_after_a_failure_are_killed():
    started = time.monotonic()
    result = run_launcher("--num-processes", "2", "--stop-timeout", "1", "--", "-c",
                          "import os, sys, time; "
                          "sys.exit(5) if os.environ['JPAGED_PROCESS_ID'] == '1' else "
                          "time.sleep(60)")
    assert time.monotonic() - started < 30
    assert result.returncode == 5, result.stderr
    assert exits(result.stderr) == {0: 128 + signal.SIGKILL, 1: 5}
    assert "killing the processes that did not stop" in result.stderr


@pytest.mark.full
def test_a_job_past_its_timeout_is_killed():
    started = time.monotonic()
    result = run_launcher("--num-processes", "2", "--timeout", "1", "--", "-c", SLEEP)
    assert time.monotonic() - started < 30
    assert result.returncode == launch.TIMED_OUT, result.stderr
    assert exits(result.stderr) == {0: 128 + signal.SIGKILL, 1: 128 + signal.SIGKILL}


@pytest.mark.full
def test_a_signal_is_passed_on_to_every_process():
    command = [sys.executable, "-m", "jpaged.launch", "--num-processes", "2", "--", "-c",
               "import signal, sys, time; "
               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(11)); "
               "print('ready', flush=True); time.sleep(60)"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    # The two processes share the pipe: under load their lines can interleave.
    printed = ""
    while printed.count("ready") < 2:
        line = launcher.stdout.readline()
        assert line, f"the processes stopped before both were ready: {printed!r}"
        printed += line
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 11, stderr
    assert exits(stderr) == {0: 11, 1: 11}


@pytest.mark.parametrize("field, value", [("num_processes", 0), ("devices_per_process", -1),
                                          ("heartbeat_timeout_s", 0), ("timeout_s", 0.0),
                                          ("stop_timeout_s", -2.0)])
def test_a_bad_job_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be .*got {value}"):
        launch.LaunchConfig(("script.py",), **{field: value})


def test_a_job_needs_a_command():
    with pytest.raises(ValueError, match="a command to launch"):
        launch.LaunchConfig(())
    result = run_launcher("--num-processes", "2")
    assert result.returncode == 2 and "a command to launch" in result.stderr
