"""Serve a workload on the real engine with Poisson arrivals replayed on a virtual clock.

A serving study on a shared two-core CPU cannot trust the wall clock: another
process that takes a core for a second stretches every request in flight and
lets more arrivals pile up, so two policies measured minutes apart would not be
comparable. Here the clock is virtual but every second of it was measured:

- the engine (`LLMEngine`, the real model, kernels, scheduler and KV pool)
  runs one `step()` at a time;
- the clock advances by that step's measured duration, less the time JAX spent
  tracing, compiling or loading compiled code during it (a step shape met for
  the first time would otherwise count its compilation as serving time);
- requests whose Poisson arrival time has come are added before each step;
  when the engine is idle the clock jumps to the next arrival.

The schedule is the one a wall-clock server would follow if every step took
what it measured; load from other processes can still lengthen a step, but it
no longer feeds back into queueing. Latency is the virtual time from a
request's arrival to the step that finishes it; normalized latency is latency
over its output tokens (the paper's Figure 12 metric); time to first token is the
virtual time from its arrival to the step that gives it its first token.

A workload may also grow while it runs: a follow-up (a conversation's next round)
arrives some time after the request it follows finishes, with what that request
answered (`serve`'s `follow_up`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax import monitoring

from experiments.step_cost import StepShape
from experiments.workloads import RequestSpec
from jpaged.engine.stats import EngineStats
from jpaged.outputs import RequestOutput

# Events JAX reports while tracing, lowering, compiling or loading a compiled step.
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
    "/jax/compilation_cache/cache_retrieval_time_sec",
})
_compile_seconds = 0.0


def _count_compile_time(event: str, duration: float, **kwargs) -> None:
    global _compile_seconds
    if event in _COMPILE_EVENTS:
        _compile_seconds += duration


monitoring.register_event_duration_secs_listener(_count_compile_time)


@dataclass(frozen=True)
class RunResult:
    """One workload served on the virtual clock.

    normalized_latencies_s: per request, (finish - arrival) / output tokens, seconds.
    ttfts_s: per request, first token - arrival, seconds (in the order they finished).
    prefix_cache_query_tokens, prefix_cache_hit_tokens: prompt tokens the prefix cache
        was asked for during the run, and those it served.
    step_seconds: per step, measured duration less compilation, seconds.
    step_shapes: per step, its sequences and the bucket it ran in (its cost's shape).
    step_compiled: per step, whether JAX compiled during it (its time is then an estimate).
    outputs: request id -> its final output (token ids of every sample or beam, and
        its metrics: the KV block-steps it held).
    """

    num_requests: int
    num_steps: int
    virtual_s: float
    wall_s: float
    compile_s: float
    num_compiling_steps: int
    output_tokens: int
    normalized_latencies_s: list[float]
    ttfts_s: list[float]
    mean_running_requests: float
    peak_running_requests: float
    mean_kv_utilization: float
    num_preemptions: int
    logical_block_steps: int
    physical_block_steps: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    step_seconds: list[float]
    step_shapes: list[StepShape]
    step_compiled: list[bool]
    outputs: dict[str, RequestOutput]

    @property
    def mean_normalized_latency_s(self) -> float:
        return float(np.mean(self.normalized_latencies_s))

    @property
    def kv_memory_saved_pct(self) -> float:
        """What block sharing saved: 1 - physical / logical block-steps, in %."""
        return 100.0 * (1 - self.physical_block_steps / max(self.logical_block_steps, 1))

    def summary(self) -> dict:
        """JSON-ready measurements (no per-step or per-request lists)."""
        latencies, ttfts = np.asarray(self.normalized_latencies_s), np.asarray(self.ttfts_s)
        return {
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "virtual_s": self.virtual_s,
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "num_compiling_steps": self.num_compiling_steps,
            "output_tokens": self.output_tokens,
            "output_tokens_per_virtual_s": self.output_tokens / self.virtual_s,
            "normalized_latency_s_mean": float(latencies.mean()),
            "normalized_latency_s_p50": float(np.percentile(latencies, 50)),
            "normalized_latency_s_p90": float(np.percentile(latencies, 90)),
            "ttft_s_mean": float(ttfts.mean()),
            "ttft_s_p90": float(np.percentile(ttfts, 90)),
            "mean_running_requests": self.mean_running_requests,
            "peak_running_requests": self.peak_running_requests,
            "mean_kv_utilization_pct": 100.0 * self.mean_kv_utilization,
            "num_preemptions": self.num_preemptions,
            "kv_memory_saved_pct": self.kv_memory_saved_pct,
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "step_s_median": float(np.median(self.step_seconds)),
            "step_log": step_log_columns(self.step_shapes, self.step_seconds,
                                         self.step_compiled),
        }


def step_log_columns(shapes: list[StepShape], seconds: list[float], compiled: list[bool]
                     ) -> dict:
    """A run's steps, column by column (JSON-ready; `read_step_log` reads them back)."""
    return {"block_size": shapes[0].block_size if shapes else 0,
            "query_lens": [list(s.query_lens) for s in shapes],
            "context_lens": [list(s.context_lens) for s in shapes],
            "padded_tokens": [s.padded_tokens for s in shapes],
            "logit_rows": [s.logit_rows for s in shapes],
            "seconds": seconds, "compiled": compiled}


def read_step_log(columns: dict) -> tuple[list[StepShape], list[float], list[bool]]:
    """(shapes, seconds, compiled) of `step_log_columns`' record."""
    shapes = [StepShape(tuple(q), tuple(c), tokens, rows, columns["block_size"])
              for q, c, tokens, rows in zip(columns["query_lens"], columns["context_lens"],
                                            columns["padded_tokens"], columns["logit_rows"],
                                            strict=True)]
    return shapes, list(columns["seconds"]), list(columns["compiled"])


def greedy(spec: RequestSpec):
    """Greedy sampling of exactly the request's output_len tokens."""
    from jpaged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)


