"""The paper's Figures 18 and 19 on the real engine: block size against latency and preemption.

Figure 18. The same ShareGPT-like requests (lengths scaled as in the rate study,
Poisson arrivals at RATE_FRACTION of paged's capacity at block size 16) on
pools of the same number of token slots, one engine per block size. Per block
size: the mean normalized latency on the virtual clock (experiments.engine_runs)
and the attention op's own time. The op is timed at the same steps for every
block size: SAMPLED_STEPS steps of the first run (their context lengths and
query ranges, sampled evenly), each laid out in block tables of the block size
on a shuffled pool; the engine's attention function runs alone on them, and
its time per step is the mean over those steps times the model's layers.

Figure 19. Recompute against swap, per block size, in the paper's two panels.
(a) The operations alone: the time to move one sequence's blocks to host memory
and back, and to compute its KV again as one prefill, on an idle engine.
Swapping gathers and scatters the sequence's blocks one index each, so many
small blocks cost more than their bytes (on a GPU each is also a small PCIe
copy); recomputing does not depend on the block size.
(b) End to end: the burst of all requests on a pool of half the most KV the
burst holds at once when nothing preempts, so that every block size
preempts; normalized latency and preemptions with each mode.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from experiments.engine_runs import make_engine, serve
from experiments.rate_study import LENGTH_SCALES
from experiments.report import call_seconds
from experiments.simulator import SimConfig, simulate
from experiments.workloads import RequestSpec, scaled_workload
from jpaged import SamplingParams
from jpaged.core.step_shapes import BucketSizes, bucket
from jpaged.memory.allocator import BlockOps
from jpaged.worker.model_runner import attention_functions

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Figure 19 (b) needs two runs per block size: the smallest, the default and the largest.
PREEMPTION_BLOCK_SIZES = (1, 16, 256)
SAMPLED_STEPS = 12
# Figure 18's arrivals: this fraction of paged's all-at-once throughput at block size 16.
RATE_FRACTION = 0.6
# Figure 19's pool: this fraction of the most KV slots the burst holds when nothing preempts.
PREEMPTION_POOL_FRACTION = 0.5
TIMING_REPEATS = 5


@dataclass(frozen=True)
class BlockSizeSettings:
    dataset: str = "sharegpt"
    num_requests: int = 12
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


def paged_engine(loaded, settings: BlockSizeSettings, block_size: int, pool_tokens: int,
                 **options):
    """A paged engine with the settings' limits, a pool of pool_tokens slots and
    `options` for experiments.engine_runs.make_engine (preemption mode, host pool)."""
    return make_engine(loaded, allocation="paged", block_size=block_size,
                       num_pool_tokens=pool_tokens, max_num_seqs=settings.max_num_seqs,
                       max_num_batched_tokens=settings.max_num_batched_tokens,
                       max_model_len=settings.max_model_len, **options)


@dataclass(frozen=True)
class StepShape:
    """What an attention call's cost depends on, apart from the block size.

    context_lens: int32 [S] tokens each sequence row attends to (0 for padding rows).
    query_start_loc: int32 [S + 1] where each row's new tokens start in the batch.
    """

    decode_only: bool
    num_tokens: int
    context_lens: np.ndarray
    query_start_loc: np.ndarray


class StepRecorder:
    """Keeps the shape of every step an engine's runner executes."""

    def __init__(self, runner):
        self.steps: list[StepShape] = []
        self._execute = runner.execute

        def execute(input_ids, metadata, *, decode_only, num_rows):
            self.steps.append(StepShape(decode_only, len(input_ids), metadata.context_lens,
                                        metadata.query_start_loc))
            return self._execute(input_ids, metadata, decode_only=decode_only,
                                 num_rows=num_rows)

        runner.execute = execute


