"""Per-run statistics a researcher wants from a serving run.

Step-level: KV utilization, logical beside physical KV blocks (what sharing
saves), running / waiting sequences, preemptions, prefix-cache hit rate,
compilations. Request-level: output tokens/s, TTFT and TPOT percentiles.

Memory stays constant however long the engine runs (a server runs for days):
step series keep running aggregates, and TTFT / TPOT keep the last
LATENCY_WINDOW finished requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from jax import monitoring

from jpaged.outputs import RequestMetrics

if TYPE_CHECKING:
    from jpaged.core.scheduler import SchedulerOutput
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.memory.block_manager import BlockManager

# TTFT / TPOT percentiles are over this many most recent finished requests.
LATENCY_WINDOW = 10_000
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = 0


def _count_compilation(event: str, duration: float, **kwargs) -> None:
    global _compilations
    if event == _COMPILE_EVENT:
        _compilations += 1


monitoring.register_event_duration_secs_listener(_count_compilation)


def num_compilations() -> int:
    """XLA compilations in this process so far (any jitted function)."""
    return _compilations


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """mean, p50 and p99 of the values (None for no values)."""
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
    }


@dataclass
class RunningStat:
    """Count, sum and maximum of a series, in constant memory."""

    count: int = 0
    total: float = 0.0
    peak: float = 0.0

    def add(self, value: float) -> None:
        self.peak = value if self.count == 0 else max(self.peak, value)
        self.count += 1
        self.total += value

    @property
    def mean(self) -> float:
        """The series' mean; 0 for an empty series."""
        return self.total / self.count if self.count else 0.0


def _latency_window() -> deque[float]:
    return deque(maxlen=LATENCY_WINDOW)


@dataclass
class EngineStats:
    """Counters an engine updates every step; `summary()` reduces them.

    kv_utilization, num_running and num_waiting aggregate every step; ttft and
    tpot hold the last LATENCY_WINDOW finished requests' values.
    """

    num_steps: int = 0
    num_batched_tokens: int = 0
    num_output_tokens: int = 0
    num_finished: int = 0
    busy_seconds: float = 0.0
    first_step_time: float | None = None
    last_step_time: float | None = None
    kv_utilization: RunningStat = field(default_factory=RunningStat)
    num_running: RunningStat = field(default_factory=RunningStat)
    num_waiting: RunningStat = field(default_factory=RunningStat)
    ttft: deque[float] = field(default_factory=_latency_window)
    tpot: deque[float] = field(default_factory=_latency_window)
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    logical_block_steps: int = 0
    physical_block_steps: int = 0

    def record_blocks(self, manager: BlockManager) -> None:
        """The KV blocks a step runs with: read after scheduling (appends and their
        copy-on-write copies made) and before sampling forks and drops sequences."""
        self.kv_utilization.add(manager.physical_blocks_used / manager.num_device_blocks)
        self.logical_block_steps += manager.logical_blocks_used
        self.physical_block_steps += manager.physical_blocks_used

    def record_step(
        self, engine: LLMEngine, plan: SchedulerOutput, started: float, ended: float
    ) -> None:
        self.num_steps += 1
        self.num_batched_tokens += plan.num_batched_tokens
        self.busy_seconds += ended - started
        self.first_step_time = self.first_step_time or started
        self.last_step_time = ended
        self.num_running.add(engine.scheduler.num_running)
        self.num_waiting.add(engine.scheduler.num_waiting)
        self.num_preemptions = engine.scheduler.num_preemptions
        self.prefix_cache_hit_rate = engine.block_manager.prefix_cache_stats.hit_rate

    def record_finished(self, metrics: RequestMetrics, output_lengths: list[int]) -> None:
        """output_lengths: output tokens of each of the request's samples or beams;
        TPOT follows the longest."""
        self.num_finished += 1
        self.num_output_tokens += sum(output_lengths)
        if metrics.ttft is not None:
            self.ttft.append(metrics.ttft)
        tpot = metrics.tpot(max(output_lengths, default=0))
        if tpot is not None:
            self.tpot.append(tpot)

    @property
    def kv_memory_saved(self) -> float:
        """(logical - physical) / logical blocks over all steps: what block sharing
        (forks, beams, prefix-cache hits) saved against private copies."""
        if self.logical_block_steps == 0:
            return 0.0
        return 1.0 - self.physical_block_steps / self.logical_block_steps

    def summary(self) -> dict:
        elapsed = (self.last_step_time or 0.0) - (self.first_step_time or 0.0)
        return {
            "steps": self.num_steps,
            "finished_requests": self.num_finished,
            "output_tokens": self.num_output_tokens,
            "output_tokens_per_s": self.num_output_tokens / elapsed if elapsed > 0 else None,
            "kv_utilization_mean": self.kv_utilization.mean,
            "kv_utilization_peak": float(self.kv_utilization.peak),
            "running_mean": self.num_running.mean,
            "running_peak": int(self.num_running.peak),
            "waiting_peak": int(self.num_waiting.peak),
            "preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "kv_blocks_logical_mean": self.logical_block_steps / max(self.num_steps, 1),
            "kv_blocks_physical_mean": self.physical_block_steps / max(self.num_steps, 1),
            "kv_memory_saved": self.kv_memory_saved,
            "ttft_s": percentiles(self.ttft),
            "tpot_s": percentiles(self.tpot),
        }