FollowUp = Callable[[RequestSpec, RequestOutput, float], Sequence[RequestSpec]]


def serve(engine, requests: Sequence[RequestSpec], label: str = "",
          params_of: Callable[[RequestSpec], Any] = greedy,
          follow_up: FollowUp | None = None) -> RunResult:
    """Serve `requests` on `engine`, each with the sampling or beam-search parameters
    `params_of` gives it (which must stop at exactly output_len tokens: ignore_eos).

    follow_up(spec, output, clock): the requests that follow a finished one (none, or a
    conversation's next round, arriving at or after `clock`); they are served too.

    The engine may have served other runs: its stats are reset and preemptions and
    prefix-cache counters counted from here. Progress goes to stderr when a label is
    given.
    """
    order = itertools.count()  # ties in arrival time keep the order given
    pending = [(r.arrival_time, next(order), r) for r in requests]
    heapq.heapify(pending)
    specs = {r.request_id: r for r in requests}
    first_arrival = pending[0][0]
    engine.stats = EngineStats(step_log=[])
    buckets, block_size = engine.shapes.buckets, engine.config.block_size
    preemptions_before = engine.scheduler.num_preemptions
    cache_before = dataclasses.replace(engine.block_manager.prefix_cache_stats)
    clock, latencies, ttfts, step_seconds, finished, first_token = 0.0, [], [], [], {}, {}
    compile_total, step_compiled = 0.0, []
    wall_start = time.perf_counter()
    progress = _Progress(label, len(pending))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= clock:
            spec = heapq.heappop(pending)[2]
            engine.add_request(spec.request_id, {"prompt_token_ids": list(spec.prompt_token_ids)},
                               params_of(spec))
        if not engine.has_unfinished_requests():
            clock = pending[0][0]
            continue
        compiled_before = _compile_seconds
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        compiled = _compile_seconds - compiled_before
        step_compiled.append(compiled > 0)
        compile_total += compiled
        clock += max(elapsed - compiled, 0.0)
        step_seconds.append(max(elapsed - compiled, 0.0))
        for output in outputs:
            rid = output.request_id
            if rid not in first_token and any(o.token_ids for o in output.outputs):
                first_token[rid] = clock
            if not output.finished:
                continue
            spec = specs[rid]
            latencies.append((clock - spec.arrival_time) / spec.output_len)
            ttfts.append(first_token[rid] - spec.arrival_time)
            finished[rid] = output
            progress.advance()
            for later in follow_up(spec, output, clock) if follow_up else ():
                if later.arrival_time < clock:
                    raise ValueError(f"follow-up {later.request_id!r} arrives at "
                                     f"{later.arrival_time}, before {rid!r} finished at {clock}")
                specs[later.request_id] = later
                heapq.heappush(pending, (later.arrival_time, next(order), later))
                progress.grow()
    progress.close()
    stats, cache = engine.stats, engine.block_manager.prefix_cache_stats
    if len(stats.step_log) != len(step_seconds):
        raise RuntimeError(f"{len(step_seconds)} engine steps recorded "
                           f"{len(stats.step_log)} step plans: serve() runs one plan a step")
    return RunResult(
        num_requests=len(finished),
        num_steps=len(step_seconds),
        virtual_s=clock - first_arrival,
        wall_s=time.perf_counter() - wall_start,
        compile_s=compile_total,
        num_compiling_steps=sum(step_compiled),
        output_tokens=stats.num_output_tokens,
        normalized_latencies_s=latencies,
        ttfts_s=ttfts,
        mean_running_requests=stats.num_running.mean,
        peak_running_requests=stats.num_running.peak,
        mean_kv_utilization=stats.kv_utilization.mean,
        num_preemptions=engine.scheduler.num_preemptions - preemptions_before,
        logical_block_steps=stats.logical_block_steps,
        physical_block_steps=stats.physical_block_steps,
        prefix_cache_query_tokens=cache.query_tokens - cache_before.query_tokens,
        prefix_cache_hit_tokens=cache.hit_tokens - cache_before.hit_tokens,
        step_seconds=step_seconds,
        step_shapes=[StepShape.of(record.query_lens, record.context_lens, buckets, block_size)
                     for record in stats.step_log],
        step_compiled=step_compiled,
        outputs=finished,
    )


