"""Serving simulation without a model: the real scheduler and a KV manager over a workload.

Every step runs jpaged's `Scheduler` against jpaged's paged `BlockManager` or
one of Orca's contiguous arenas (experiments.baselines). There is no model:
each step's draws get stand-in tokens through `update_from_output`, exactly as
the engine hands the scheduler its sampled tokens, and a request ends at its
workload's output length (its max_tokens, with ignore_eos). Parallel samples
fork from the prompt when it is computed. Beam search picks the surviving beams
each step by a seeded random choice of parents, so beams share blocks along a
tree.

Time advances by each step's cost on a device (experiments.step_cost: a roofline
per part of the step's padded shape, OPT-13B on an A100-40GB by default), so
Poisson arrivals and latencies have a device's scale; memory results do not
depend on it.

A model with sliding-window layers (`SimConfig.layer_windows`) runs on the engine's
KV cache groups (jpaged.memory.kv_cache_groups): a block then holds the KV of one
group's layers, and memory is counted in token slots of every layer all the same.

Run `python -m experiments.simulator` for one simulation (10,000 ShareGPT-like
requests by default) and its wall-clock time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from experiments.baselines import ContiguousArena
from experiments.step_cost import DEVICES, OPT_13B, StepCost, StepShape
from experiments.workloads import VOCAB_SIZE, RequestSpec, make_workload
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import BeamChoice, SampledTokens, SchedulerOutput
from jpaged.core.step_shapes import default_buckets
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.kv_cache_manager import KVCacheManager
from jpaged.memory.prefix_cache import PrefixCacheStats
from jpaged.memory.reservation import ALLOCATIONS
from jpaged.memory.reserving_block_manager import ReservingBlockManager
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.sequence import Sequence as Seq
from jpaged.sequence import SequenceGroup, SequenceStatus

ALLOCATORS = ALLOCATIONS
TIMELINE_POINTS = 200


@dataclass(frozen=True)
class SimConfig:
    """One simulated server. Every allocator gets the same `num_kv_slots` of KV memory.

    A slot holds one token's K/V in every layer. The paged pool is num_kv_slots //
    block_size blocks (plus the null block); the Orca baselines get an arena of
    num_kv_slots token slots. layer_windows: each layer's sliding window (None:
    global); with windows, paged blocks hold one KV cache group's layers each, as many
    as the same bytes hold, and a window's blocks leave as it passes them.
    step_cost: a step's seconds from its shape (the engine's buckets). orca_blocks: the
    Orca policies reserve the engine's paged blocks (ReservingBlockManager, as the
    engine's own Orca runs) instead of contiguous slabs of token slots.
    """

    allocator: str = "paged"
    block_size: int = 16
    num_kv_slots: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    num_host_slots: int = 0
    watermark: float = 0.01
    layer_windows: tuple[int | None, ...] = (None,)
    step_cost: StepCost = StepCost(DEVICES["a100-40gb"], OPT_13B)
    orca_blocks: bool = False
    reserved_prefix: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if self.allocator == "jpaged":
            warnings.warn("allocator='jpaged' is deprecated: use 'paged', the engine's name",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "allocator", "paged")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if self.allocator != "paged" and self.groups.num_groups > 1:
            raise ValueError(f"allocator {self.allocator!r} keeps every block: it cannot "
                             "run KV cache groups of sliding-window layers")
        if self.reserved_prefix and not (self.allocator == "paged"
                                         and self.enable_prefix_caching):
            raise ValueError("a reserved prefix needs allocator='paged' and "
                             "enable_prefix_caching=True (it is served as cache hits)")
        if self.num_kv_slots < self.block_size:
            raise ValueError(
                f"num_kv_slots ({self.num_kv_slots}) must hold at least one block "
                f"of block_size {self.block_size}"
            )

    @property
    def groups(self) -> KVCacheGroups:
        return KVCacheGroups.of(self.layer_windows)

    @property
    def block_slots(self) -> float:
        """Token slots (of every layer) one block holds: block_size tokens of its group's
        layers."""
        return self.block_size * self.groups.layers_per_block / len(self.layer_windows)

    def cache_config(self) -> CacheConfig:
        groups = self.groups
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=int(self.num_kv_slots // self.block_slots) + 1,
            num_host_blocks=int(self.num_host_slots // self.block_slots),
            enable_prefix_caching=self.enable_prefix_caching,
            watermark=self.watermark,
            sliding_window=groups.windows[0],
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
        )


@dataclass(frozen=True)
class MemoryBreakdown:
    """KV slots by use, as in the paper's Figure 2.

    token_states:           slots holding K/V of computed tokens.
    reserved:               allocated slots the request will fill later.
    internal_fragmentation: allocated slots the request will never fill.
    external_fragmentation: free slots while requests wait to be admitted
                            (the paper's "external fragmentation & others").
    """

    token_states: int = 0
    reserved: int = 0
    internal_fragmentation: int = 0
    external_fragmentation: int = 0

    @property
    def total(self) -> int:
        return (
            self.token_states
            + self.reserved
            + self.internal_fragmentation
            + self.external_fragmentation
        )

    @property
    def allocated(self) -> int:
        return self.token_states + self.reserved + self.internal_fragmentation

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(
            self.token_states + other.token_states,
            self.reserved + other.reserved,
            self.internal_fragmentation + other.internal_fragmentation,
            self.external_fragmentation + other.external_fragmentation,
        )

    def percentages(self) -> dict[str, float]:
        """Each use as a percentage of the total."""
        total = self.total or 1
        return {k: 100.0 * v / total for k, v in dataclasses.asdict(self).items()}


def free_slots(manager: KVCacheManager, block_slots: float) -> float:
    if isinstance(manager, ContiguousArena):
        return manager.num_free_slots
    return manager.num_free_blocks * block_slots


def pool_slots(manager: KVCacheManager, block_slots: float) -> float:
    """Token slots of the pool (the paged pool's null block excluded)."""
    if isinstance(manager, ContiguousArena):
        return manager.num_slots
    return manager.num_device_blocks * block_slots


def kv_breakdown(
    manager: KVCacheManager, seqs: Iterable[tuple[Seq, int, int]], requests_waiting: bool,
    block_slots: float | None = None,
) -> MemoryBreakdown:
    """Figure-2 breakdown of the KV memory of a run without block sharing.

    seqs: (sequence, its tokens with K/V once the step ran, its final length =
    prompt + output tokens) for every sequence holding KV. Free slots count as
    external fragmentation only while requests wait; otherwise they are idle
    capacity and left out. A paged block holds `block_slots` token slots (its
    block_size without KV cache groups); in a sliding window's group the blocks the
    window left hold nothing, and the token states are the computed tokens of the
    blocks still held.
    """
    if block_slots is None and not isinstance(manager, ContiguousArena):
        block_slots = manager.block_size
    token_states = reserved = internal = 0.0
    for seq, computed, final_len in seqs:
        for first, allocated, share in _held_spans(manager, seq, block_slots):
            will_fill = min(first + allocated, final_len) - first
            token_states += share * (computed - first)
            reserved += share * (will_fill - (computed - first))
            internal += share * (allocated - will_fill)
    external = free_slots(manager, block_slots) if requests_waiting else 0
    return MemoryBreakdown(token_states, reserved, internal, external)


def _held_spans(manager: KVCacheManager, seq: Seq, block_slots: float
                ) -> Iterable[tuple[int, int, float]]:
    """(first position held, positions held, slots per position) of each of seq's
    tables: its slab, or its blocks past those a window released in each group."""
    if isinstance(manager, ContiguousArena):
        yield 0, manager.allocated_slots(seq), 1.0
        return
    block_size = manager.block_size
    for table in manager.block_tables(seq):
        released = len(table) - int(np.count_nonzero(table.array))
        yield (released * block_size, (len(table) - released) * block_size,
               block_slots / block_size)


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured.

    breakdown: Figure-2 slots summed over the steps where requests waited (None
        when blocks are shared, where slots per sequence double count).
    token_states_of_allocated: token-state slots / allocated slots, summed over
        all steps (None when blocks are shared).
    sharing_saved: blocks saved by sharing / blocks that tables reference,
        summed over all steps (paged only).
    mean_running_requests: running requests after each step (those finished in
        it gone), as the engine's stats count them; mean over steps.
    mean_kv_utilization: allocated / pool slots after scheduling, mean over steps.
    peak_kv_slots: the most slots allocated after scheduling any step.
    outputs: request id -> output token ids of each of its final sequences.
    """

    config: SimConfig
    num_requests: int
    num_finished: int
    num_ignored: int
    num_steps: int
    simulated_s: float
    wall_s: float
    cpu_s: float
    mean_running_seqs: float
    peak_running_seqs: int
    mean_running_requests: float
    mean_kv_utilization: float
    peak_kv_slots: int
    num_preemptions: int
    output_tokens: int
    mean_normalized_latency_s: float
    breakdown: MemoryBreakdown | None
    num_waiting_steps: int
    token_states_of_allocated: float | None
    sharing_saved: float | None
    prefix_cache_hit_rate: float | None
    timeline: list[dict[str, float]] = field(repr=False)
    outputs: dict[str, list[list[int]]] = field(repr=False)

    def summary(self) -> dict:
        """A JSON-ready dict of the measurements (no timeline or outputs)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["timeline"], out["outputs"]
        out["config"] = dataclasses.asdict(self.config)
        out["breakdown_pct"] = self.breakdown.percentages() if self.breakdown else None
        del out["breakdown"]
        return out


def simulate(requests: Sequence[RequestSpec], config: SimConfig = SimConfig()) -> SimResult:
    """Serve `requests` with no model under `config`; see the module docstring."""
    return _Simulation(requests, config).run()


def make_manager(config: SimConfig) -> KVCacheManager:
    """jpaged's BlockManager over the KV cache groups, or for Orca a contiguous arena or
    the engine's reserving blocks, sized by config.num_kv_slots."""
    if config.allocator == "paged":
        return BlockManager(config.cache_config(), config.groups)
    if config.orca_blocks:
        return ReservingBlockManager(config.cache_config(), config.allocator,
                                     config.max_model_len)
    return ContiguousArena(config.num_kv_slots, config.allocator, config.max_model_len)


RESERVED_SEQ_ID = -1  # the scheduler numbers its sequences from 0


def reserve_prefix(manager: BlockManager, token_ids: Sequence[int]) -> None:
    """Reserve token_ids in `manager` (BlockManager.reserve) for the whole run: a sequence
    of them computes and registers their blocks, as the engine's reservation does, and
    leaves the reservation alone holding them."""
    holder = Seq(RESERVED_SEQ_ID, list(token_ids))
    manager.allocate(SequenceGroup("reserved-prefix", [holder], SamplingParams(max_tokens=1)))
    holder.num_computed_tokens = len(token_ids)
    manager.mark_computed(holder)
    manager.reserve(list(token_ids))
    manager.free(holder)
    manager.end_step()
    manager.prefix_cache_stats = PrefixCacheStats()  # the holder's lookup served no request


def _token(seq: Seq, draw: int) -> int:
    """A deterministic stand-in for the draw-th token drawn from seq's logits this step,
    different across sequences."""
    return (seq.seq_id * 7919 + draw * 104729 + len(seq)) % VOCAB_SIZE


def _params(spec: RequestSpec) -> SamplingParams | BeamSearchParams:
    """The request's parameters: its output length, reached whatever the tokens."""
    if spec.beam_search:
        return BeamSearchParams(beam_width=spec.n, max_tokens=spec.output_len, ignore_eos=True)
    return SamplingParams(n=spec.n, max_tokens=spec.output_len, ignore_eos=True)


class _Simulation:
    def __init__(self, requests: Sequence[RequestSpec], config: SimConfig):
        if config.allocator != "paged" and not config.orca_blocks and any(
                r.n > 1 for r in requests):
            raise ValueError(
                f"allocator {config.allocator!r} on contiguous slabs serves one sequence "
                "per request; parallel sampling and beam search need allocator='paged' "
                "or orca_blocks=True"
            )
        self.config = config
        self.specs = {r.request_id: r for r in requests}
        if len(self.specs) != len(requests):
            raise ValueError("request ids of a workload must be unique")
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_time))
        self.manager = make_manager(config)
        if config.reserved_prefix:
            reserve_prefix(self.manager, config.reserved_prefix)
        self.scheduler = Scheduler(config.scheduler_config(), self.manager)
        # The engine's padded shapes; the block-table width does not enter a step's cost.
        self.buckets = default_buckets("xla", 1, config.max_num_seqs)
        self.paged = not isinstance(self.manager, ContiguousArena)
        self.pool_slots = pool_slots(self.manager, config.block_slots)
        self.sharing = config.enable_prefix_caching or any(r.n > 1 for r in requests)
        self.rng = random.Random(config.seed)
        self.clock = 0.0
        self.outputs: dict[str, list[list[int]]] = {}
        self.normalized_latencies: list[float] = []
        self.num_ignored = 0
        self.stats = _Stats()

    def run(self) -> SimResult:
        start, cpu_start = time.perf_counter(), time.process_time()
        while self.pending or self.scheduler.has_unfinished_requests:
            self._add_arrivals()
            if not self.scheduler.has_unfinished_requests:
                self.clock = self.pending[0].arrival_time
                continue
            self._step()
        return self._result(time.perf_counter() - start, time.process_time() - cpu_start)

    def _add_arrivals(self) -> None:
        while self.pending and self.pending[0].arrival_time <= self.clock:
            spec = self.pending.popleft()
            seq = Seq(0, list(spec.prompt_token_ids))
            group = SequenceGroup(spec.request_id, [seq], _params(spec),
                                  arrival_time=spec.arrival_time)
            self.scheduler.add_request(group)

    def _step(self) -> None:
        output = self.scheduler.schedule()
        self.num_ignored += len(output.ignored)
        if output.is_empty and not output.ignored:
            raise RuntimeError("the scheduler scheduled nothing while requests are unfinished")
        # Measured as the step leaves the memory: its tokens computed, nothing sampled yet.
        computed = {seq: length for (seq, _), length
                    in zip(output.scheduled, output.context_lens, strict=True)}
        shape = StepShape.of([n for _, n in output.scheduled], output.context_lens,
                             self.buckets, self.config.block_size)
        self.clock += self.config.step_cost.seconds(shape)
        self._record(output, computed)
        stats = self.scheduler.update_from_output(output, self._draw(output))
        for group, _ in output.draws:
            if group.is_finished:
                self._finished(group)
        # After sampling, as the engine counts them: requests that finished this step are gone.
        self.stats.add_running_requests(stats.num_running)

    def _record(self, output: SchedulerOutput, computed: dict[Seq, int]) -> None:
        breakdown = None
        if not self.sharing:
            breakdown = kv_breakdown(
                self.manager, self._seqs_holding_kv(computed), self.scheduler.num_waiting > 0,
                self.config.block_slots,
            )
        logical = physical = 0
        if self.paged:
            logical = self.manager.logical_blocks_used
            physical = self.manager.physical_blocks_used
        self.stats.add(
            self.clock,
            len(output.scheduled),
            self.scheduler.num_waiting,
            breakdown,
            logical,
            physical,
        )
        used_slots = self.pool_slots - free_slots(self.manager, self.config.block_slots)
        self.stats.kv_utilization_sum += used_slots / self.pool_slots
        self.stats.kv_slots_peak = max(self.stats.kv_slots_peak, used_slots)

    def _seqs_holding_kv(self, computed: dict[Seq, int]) -> Iterable[tuple[Seq, int, int]]:
        for group in self.scheduler.running:
            final_len = self.specs[group.request_id].total_len
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    yield seq, computed.get(seq, seq.num_computed_tokens), final_len

    def _draw(self, output: SchedulerOutput) -> SampledTokens:
        """Stand-in tokens for every draw; beam searches choose their beams at random."""
        tokens, beams = [], {}
        for group, rows in output.draws:
            parents = [output.scheduled[row][0] for row in rows]
            tokens += [_token(seq, draw) for draw, seq in enumerate(parents)]
            if group.is_beam_search:
                beams[group.request_id] = self._choose_beams(group, tokens[-len(rows):])
        tokens = np.array(tokens, np.int64)
        return SampledTokens(tokens, np.ones(len(tokens), bool), beams)

    def _choose_beams(self, group: SequenceGroup, tokens: list[int]) -> BeamChoice:
        """The next beams: each picks a parent at random, the prompt all of them."""
        width = group.max_seqs
        if len(group.seqs) == 1 and width > 1:
            return BeamChoice([0] * width, [tokens[0] + i for i in range(width)])
        children = [0] * width
        for _ in range(width):
            children[self.rng.randrange(width)] += 1
        # In the group's order: the parents that go on, then their forks.
        kept = [parent for parent, count in enumerate(children) if count]
        forks = [parent for parent, count in enumerate(children) for _ in range(count - 1)]
        return BeamChoice(kept + forks, [tokens[parent] for parent in kept + forks])

    def _finished(self, group: SequenceGroup) -> None:
        spec = self.specs[group.request_id]
        self.outputs[group.request_id] = [seq.output_token_ids for seq in group.seqs]
        self.normalized_latencies.append((self.clock - spec.arrival_time) / spec.output_len)

    def _result(self, wall_s: float, cpu_s: float) -> SimResult:
        stats = self.stats
        prefix_hit_rate = None
        if self.paged and self.config.enable_prefix_caching:
            prefix_hit_rate = self.manager.prefix_cache_stats.hit_rate
        return SimResult(
            config=self.config,
            num_requests=len(self.specs),
            num_finished=len(self.outputs),
            num_ignored=self.num_ignored,
            num_steps=stats.num_steps,
            simulated_s=self.clock,
            wall_s=wall_s,
            cpu_s=cpu_s,
            mean_running_seqs=stats.running_sum / max(stats.num_steps, 1),
            peak_running_seqs=stats.running_peak,
            mean_running_requests=stats.running_requests_sum / max(stats.num_steps, 1),
            mean_kv_utilization=stats.kv_utilization_sum / max(stats.num_steps, 1),
            peak_kv_slots=stats.kv_slots_peak,
            num_preemptions=self.scheduler.num_preemptions,
            output_tokens=sum(len(s) for seqs in self.outputs.values() for s in seqs),
            mean_normalized_latency_s=_mean(self.normalized_latencies),
            breakdown=None if self.sharing else stats.waiting_breakdown,
            num_waiting_steps=stats.num_waiting_steps,
            token_states_of_allocated=(
                None if self.sharing else _ratio(stats.token_states, stats.allocated)
            ),
            sharing_saved=(
                _ratio(stats.logical - stats.physical, stats.logical) if self.paged else None
            ),
            prefix_cache_hit_rate=prefix_hit_rate,
            timeline=stats.timeline(),
            outputs=self.outputs,
        )


