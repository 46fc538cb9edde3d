"""Several JAX processes on one machine, joined as one multi-controller job.

    python -m jpaged.launch --num-processes 2 --devices-per-process 4 -- script.py ARGS
    python -m jpaged.launch --num-processes 2 -- -m jpaged generate --distributed "Hi"

starts the command once per process, each on the host's CPU with its own
`devices_per_process` simulated devices, with the environment `initialize()`
reads (the coordinator's address on loopback, the number of processes, this
process's id). A script calls `jpaged.launch.initialize()` before anything
else touches JAX; the CLI's `--distributed` does it. Then `jax.devices()` lists
every process's devices and a mesh over them spans the processes: the path a
TPU pod slice or several GPU hosts take, short of the interconnect
(docs/multihost.md).

The launcher waits for every process. When one fails, the others get
`--stop-timeout` seconds (by default the heartbeat timeout and a margin) to stop
on their own (JAX's coordination service notices a dead peer and stops them),
then are killed; `--timeout` kills them all. It exits with the first failure's
status (128 + N for signal N), 124 on a timeout, 0 when every process ended well.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ADDRESS = "JAX_COORDINATOR_ADDRESS"
PROCESS_ID = "JPAGED_PROCESS_ID"
NUM_PROCESSES = "JPAGED_NUM_PROCESSES"
HEARTBEAT_TIMEOUT = "JPAGED_HEARTBEAT_TIMEOUT"
# Seconds without a peer's heartbeat before JAX's coordination service declares it dead,
# in a job on one machine (JAX's default, for hosts, is longer).
DEFAULT_HEARTBEAT_TIMEOUT_S = 10
# Seconds, beyond the heartbeat timeout, the others get to stop after one fails.
STOP_MARGIN_S = 30
TIMED_OUT = 124
POLL_S = 0.1


LOGGING_LEVEL = "JPAGED_LOGGING_LEVEL"


class NotLaunchedError(RuntimeError):
    """initialize() found no job to join."""


def initialize() -> bool:
    """Join the job `python -m jpaged.launch` (or a host's own launcher) described in the
    environment: `jax.distributed.initialize` with the coordinator address
    (JAX_COORDINATOR_ADDRESS), JPAGED_NUM_PROCESSES and JPAGED_PROCESS_ID, and
    JPAGED_HEARTBEAT_TIMEOUT (seconds; JAX's default where unset). Where the first
    three are unset (a TPU pod slice, a cluster JAX detects),
    `jax.distributed.initialize()` finds them itself; NotLaunchedError where it finds
    no job either. Returns whether this process is process 0.

    Processes other than process 0 log (logger "jpaged") at warning level, so one
    process reports the job; JPAGED_LOGGING_LEVEL (e.g. INFO) sets every process's."""
    import jax

    kwargs = {}
    if NUM_PROCESSES in os.environ:
        kwargs = dict(coordinator_address=os.environ[ADDRESS],
                      num_processes=int(os.environ[NUM_PROCESSES]),
                      process_id=int(os.environ[PROCESS_ID]))
    if HEARTBEAT_TIMEOUT in os.environ:
        kwargs["heartbeat_timeout_seconds"] = int(os.environ[HEARTBEAT_TIMEOUT])
    # CPU devices of different processes reach each other through gloo (no effect on
    # accelerators; asking for the backend here would start it too early).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as error:  # JAX found no coordinator: no launcher, no cluster
        raise NotLaunchedError(
            "no job of several processes to join: start the command with python -m "
            "jpaged.launch (python -m jpaged.launch --num-processes 2 -- -m jpaged generate "
            "--distributed ...), which sets JAX_COORDINATOR_ADDRESS, JPAGED_NUM_PROCESSES "
            "and JPAGED_PROCESS_ID, or set them on every host yourself; on one process, "
            f"leave out --distributed ({error})") from None
    if jax.default_backend() == "cpu":
        # On jax 0.12 a CPU step loaded from the compilation cache on disk never finishes
        # its cross-process collectives (a second run of a job hangs); 0.10.2 is unaffected.
        jax.config.update("jax_enable_compilation_cache", False)
    is_first = jax.process_index() == 0
    _set_log_level(is_first)
    return is_first


def _set_log_level(is_first: bool) -> None:
    """Process 0 logs at info level, the others at warning, unless JPAGED_LOGGING_LEVEL says."""
    level = os.environ.get(LOGGING_LEVEL, "INFO" if is_first else "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{LOGGING_LEVEL}={level!r} is no logging level: give DEBUG, INFO, "
                         "WARNING or ERROR")
    logging.getLogger("jpaged").setLevel(level)


@dataclass(frozen=True)
class LaunchConfig:
    """One loopback job: `command` (the arguments after `python`) run num_processes
    times, each process with devices_per_process CPU devices.

    log_dir: write process i's output to log_dir/process_i.log (else every process
    writes to this terminal). timeout_s: kill every process after this many
    seconds (None: no limit). heartbeat_timeout_s: JPAGED_HEARTBEAT_TIMEOUT.
    stop_timeout_s: once a process failed, seconds the others get to stop on their
    own before they are killed (None: heartbeat_timeout_s + STOP_MARGIN_S).
    """

    command: tuple[str, ...]
    num_processes: int = 2
    devices_per_process: int = 1
    port: int | None = None
    log_dir: Path | None = None
    timeout_s: float | None = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    stop_timeout_s: float | None = None

    def __post_init__(self):
        if not self.command:
            raise ValueError("a command to launch is needed (a script and its arguments, "
                             "or -m module)")
        for name in ("num_processes", "devices_per_process", "heartbeat_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("timeout_s", "stop_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def stop_after_failure_s(self) -> float:
        if self.stop_timeout_s is not None:
            return self.stop_timeout_s
        return self.heartbeat_timeout_s + STOP_MARGIN_S


def free_port() -> int:
    """A TCP port on loopback that no one listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_env(config: LaunchConfig, process_id: int, port: int,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """Process `process_id`'s environment: `base` (by default this one's) with the job's
    variables and its simulated CPU devices."""
    env = dict(os.environ if base is None else base)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={config.devices_per_process}")
    env.update({
        "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu",
        ADDRESS: f"127.0.0.1:{port}", NUM_PROCESSES: str(config.num_processes),
        PROCESS_ID: str(process_id), HEARTBEAT_TIMEOUT: str(config.heartbeat_timeout_s),
    })
    return env


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def _report(message: str) -> None:
    print(f"jpaged.launch: {message}", file=sys.stderr, flush=True)


def check_command(command: tuple[str, ...]) -> None:
    """Warn when the command runs jpaged's CLI without --distributed: each process would
    run a separate copy of the whole job instead of joining one."""
    if command[:2] == ("-m", "jpaged") and "--distributed" not in command:
        _report("warning: the command has no --distributed: every process runs its own "
                "copy of it instead of joining one job (add --distributed after the "
                "subcommand)")


def launch(config: LaunchConfig) -> int:
    """Run the job and wait for it; its exit status (see the module docstring)."""
    check_command(config.command)
    port = config.port or free_port()
    if config.log_dir is not None:
        Path(config.log_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    processes, logs = [], []
    for process_id in range(config.num_processes):
        log = None
        if config.log_dir is not None:
            log = open(Path(config.log_dir) / f"process_{process_id}.log", "wb")  # noqa: SIM115
            logs.append(log)
        processes.append(subprocess.Popen(
            [sys.executable, *config.command], env=process_env(config, process_id, port),
            stdout=log, stderr=subprocess.STDOUT if log else None))
    try:
        return _wait(processes, config, started)
    finally:
        for log in logs:
            log.close()


def _wait(processes: list[subprocess.Popen], config: LaunchConfig, started: float) -> int:
    """Poll until every process ended, reporting each exit; after a failure the others get
    `stop_after_failure_s`, then are killed, as all are on the timeout. A SIGINT or
    SIGTERM is passed on to every process; a second one kills them."""
    received = []

    def on_signal(number, _frame):
        received.append(number)
        for process in processes:
            if process.poll() is None:
                process.send_signal(number) if len(received) == 1 else process.kill()

    previous = {number: signal.signal(number, on_signal)
                for number in (signal.SIGINT, signal.SIGTERM)}
    ended: dict[int, int] = {}
    first_failure = timed_out = None
    deadline = None if config.timeout_s is None else started + config.timeout_s
    try:
        while len(ended) < len(processes):
            for process_id, process in enumerate(processes):
                if process_id in ended or process.poll() is None:
                    continue
                ended[process_id] = process.returncode
                _report(f"process {process_id} exited with status "
                        f"{exit_status(process.returncode)} after "
                        f"{time.monotonic() - started:.1f} s")
                if process.returncode and first_failure is None:
                    first_failure = process.returncode
                    stop_by = time.monotonic() + config.stop_after_failure_s
                    deadline = stop_by if deadline is None else min(deadline, stop_by)
            if deadline is not None and time.monotonic() > deadline and len(ended) < len(processes):
                timed_out = first_failure is None
                _report("timed out: killing the processes left" if timed_out
                        else "killing the processes that did not stop")
                for process in processes:
                    if process.poll() is None:
                        process.kill()
                deadline = None
            time.sleep(POLL_S)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    codes = [exit_status(ended[i]) for i in range(len(processes))]
    _report(f"exit statuses {codes} after {time.monotonic() - started:.1f} s")
    if timed_out:
        return TIMED_OUT
    return 0 if first_failure is None else exit_status(first_failure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jpaged.launch", description=__doc__.split("\n\n")[0],
        usage="python -m jpaged.launch [options] -- (script.py | -m module) [args ...]")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices in each process")
    parser.add_argument("--port", type=int, default=None,
                        help="the coordinator's port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="write process i's output to LOG_DIR/process_i.log")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="kill every process after S seconds (exit status 124)")
    parser.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                        metavar="S", help="seconds before a silent process counts as dead")
    parser.add_argument("--stop-timeout", type=float, default=None, metavar="S",
                        help="once a process failed, kill the others after S seconds "
                        f"(default: the heartbeat timeout + {STOP_MARGIN_S})")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        config = LaunchConfig(tuple(command), args.num_processes, args.devices_per_process,
                              args.port, args.log_dir, args.timeout, args.heartbeat_timeout,
                              args.stop_timeout)
    except ValueError as error:
        _parser().error(str(error))
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
