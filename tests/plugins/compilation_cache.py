"""Each test starts with the persistent compilation cache the process started with."""

from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def starting_compilation_cache_dir() -> str | None:
    """The directory the session starts with (a session fixture runs before any
    module fixture)."""
    return jax_compilation_cache_dir()


@pytest.fixture(autouse=True)
def restore_compilation_cache_dir(starting_compilation_cache_dir):
    """Undo a change of the process-wide persistent compilation cache: an engine created
    with persistent_compilation_cache=True sets it, and it would then serve later tests'
    compiles from disk (hiding recompilations they count).

    The directory restored is the session's, not the one this test found: a module- or
    session-scoped fixture that creates such an engine runs before this fixture does.
    JAX is not imported for this: a test that never loads it (the host-only tests)
    cannot change its cache, and one that loads it first finds the directory JAX
    starts with, its environment variable's."""
    yield
    directory = starting_compilation_cache_dir
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.jax_compilation_cache_dir != directory:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()


def jax_compilation_cache_dir() -> str | None:
    """JAX's cache directory now, or the one it would start with if not loaded yet."""
    jax = sys.modules.get("jax")
    if jax is None:
        return os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return jax.config.jax_compilation_cache_dir