@dataclass
class _Stats:
    """Per-step measurements, summed; the timeline keeps every step until downsampled."""

    num_steps: int = 0
    running_sum: int = 0
    running_peak: int = 0
    num_waiting_steps: int = 0
    waiting_breakdown: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    token_states: int = 0
    allocated: int = 0
    logical: int = 0
    physical: int = 0
    running_requests_sum: int = 0
    kv_utilization_sum: float = 0.0
    kv_slots_peak: int = 0
    points: list[tuple] = field(default_factory=list)

    def add_running_requests(self, num_running: int) -> None:
        self.running_requests_sum += num_running

    def add(
        self,
        clock: float,
        num_running: int,
        num_waiting: int,
        breakdown: MemoryBreakdown | None,
        logical: int,
        physical: int,
    ) -> None:
        self.num_steps += 1
        self.running_sum += num_running
        self.running_peak = max(self.running_peak, num_running)
        self.logical += logical
        self.physical += physical
        if breakdown is not None:
            self.token_states += breakdown.token_states
            self.allocated += breakdown.allocated
            if num_waiting:
                self.num_waiting_steps += 1
                self.waiting_breakdown += breakdown
        self.points.append((clock, num_running, num_waiting, breakdown, logical, physical))

    def timeline(self) -> list[dict[str, float]]:
        """At most TIMELINE_POINTS evenly spaced steps."""
        stride = max(1, math.ceil(len(self.points) / TIMELINE_POINTS))
        timeline = []
        for clock, running, waiting, breakdown, logical, physical in self.points[::stride]:
            point = {"time_s": clock, "running_seqs": running, "waiting": waiting}
            if breakdown is not None:
                point |= {f"{k}_pct": v for k, v in breakdown.percentages().items()}
            if logical:
                point["sharing_saved_pct"] = 100.0 * (logical - physical) / logical
            timeline.append(point)
        return timeline


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "alpaca"])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--request-rate", type=float, default=math.inf)
    parser.add_argument("--allocator", default="paged", choices=ALLOCATORS)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-slots", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    requests = make_workload(
        args.dataset, args.num_requests, request_rate=args.request_rate, seed=args.seed
    )
    config = SimConfig(
        allocator=args.allocator, block_size=args.block_size, num_kv_slots=args.num_kv_slots
    )
    result = simulate(requests, config)
    print(
        f"{result.num_finished} {args.dataset}-like requests (synthetic fits to the paper's "
        f"published mean lengths), {result.num_steps} steps: the simulation took "
        f"{result.wall_s:.1f} s wall clock, {result.cpu_s:.1f} s CPU"
    )
    print(json.dumps(result.summary(), default=str))


if __name__ == "__main__":
    main()
