"""The suite's persistent compilation cache, and the tests that must compile.

Every engine the suite builds compiles its steps; most of them compile the same
programs as an earlier test or an earlier run. So the suite keeps XLA's executables on
disk, in a directory outside the clone and private to the user, one per jax version and
CPU (an executable compiled for one CPU's features must not run on another), with a
size cap. It is set through JAX's environment variables when this plugin loads, before
any test imports JAX, so every process a test starts (the multidevice run, the
launcher's processes, the CLI) inherits it.

`JPAGED_TEST_COLD=1` starts the run from an empty cache of its own, removed at the end:
the time a first run on a new machine takes.

A test that counts compilations asks for `no_compilation_cache`: a cache hit is not a
compile event, so a disk cache would hide a shape that warm-up missed. Compiled
executables in memory are released after each test module.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

COLD_ENV = "JPAGED_TEST_COLD"
MAX_CACHE_BYTES = 4 << 30
# Compiles faster than this are not worth a file: the tests' small jitted helpers.
MIN_COMPILE_SECONDS = 0.05


def cpu_key() -> str:
    """A short digest of the CPU's model and instruction-set features."""
    cpuinfo = Path("/proc/cpuinfo")
    described = platform.machine() + platform.processor()
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        wanted = ("flags", "model name", "Features", "CPU part")
        described += "".join(sorted({line for line in lines if line.startswith(wanted)}))
    return hashlib.sha256(described.encode()).hexdigest()[:12]


def cache_directory() -> Path:
    """~/.cache/jpaged-tests/xla-jax<version>-jaxlib<version>-<cpu key>, made private."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jpaged-tests"
    versions = "-".join(f"{name}{importlib.metadata.version(name)}" for name in ("jax", "jaxlib"))
    directory = root / f"xla-{versions}-{cpu_key()}"
    directory.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    return directory


def pytest_configure(config: pytest.Config) -> None:
    if "jax" in sys.modules:  # too late: JAX read its settings when it was imported
        raise pytest.UsageError("JAX was imported before the compilation cache was set")
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # the user's own choice
        return
    cold = os.environ.get(COLD_ENV) == "1"
    directory = Path(tempfile.mkdtemp(prefix="jpaged-cold-xla-")) if cold else cache_directory()
    config.stash[_COLD_DIRECTORY] = directory if cold else None
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=str(directory),
        JAX_COMPILATION_CACHE_MAX_SIZE=str(MAX_CACHE_BYTES),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(MIN_COMPILE_SECONDS),
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_COLD_DIRECTORY, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    return f"compilation cache: {os.environ.get('JAX_COMPILATION_CACHE_DIR')}"


_COLD_DIRECTORY = pytest.StashKey[Path | None]()


@pytest.fixture(scope="session", autouse=True)
def starting_compilation_cache_dir() -> str | None:
    """The directory the session starts with (a session fixture runs before any
    module fixture)."""
    return jax_compilation_cache_dir()


@pytest.fixture(autouse=True)
def restore_compilation_cache_dir(starting_compilation_cache_dir):
    """Undo a change of the process-wide persistent compilation cache (an engine created
    with persistent_compilation_cache=True sets it when none is set; `no_compilation_cache`
    unsets it).

    The directory restored is the session's, not the one this test found: a module- or
    session-scoped fixture that changes it runs before this fixture does. JAX is not
    imported for this: a test that never loads it (the host-only tests) cannot change
    its cache, and one that loads it first finds the directory JAX starts with."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.jax_compilation_cache_dir != starting_compilation_cache_dir:
        set_compilation_cache_dir(starting_compilation_cache_dir)


@pytest.fixture(scope="module", autouse=True)
def executables_released_after_each_module():
    """A process keeps every executable its jitted functions compiled, and each one holds
    about ten memory maps; the suite's thousands of step shapes would reach the kernel's
    limit (vm.max_map_count, 65530 by default), where XLA crashes. So each module's
    executables go when it ends: a later module that needs one again loads it from the
    disk cache."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()


@pytest.fixture
def no_compilation_cache():
    """This test compiles everything it runs (the directory comes back after it)."""
    set_compilation_cache_dir(None)


def set_compilation_cache_dir(directory: str | None) -> None:
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", directory)
    compilation_cache.reset_cache()


def jax_compilation_cache_dir() -> str | None:
    """JAX's cache directory now, or the one it would start with if not loaded yet."""
    jax = sys.modules.get("jax")
    if jax is None:
        return os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return jax.config.jax_compilation_cache_dir
