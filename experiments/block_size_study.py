"""The paper's Figures 18 and 19 on the real engine: block size against latency and preemption.

Figure 18. The same ShareGPT-like requests (lengths scaled as in the rate study,
Poisson arrivals at RATE_FRACTION of paged's capacity at block size 16) on
pools of the same number of token slots, one engine per block size. Per block
size: the mean normalized latency on the virtual clock (experiments.engine_runs)
and the attention op's own time at the step shapes the run met. Those shapes
are recorded from the run's steps (their block tables, context lengths and
query ranges, sampled evenly); the engine's attention function then runs alone
on a cache of the run's layout, timed after a compiling call, and its time per
step is the mean over the sampled steps times the model's layers.

Figure 19. What one preemption costs, recompute against swap, per block size:
a burst of requests on a pool too small to hold them all, once with each
preemption mode; cost = (virtual seconds - the same burst's on a pool that never
preempts) / preemptions. Swapping moves whole blocks between the device pool
and host memory, so its cost follows the block count and size; recomputing
runs the preempted prompt and output again as a prefill.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from experiments.engine_runs import make_engine, serve
from experiments.rate_study import LENGTH_SCALES
from experiments.workloads import RequestSpec, scaled_workload
from jpaged.engine.runner import attention_functions

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Figure 19 needs three runs per block size: every other power of four keeps it short.
PREEMPTION_BLOCK_SIZES = (1, 4, 16, 64, 256)
SAMPLED_STEPS = 12
# Figure 18's arrivals: this fraction of paged's all-at-once throughput at block size 16.
RATE_FRACTION = 0.6
# Figure 19's pool: this fraction of the burst's total tokens.
PREEMPTION_POOL_FRACTION = 0.5
TIMING_REPEATS = 3


@dataclass(frozen=True)
class BlockSizeSettings:
    dataset: str = "sharegpt"
    num_requests: int = 16
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    seed: int = 0
    length_scale: float = LENGTH_SCALES["sharegpt"]


def workload(settings: BlockSizeSettings, vocab_size: int, rate: float) -> list[RequestSpec]:
    return scaled_workload(settings.dataset, settings.num_requests,
                           scale=settings.length_scale,
                           max_total_len=settings.max_model_len, vocab_size=vocab_size,
                           request_rate=rate, seed=settings.seed)


class StepRecorder:
    """Keeps the attention metadata of every step an engine's runner executes."""

    def __init__(self, runner):
        self.steps: list[tuple[bool, object]] = []
        self._execute = runner.execute

        def execute(input_ids, metadata, *, decode_only, num_rows):
            self.steps.append((decode_only, metadata))
            return self._execute(input_ids, metadata, decode_only=decode_only,
                                 num_rows=num_rows)

        runner.execute = execute


