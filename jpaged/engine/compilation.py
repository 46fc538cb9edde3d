"""Compiled steps kept on disk between processes (warm-up itself: jpaged.worker.warmup)."""

from __future__ import annotations

import jax

from jpaged.model.default_model import cache_directory


def use_persistent_compilation_cache() -> None:
    """Keep compiled steps on disk (under the jpaged cache) unless the user chose a place:
    a process that serves the same shapes again loads them instead of compiling."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_directory() / "xla"))