class _Progress:
    """A tqdm bar of finished requests on stderr (silent without a label)."""

    def __init__(self, label: str, total: int):
        self._bar = None
        if label:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update()

    def grow(self) -> None:
        """One more request to wait for (a follow-up)."""
        if self._bar is not None:
            self._bar.total += 1
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def make_engine(loaded, *, allocation: str, block_size: int, num_pool_tokens: int,
                max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                preemption_mode: str = "recompute", num_host_tokens: int = 0,
                share_blocks: bool = True, kv_cache_dtype: str = "auto",
                enable_prefix_caching: bool = False, kv_offloading_size: float = 0.0):
    """An engine on an already loaded model with a pool of `num_pool_tokens` token slots
    (rounded down to whole blocks; the null block comes on top), prefix caching off
    unless asked for, and a host pool of kv_offloading_size GiB plus swap space for
    num_host_tokens tokens (with prefix caching on, the host pool is the prefix cache's
    tier too)."""
    from jpaged.engine.kv_cache_sizing import bytes_per_token
    from jpaged.engine.llm_engine import EngineConfig, LLMEngine

    config = EngineConfig(
        block_size=block_size, num_blocks=num_pool_tokens // block_size + 1,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
        allocation=allocation, share_blocks=share_blocks, kv_cache_dtype=kv_cache_dtype,
    )
    # The swap space in GiB needs the config's KV dtype, and swap preemption a host pool:
    # both are set once the rest of the config is checked. Half a block spare, as the
    # engine rounds the GiB down to whole blocks.
    host_blocks = math.ceil(num_host_tokens / block_size)
    host_bytes = (host_blocks + 0.5) * block_size * bytes_per_token(loaded[1], config.kv_dtype)
    host_gib = kv_offloading_size + (host_bytes / 2**30 if host_blocks else 0.0)
    config = dataclasses.replace(config, preemption_mode=preemption_mode,
                                 kv_offloading_size=host_gib or None)
    return LLMEngine(config, loaded=loaded)
