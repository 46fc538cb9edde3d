"""Per-run statistics a researcher wants from a serving run.

Step-level: KV utilization, logical beside physical KV blocks (what sharing
saves), running / waiting sequences, preemptions, prefix-cache hit rate,
compilations, speculative decoding's proposals and acceptances, the step mode and
its fallbacks (jpaged.core.step_modes). Request-level: output tokens/s, TTFT and
TPOT percentiles.

Memory stays constant however long the engine runs (a server runs for days):
step series keep running aggregates, and TTFT / TPOT keep the last
LATENCY_WINDOW finished requests.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from jax import monitoring

from jpaged.core.step_modes import ModeFallbacks, StepMode
from jpaged.memory.host_tier import HostPoolCounts
from jpaged.outputs import RequestMetrics
from jpaged.sequence import SequenceStatus
from jpaged.structured_output.counts import StructuredOutputCounts

if TYPE_CHECKING:
    from jpaged.core.scheduler_output import SchedulerOutput, SchedulerStats
    from jpaged.memory.prefix_cache import PrefixCacheStats

# TTFT / TPOT percentiles are over this many most recent finished requests.
LATENCY_WINDOW = 10_000
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = 0


class KVBlockCounts(NamedTuple):
    """A pool's device blocks (the null block excluded), those some table or reserved
    prefix holds, and the sum of the tables' lengths (what the tables would hold without
    sharing); `groups` splits that sum over the KV cache groups (one entry without
    groups); `reserved`: the blocks reserved prefixes hold."""

    total: int
    physical: int
    logical: int
    groups: tuple[int, ...] = ()
    reserved: int = 0

    @classmethod
    def of(cls, manager) -> KVBlockCounts:
        """A KV cache manager's counts now."""
        return cls(manager.num_device_blocks, manager.physical_blocks_used,
                   manager.logical_blocks_used, manager.group_blocks_used,
                   manager.num_reserved_blocks)


@dataclass(frozen=True)
class LoRACounts:
    """The LoRA adapter slots beside the KV pool (all 0 without LoRA).

    slot_bytes: the slots' bytes on one device, taken off the KV pool's budget;
    slots_total: max_loras; slots_loaded: slots holding an adapter; slots_in_use:
    those running requests use (never reassigned). loads: adapters put into a slot;
    reads / read_seconds: adapters read from disk and checked, and the time it took.
    running / waiting: adapter name -> its requests running (or swapped out) / waiting.
    """

    slot_bytes: int = 0
    slots_total: int = 0
    slots_loaded: int = 0
    slots_in_use: int = 0
    loads: int = 0
    reads: int = 0
    read_seconds: float = 0.0
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, table, slot_bytes: int, running: Iterable, waiting: Iterable) -> LoRACounts:
        """An AdapterSlotTable's counts now; running / waiting: the scheduler's groups."""
        return cls(slot_bytes, table.num_slots,
                   sum(adapter is not None for adapter in table.slot_adapters),
                   sum(users > 0 for users in table.users), table.num_loads, table.num_reads,
                   table.read_seconds, _requests_per_adapter(running),
                   _requests_per_adapter(waiting))

    def add(self, other: LoRACounts) -> LoRACounts:
        """Two replicas' counts together (slot_bytes stays one device's: replicas have
        the same slots)."""
        sums = {name: getattr(self, name) + getattr(other, name) for name in (
            "slots_total", "slots_loaded", "slots_in_use", "loads", "reads", "read_seconds")}
        return LoRACounts(max(self.slot_bytes, other.slot_bytes), **sums,
                          running=dict(Counter(self.running) + Counter(other.running)),
                          waiting=dict(Counter(self.waiting) + Counter(other.waiting)))

    def summary(self) -> dict:
        return asdict(self)


def _requests_per_adapter(groups: Iterable) -> dict[str, int]:
    return dict(Counter(group.adapter.name for group in groups if group.adapter is not None))


def block_usage(manager, groups) -> list[tuple[str, int, int]]:
    """(request id, logical blocks, distinct blocks) of each of the running sequence
    groups `groups` in `manager`; entries released from a sliding window (the null block)
    count in neither."""
    usage = []
    for group in groups:
        tables = [table.array for seq in group.seqs
                  if seq.status is SequenceStatus.RUNNING for table in manager.block_tables(seq)]
        logical = sum(int(np.count_nonzero(t)) for t in tables)
        physical = (logical if len(tables) == 1
                    else int(np.count_nonzero(np.unique(np.concatenate(tables)))))
        usage.append((group.request_id, logical, physical))
    return usage


