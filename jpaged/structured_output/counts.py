"""StructuredOutputCounts: what structured outputs cost an engine so far."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class StructuredOutputCounts:
    """requests: requests with a grammar; compile_seconds: time spent compiling grammars
    (cache misses); cache_hits / cache_misses: of the compiled-grammar cache; fill_steps:
    steps that filled token masks; fill_rows: masks filled; fill_seconds: time spent
    filling them."""

    requests: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    fill_steps: int = 0
    fill_rows: int = 0
    fill_seconds: float = 0.0

    def add(self, other: StructuredOutputCounts) -> StructuredOutputCounts:
        return StructuredOutputCounts(*(a + b for a, b in zip(
            dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def summary(self) -> dict:
        return {"requests": self.requests, "grammar_compile_s": self.compile_seconds,
                "grammar_cache_hits": self.cache_hits,
                "grammar_cache_misses": self.cache_misses,
                "mask_fill_steps": self.fill_steps, "mask_fill_rows": self.fill_rows,
                "mask_fill_s": self.fill_seconds,
                "mask_fill_ms_per_step": (1e3 * self.fill_seconds / self.fill_steps
                                          if self.fill_steps else 0.0)}