def attention_seconds(engine, steps: list[tuple[bool, object]]) -> dict:
    """The engine's attention op alone at up to SAMPLED_STEPS of `steps`, evenly
    sampled: mean seconds per step over all layers, and per call."""
    model_config = engine.model_config
    ragged, decode = attention_functions(engine.runner.attention_backend)
    num_blocks, block_size = engine.kv_cache_info.num_blocks, engine.kv_cache_info.block_size
    shape = (model_config.num_kv_heads, num_blocks, block_size, model_config.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    k_cache = jax.random.normal(keys[0], shape, jnp.float32)
    v_cache = jax.random.normal(keys[1], shape, jnp.float32)
    scale = model_config.head_dim ** -0.5
    jitted = {flag: jax.jit(functools.partial(fn, layer=None, scale=scale))
              for flag, fn in ((True, decode), (False, ragged))}
    picks = np.linspace(0, len(steps) - 1, min(SAMPLED_STEPS, len(steps))).astype(int)
    per_call = []
    for index in picks:
        decode_only, meta = steps[index]
        q = jax.random.normal(keys[2], (len(meta.slot_mapping), model_config.num_heads,
                                        model_config.head_dim), jnp.float32)
        args = (q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc)
        jitted[decode_only](*args).block_until_ready()
        started = time.perf_counter()
        for _ in range(TIMING_REPEATS):
            jitted[decode_only](*args).block_until_ready()
        per_call.append((time.perf_counter() - started) / TIMING_REPEATS)
    mean_call = float(np.mean(per_call))
    return {"attention_s_per_call": mean_call,
            "attention_s_per_step": mean_call * model_config.num_layers,
            "sampled_steps": len(picks)}


def latency_by_block_size(loaded, settings: BlockSizeSettings, vocab_size: int,
                          pool_tokens: int, capacity: float | None, progress) -> list[dict]:
    """Figure 18: one run per block size at RATE_FRACTION x `capacity` (requests/s of
    paged at block size 16 serving the requests all at once; measured here if None),
    on pools of about pool_tokens slots (rounded up to whole blocks)."""
    if capacity is None:
        engine = make_engine(loaded, allocation="paged", block_size=16,
                             num_pool_tokens=_whole_blocks(pool_tokens, 16),
                             max_num_seqs=settings.max_num_seqs,
                             max_num_batched_tokens=settings.max_num_batched_tokens,
                             max_model_len=settings.max_model_len)
        burst = serve(engine, workload(settings, vocab_size, math.inf), "capacity")
        capacity = settings.num_requests / burst.virtual_s
    rate = RATE_FRACTION * capacity
    rows = []
    for block_size in settings.block_sizes:
        engine = make_engine(loaded, allocation="paged", block_size=block_size,
                             num_pool_tokens=_whole_blocks(pool_tokens, block_size),
                             max_num_seqs=settings.max_num_seqs,
                             max_num_batched_tokens=settings.max_num_batched_tokens,
                             max_model_len=settings.max_model_len)
        recorder = StepRecorder(engine.runner)
        run = serve(engine, workload(settings, vocab_size, rate), f"block size {block_size}")
        rows.append({"block_size": block_size, "request_rate": rate,
                     "pool_tokens": _whole_blocks(pool_tokens, block_size),
                     **run.summary(), **attention_seconds(engine, recorder.steps)})
        progress(f"block size {block_size}: normalized latency "
                 f"{rows[-1]['normalized_latency_s_mean']:.3f} s/token")
        del engine, recorder
    return rows


def _whole_blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def preemption_cost(loaded, settings: BlockSizeSettings, vocab_size: int,
                    progress) -> list[dict]:
    """Figure 19: seconds per preemption, recompute and swap, per block size.

    The burst of all requests runs on a pool of PREEMPTION_POOL_FRACTION of its
    total tokens (at least one max_model_len sequence), which preempts, and on
    one that holds every request whole, which never does.
    """
    burst = workload(settings, vocab_size, math.inf)
    roomy_tokens = sum(r.total_len for r in burst)
    pool_tokens = max(settings.max_model_len, int(PREEMPTION_POOL_FRACTION * roomy_tokens))
    rows = []
    for block_size in settings.block_sizes:
        base = dict(block_size=block_size, max_num_seqs=settings.max_num_seqs,
                    max_num_batched_tokens=settings.max_num_batched_tokens,
                    max_model_len=settings.max_model_len, allocation="paged")
        roomy_pool = max(roomy_tokens + block_size * settings.num_requests,
                         settings.max_model_len)
        roomy = make_engine(loaded, num_pool_tokens=_whole_blocks(roomy_pool, block_size), **base)
        reference = serve(roomy, burst).summary()
        del roomy
        row = {"block_size": block_size, "pool_tokens": _whole_blocks(pool_tokens, block_size),
               "no_preemption_virtual_s": reference["virtual_s"]}
        for mode in ("recompute", "swap"):
            engine = make_engine(loaded, num_pool_tokens=_whole_blocks(pool_tokens, block_size),
                                 preemption_mode=mode, num_host_tokens=roomy_tokens, **base)
            run = serve(engine, burst, f"block size {block_size} {mode}").summary()
            extra = run["virtual_s"] - reference["virtual_s"]
            row[mode] = {"virtual_s": run["virtual_s"], "preemptions": run["num_preemptions"],
                         "seconds_per_preemption": (extra / run["num_preemptions"]
                                                    if run["num_preemptions"] else None)}
            del engine
        progress(f"preemption, block size {block_size}: recompute "
                 f"{row['recompute']['preemptions']}, swap {row['swap']['preemptions']}")
        rows.append(row)
    return rows