class StepRecord(NamedTuple):
    """One step's sequences as its attention sees them: each one's new tokens and its
    tokens with KV once the step ran (SchedulerOutput.context_lens)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]


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
    tpot hold the last LATENCY_WINDOW finished requests' values. kv_cache_dtype and
    kv_bytes_per_token describe the pool (KVCacheInfo's dtype and bytes_per_token).
    step_mode: how the engine steps; mode_fallbacks: the defaults that gave way to
    another setting, and the steps that ran another way than step_mode's.
    structured_outputs: grammars compiled and token masks filled (their compiler and
    filler count into it).
    step_log: when a list, every step appends its StepRecord (a study's record of the
    steps' shapes); None, the default, keeps a server's memory constant.
    num_reserved_kv_blocks: the device blocks reserved prefixes held as the last step ran.
    lora_slot_bytes: the LoRA adapter slots' bytes on one device (off the KV pool's
    budget); lora_loads: adapters the steps put into a slot.
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
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_tier_hit_tokens: int = 0
    host_pool: HostPoolCounts = field(default_factory=HostPoolCounts)
    logical_block_steps: int = 0
    physical_block_steps: int = 0
    group_block_steps: tuple[int, ...] = ()
    num_kv_blocks: int = 0
    num_reserved_kv_blocks: int = 0
    kv_cache_dtype: str = ""
    kv_bytes_per_token: int = 0
    spec_decode: SpecDecodeCounts = field(default_factory=lambda: SpecDecodeCounts())
    step_mode: StepMode = StepMode.SINGLE_STEP
    mode_fallbacks: ModeFallbacks = field(default_factory=ModeFallbacks)
    step_log: list[StepRecord] | None = None
    structured_outputs: StructuredOutputCounts = field(default_factory=StructuredOutputCounts)
    lora_slot_bytes: int = 0
    lora_loads: int = 0

    def record_blocks(self, blocks: KVBlockCounts) -> None:
        """The KV blocks a step runs with: counted after scheduling (appends and their
        copy-on-write copies made) and before sampling forks and drops sequences."""
        self.num_kv_blocks = blocks.total
        self.num_reserved_kv_blocks = blocks.reserved
        self.kv_utilization.add(blocks.physical / blocks.total)
        self.logical_block_steps += blocks.logical
        self.physical_block_steps += blocks.physical
        steps = self.group_block_steps or (0,) * len(blocks.groups)
        self.group_block_steps = tuple(a + b for a, b in zip(steps, blocks.groups, strict=True))

    def record_step(self, plan: SchedulerOutput, queues: SchedulerStats,
                    prefix_cache: PrefixCacheStats, host_pool: HostPoolCounts, started: float,
                    ended: float) -> None:
        """One step: its plan, the queues it left, the prefix cache's counters and the
        host pool's."""
        self.num_steps += 1
        self.num_batched_tokens += plan.num_batched_tokens
        self.busy_seconds += ended - started
        self.first_step_time = self.first_step_time or started
        self.last_step_time = ended
        self.num_running.add(queues.num_running)
        self.num_waiting.add(queues.num_waiting)
        self.num_preemptions = queues.num_preemptions
        self.prefix_cache_query_tokens = prefix_cache.query_tokens
        self.prefix_cache_hit_tokens = prefix_cache.hit_tokens
        self.prefix_cache_tier_hit_tokens = prefix_cache.tier_hit_tokens
        self.host_pool = host_pool
        self.lora_loads += len(plan.adapter_loads)
        if self.step_log is not None:
            self.step_log.append(StepRecord(tuple(n for _, n in plan.scheduled),
                                            tuple(plan.context_lens)))

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
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of the admitted prompt tokens served from the prefix cache."""
        return _ratio(self.prefix_cache_hit_tokens, self.prefix_cache_query_tokens)

    @property
    def kv_memory_saved(self) -> float:
        """(logical - physical) / logical blocks over all steps: what block sharing
        (forks, beams, prefix-cache hits) saved against private copies."""
        return 1.0 - _ratio(self.physical_block_steps, self.logical_block_steps, empty=1.0)

    def summary(self) -> dict:
        return summarize([self])


@dataclass
class SpecDecodeCounts:
    """Speculative decoding's counters, with vLLM's names.

    num_drafts: verifications (a sequence with proposals, in one step);
    num_draft_tokens / num_accepted_tokens: tokens proposed, and accepted;
    num_accepted_tokens_per_pos[j]: verifications that accepted proposal j (0-based).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, proposals: Iterable[tuple[int, int]]) -> None:
        """One step's (proposed, accepted) per draw."""
        per_pos = self.num_accepted_tokens_per_pos
        for proposed, accepted in proposals:
            if not proposed:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            per_pos.extend([0] * (proposed - len(per_pos)))
            for position in range(accepted):
                per_pos[position] += 1

    def add(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        per_pos = [a + b for a, b in itertools.zip_longest(
            self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos, fillvalue=0)]
        return SpecDecodeCounts(self.num_drafts + other.num_drafts,
                                self.num_draft_tokens + other.num_draft_tokens,
                                self.num_accepted_tokens + other.num_accepted_tokens, per_pos)

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted over proposed tokens."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification gives its sequence, on average: the accepted proposals
        and the target model's own token after them (vLLM's definition)."""
        return 1.0 + _ratio(self.num_accepted_tokens, self.num_drafts)

    def summary(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "draft_acceptance_rate": self.draft_acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


@dataclass(frozen=True)
class CombinedStats:
    """The statistics of several engines (data-parallel replicas) read as one."""

    replicas: tuple[EngineStats, ...]

    def summary(self) -> dict:
        return summarize(self.replicas)


def _ratio(numerator: float, denominator: float, empty: float = 0.0) -> float:
    return numerator / denominator if denominator else empty


def summarize(replicas: Sequence[EngineStats]) -> dict:
    """One summary of one engine's statistics, or of several engines serving together.

    Counts, token totals and preemptions add up. Step-level figures are over
    every engine's steps (a step of one engine is one batch): running_mean is
    the mean batch an engine runs, the peaks the highest any engine reached,
    kv_utilization_mean the blocks in use over the blocks of the pools stepped
    (each engine's steps weighted by its pool's size). output_tokens_per_s is
    over the time from the first engine's first step to the last one's last.
    TTFT and TPOT percentiles are over every engine's finished requests (each
    engine's last LATENCY_WINDOW).
    """
    num_steps = sum(r.num_steps for r in replicas)
    output_tokens = sum(r.num_output_tokens for r in replicas)
    starts = [r.first_step_time for r in replicas if r.first_step_time is not None]
    ends = [r.last_step_time for r in replicas if r.last_step_time is not None]
    elapsed = max(ends) - min(starts) if starts and ends else 0.0
    kv_blocks_stepped = sum(r.kv_utilization.count * r.num_kv_blocks for r in replicas)
    kv_blocks_used = sum(r.kv_utilization.total * r.num_kv_blocks for r in replicas)
    logical = sum(r.logical_block_steps for r in replicas)
    physical = sum(r.physical_block_steps for r in replicas)
    host_pool = functools.reduce(HostPoolCounts.add, (r.host_pool for r in replicas),
                                 HostPoolCounts())
    return {
        "steps": num_steps,
        "finished_requests": sum(r.num_finished for r in replicas),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else None,
        "kv_utilization_mean": _ratio(kv_blocks_used, kv_blocks_stepped),
        "kv_utilization_peak": float(_peak(r.kv_utilization for r in replicas)),
        "running_mean": _pooled_mean(r.num_running for r in replicas),
        "running_peak": int(_peak(r.num_running for r in replicas)),
        "waiting_peak": int(_peak(r.num_waiting for r in replicas)),
        "preemptions": sum(r.num_preemptions for r in replicas),
        "prefix_cache_hit_rate": _ratio(sum(r.prefix_cache_hit_tokens for r in replicas),
                                        sum(r.prefix_cache_query_tokens for r in replicas)),
        "prefix_cache_tier_hit_tokens": sum(r.prefix_cache_tier_hit_tokens for r in replicas),
        "kv_offload_stored_blocks": host_pool.stored_blocks,
        "kv_offload_loaded_blocks": host_pool.loaded_blocks,
        "kv_offload_bytes": host_pool.bytes_moved,
        "kv_blocks_logical_mean": logical / max(num_steps, 1),
        "kv_blocks_physical_mean": physical / max(num_steps, 1),
        "kv_blocks_per_group_mean": [sum(group) / max(num_steps, 1) for group in zip(
            *(r.group_block_steps for r in replicas if r.group_block_steps), strict=True)],
        "kv_memory_saved": 1.0 - _ratio(physical, logical, empty=1.0),
        "kv_blocks_reserved": sum(r.num_reserved_kv_blocks for r in replicas),
        "kv_cache_dtype": replicas[0].kv_cache_dtype if replicas else "",
        "kv_bytes_per_token": replicas[0].kv_bytes_per_token if replicas else 0,
        "lora_slot_bytes": replicas[0].lora_slot_bytes if replicas else 0,
        "lora_loads": sum(r.lora_loads for r in replicas),
        "ttft_s": percentiles(value for r in replicas for value in r.ttft),
        "tpot_s": percentiles(value for r in replicas for value in r.tpot),
        "spec_decode": functools.reduce(SpecDecodeCounts.add, (r.spec_decode for r in replicas),
                                        SpecDecodeCounts()).summary(),
        "step_mode": replicas[0].step_mode.value if replicas else StepMode.SINGLE_STEP.value,
        "mode_fallbacks": dict(sum((r.mode_fallbacks.counts for r in replicas), Counter())),
        "structured_outputs": functools.reduce(
            StructuredOutputCounts.add, (r.structured_outputs for r in replicas),
            StructuredOutputCounts()).summary(),
    }


def _peak(series: Iterable[RunningStat]) -> float:
    """The highest value of the non-empty series; 0 when all are empty."""
    return max((s.peak for s in series if s.count), default=0.0)


def _pooled_mean(series: Iterable[RunningStat]) -> float:
    """The mean of all the series' values together; 0 when all are empty."""
    series = list(series)
    return _ratio(sum(s.total for s in series), sum(s.count for s in series))