def block_tables_for(context_lens: np.ndarray, block_size: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Block tables as the engine lays them out for `context_lens` at `block_size`
    (width bucketed, padding 0), on distinct blocks of a shuffled pool whose block
    0 is the null block: (tables int32 [S, width], blocks in that pool)."""
    blocks = -(-context_lens // block_size)
    width = bucket(int(blocks.max(initial=0)), BucketSizes().min_blocks_per_seq)
    ids = rng.permutation(np.arange(1, blocks.sum() + 1, dtype=np.int32))
    tables = np.zeros((len(context_lens), width), np.int32)
    ends = np.cumsum(blocks)
    for row, (n, end) in enumerate(zip(blocks, ends, strict=True)):
        tables[row, :n] = ids[end - n:end]
    return tables, int(blocks.sum()) + 1


def attention_seconds(model_config, backend: str, shapes: list[StepShape],
                      block_size: int) -> dict:
    """The engine's attention op alone at up to SAMPLED_STEPS of `shapes`, evenly
    sampled, with block tables of `block_size`: median seconds of TIMING_REPEATS
    calls after a compiling one; their mean per call and per step (all layers)."""
    ragged, decode = attention_functions(backend)
    scale = model_config.head_dim ** -0.5
    jitted = {flag: jax.jit(functools.partial(fn, layer=None, scale=scale))
              for flag, fn in ((True, decode), (False, ragged))}
    rng = np.random.default_rng(0)
    picks = np.linspace(0, len(shapes) - 1, min(SAMPLED_STEPS, len(shapes))).astype(int)
    laid_out = [(shapes[i], *block_tables_for(shapes[i].context_lens, block_size, rng))
                for i in picks]
    # One pool for every step, so that steps of one shape share a compiled call.
    cache_shape = (model_config.num_kv_heads, max(n for _, _, n in laid_out), block_size,
                   model_config.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    k_cache = jax.random.normal(keys[0], cache_shape, jnp.float32)
    v_cache = jax.random.normal(keys[1], cache_shape, jnp.float32)
    per_call = []
    for shape, tables, _ in laid_out:
        q = jax.random.normal(keys[2], (shape.num_tokens, model_config.num_heads,
                                        model_config.head_dim), jnp.float32)
        args = (q, k_cache, v_cache, tables, shape.context_lens, shape.query_start_loc)
        call = functools.partial(jitted[shape.decode_only], *args)
        per_call.append(_median_seconds(lambda call=call: call().block_until_ready()))
    mean_call = float(np.mean(per_call))
    return {"attention_s_per_call": mean_call,
            "attention_s_per_step": mean_call * model_config.num_layers,
            "sampled_steps": len(picks)}


def latency_by_block_size(loaded, settings: BlockSizeSettings, vocab_size: int,
                          pool_tokens: int, capacity: float | None, progress) -> list[dict]:
    """Figure 18: one run per block size at RATE_FRACTION x `capacity` (requests/s of
    paged at block size 16 serving the requests all at once; measured here if None),
    on pools of about pool_tokens slots (rounded up to whole blocks). Then the
    attention op alone at every block size, at the same steps: those the first
    run met, so that only the block size differs between them."""
    if capacity is None:
        engine = paged_engine(loaded, settings, 16, _whole_blocks(pool_tokens, 16))
        burst = serve(engine, workload(settings, vocab_size, math.inf), "capacity")
        capacity = settings.num_requests / burst.virtual_s
    rate = RATE_FRACTION * capacity
    rows, shapes = [], None
    for block_size in settings.block_sizes:
        engine = paged_engine(loaded, settings, block_size,
                              _whole_blocks(pool_tokens, block_size))
        recorder = StepRecorder(engine.runner)
        run = serve(engine, workload(settings, vocab_size, rate), f"block size {block_size}")
        shapes = shapes or recorder.steps
        model_config, backend = engine.model_config, engine.runner.attention_backend
        rows.append({"block_size": block_size, "request_rate": rate,
                     "pool_tokens": _whole_blocks(pool_tokens, block_size), **run.summary()})
        progress(f"block size {block_size}: normalized latency "
                 f"{rows[-1]['normalized_latency_s_mean']:.3f} s/token")
        del engine, recorder
    for row in rows:
        row |= attention_seconds(model_config, backend, shapes, row["block_size"])
    return rows


def _whole_blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def preempting_pool(burst: list[RequestSpec], settings: BlockSizeSettings,
                    block_size: int) -> int:
    """Figure 19's pool at `block_size`: PREEMPTION_POOL_FRACTION of the most slots
    the burst holds at once when nothing preempts (the simulator, which follows
    the engine's scheduler step for step), in whole blocks; never less than the
    max_model_len sequence the engine must be able to hold."""
    roomy = simulate(burst, SimConfig(
        block_size=block_size, num_kv_slots=_whole_blocks(
            sum(r.total_len for r in burst) + block_size * len(burst), block_size),
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len))
    share = int(PREEMPTION_POOL_FRACTION * roomy.peak_kv_slots)
    return _whole_blocks(max(settings.max_model_len, share), block_size)


def operation_seconds(engine, num_tokens: int, vocab_size: int) -> dict:
    """What preempting one sequence of `num_tokens` tokens costs on an idle engine:
    moving its blocks to host memory and back (every layer's K and V), or
    computing its KV again as one prefill. Median seconds of TIMING_REPEATS,
    after one call that compiles."""
    runner = engine.runner
    num_blocks = math.ceil(num_tokens / engine.kv_cache_info.block_size)
    device = np.arange(1, num_blocks + 1, dtype=np.int32)  # block 0 is the null block
    host = np.arange(num_blocks, dtype=np.int32)
    none = np.zeros((0, 2), np.int32)
    swap_out = BlockOps(swap_out=np.stack([device, host], 1), swap_in=none, copies=none)
    swap_in = BlockOps(swap_out=none, swap_in=np.stack([host, device], 1), copies=none)
    prompt = np.random.default_rng(0).integers(vocab_size, size=num_tokens).tolist()
    calls = itertools.count()

    def swap(ops: BlockOps) -> None:
        runner.apply_block_ops(ops)
        jax.block_until_ready(runner.kv_cache)

    def recompute() -> None:
        engine.add_request(f"recompute-{next(calls)}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    return {"tokens": num_tokens, "blocks": num_blocks,
            "swap_out_s": _median_seconds(lambda: swap(swap_out)),
            "swap_in_s": _median_seconds(lambda: swap(swap_in)),
            "recompute_s": _median_seconds(recompute)}


def _median_seconds(call) -> float:
    return float(np.median(call_seconds(call, TIMING_REPEATS)))


def operation_costs(loaded, settings: BlockSizeSettings, vocab_size: int,
                    progress) -> list[dict]:
    """Figure 19 (a): operation_seconds for one sequence of preempted_tokens(settings)
    tokens, per block size, each on a fresh engine with room for it on both sides."""
    num_tokens = preempted_tokens(settings)
    rows = []
    for block_size in settings.block_sizes:
        engine = paged_engine(loaded, settings, block_size,
                              _whole_blocks(settings.max_model_len, block_size),
                              preemption_mode="swap", num_host_tokens=num_tokens)
        rows.append({"block_size": block_size,
                     **operation_seconds(engine, num_tokens, vocab_size)})
        del engine
        swap_ms = 1e3 * (rows[-1]["swap_out_s"] + rows[-1]["swap_in_s"])
        progress(f"preemption operations, block size {block_size}, {num_tokens} tokens: "
                 f"swap out + in {swap_ms:.1f} ms, "
                 f"recompute {1e3 * rows[-1]['recompute_s']:.1f} ms")
    return rows


def preempted_tokens(settings: BlockSizeSettings) -> int:
    """The sequence Figure 19 (a) moves: a full step's prefill, within max_model_len."""
    return min(settings.max_num_batched_tokens, settings.max_model_len // 2)


def preemption_runs(loaded, settings: BlockSizeSettings, vocab_size: int,
                    progress) -> list[dict]:
    """Figure 19 (b) per block size: the burst of all requests on a pool that
    preempts (preempting_pool), once with each preemption mode."""
    burst = workload(settings, vocab_size, math.inf)
    rows = []
    for block_size in settings.block_sizes:
        pool = preempting_pool(burst, settings, block_size)
        row = {"block_size": block_size, "pool_tokens": pool}
        for mode in ("recompute", "swap"):
            engine = paged_engine(loaded, settings, block_size, pool, preemption_mode=mode,
                                  num_host_tokens=sum(r.total_len for r in burst))
            run = serve(engine, burst, f"block size {block_size} {mode}").summary()
            row[mode] = {key: run[key] for key in (
                "normalized_latency_s_mean", "virtual_s", "num_preemptions",
                "mean_running_requests")}
            del engine
        progress(f"preemption runs, block size {block_size}: preemptions recompute "
                 f"{row['recompute']['num_preemptions']}, swap "
                 f"{row['swap']['num_preemptions']}")
        rows.append(row)
    return rows
