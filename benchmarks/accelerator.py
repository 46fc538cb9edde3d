"""One command that checks and measures jpaged on a GPU or TPU: tests, kernels, engine.

    python -m benchmarks.accelerator [--out results/accelerator.json] [--time-limit 580]
    python -m benchmarks.accelerator --smoke    # the same code paths on CPU, tiny shapes

Each section runs in a process of its own under a time limit, so a slow or hung
section costs only its share, and JAX in one process never holds the device
memory the next one needs (JAX preallocates most of a GPU's). The JSON is
rewritten to --out after every section, so a run cut short keeps what it did.

tests    the kernel and engine tests, `-m "not default_model"`, with
         JPAGED_TEST_COMPILED=1: the backend's own Pallas kernel compiled, interpret
         mode off. Pass / fail / skip counts and the failing tests.
kernels  paged decode attention against dense attention on contiguous K/V, and
         against JAX's own Pallas paged-attention op for this backend where the
         installed JAX has one; bfloat16, Llama-3-8B's attention shape, batch 1, 32
         and 256, contexts 1k, 8k and 32k, block size 16. "jpaged" runs the kernel
         the engine would pick here, or the XLA loop when that kernel does not
         compile (the engine's fallback); "jpaged_<name>" each other of jpaged's
         GPU implementations that runs here (Mosaic GPU, Triton, the XLA loop), so
         one run compares them on the same pools. An op's time is that of a chain of
         decodes in one executable, each output the next query, so host dispatch
         is not timed. Bandwidth is the K/V bytes a decode must read over that
         time, also as a share of the device's peak (experiments.device_peaks'
         table; null for a device not in it) and of the copy bandwidth measured
         in the same run (a jitted copy of a large array, read plus write); FLOP/s
         are the two products' 4 * batch * Hq * context * head_dim over that time,
         also as a share of the device's peak (experiments.device_peaks). Then one
         mixed step (a 512-token prefill chunk ending at an 8k context beside 32
         decode rows at 8k, one ragged call) for each of jpaged's implementations
         that runs here, with the same figures. Every output's max abs error is
         against the pure-JAX reference.
engine   a ShareGPT-like mixed workload (benchmarks.throughput.mixed_workload) on
         a randomly initialised Llama-3-8B-shaped model in bfloat16: jpaged's
         continuous batching against transformers' `generate` in static batches,
         each side in its own process with its own random weights (every request
         generates exactly its length, so the weights do not change the work).
         jpaged pads every step to max_num_seqs rows and full-width block tables,
         so that it compiles three step shapes (its warm-up, timed apart) within
         the time limit. Then one batch of max_num_seqs greedy decodes on engines
         that step once per host round trip, run loops of 8 decode steps on the
         device (num_decode_steps) or schedule each step while the one before runs
         (async_scheduling): output tok/s and host round trips per token.
step_cost the engine's steps on the same model with its default buckets, each with its
         shape and time, and the step-cost model fitted to them
         (experiments.step_cost): this device's achieved fractions of its peaks
         and its overhead, with the error on a second run held out. The report's
         "step_cost" section is what `python -m experiments.sweep
         --device-calibration` reads.

--smoke runs all of it on CPU in about a minute: a few kernel tests, two grid
points with jpaged's Pallas kernel and JAX's GPU and TPU ops in interpret mode,
a two-layer model with the Pallas kernel interpreted. Its timings say nothing
about accelerator speed; CI runs it so that the script keeps working.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.device_peaks import Peaks, peaks
from experiments.report import REPO, new_report, progress

if TYPE_CHECKING:
    import jax

PEERS = ("torch", "transformers", "triton")
GPU_OP = "jax.experimental.pallas.ops.gpu.paged_attention"
TPU_OP = "jax.experimental.pallas.ops.tpu.paged_attention"
SEED = 0
BLOCK_SIZE = 16
LLAMA3_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=False,
)
TINY_LLAMA = dict(
    model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=1024,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: an accelerator's, or the smoke test's on CPU."""

    test_args: tuple[str, ...]  # pytest files and selection
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    block_sizes: tuple[int, ...]
    mixed_step: tuple[int, int, int]  # a prefill chunk's new tokens, decode rows, context
    attention_shape: tuple[int, int, int]  # query heads, KV heads, head_dim
    chain_length: int  # decodes per timed executable
    repeats: int
    interpret: bool  # Pallas kernels, and JAX's ops, in interpret mode
    model_shape: dict  # a Hugging Face Llama config
    attention_backend: str | None  # None: the engine's own choice
    num_requests: int
    scale: float  # factor on ShareGPT-like lengths
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_batch_size: int
    limits_s: dict  # per section; the last engine side gets what is left
    time_limit_s: float


ACCELERATOR = Plan(
    test_args=("tests/kernels/test_kernels.py", "tests/engine/test_runner.py",
               "tests/engine/test_engine.py", "tests/model/test_model.py",
               "tests/engine/test_faults.py"),
    batches=(1, 32, 256), contexts=(1024, 8192, 32768), block_sizes=(16,),
    mixed_step=(512, 32, 8192),
    attention_shape=(32, 8, 128), chain_length=20, repeats=5, interpret=False,
    model_shape=LLAMA3_8B, attention_backend=None,
    num_requests=128, scale=0.25, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=128,
    hf_batch_size=32,
    limits_s={"machine": 60, "tests": 120, "kernels": 110, "transformers": 80, "jpaged": 130},
    time_limit_s=580,
)
SMOKE = Plan(
    test_args=("tests/kernels/test_kernels.py", "-k", "test_scale_and_soft_cap and decode"),
    batches=(2,), contexts=(64,), block_sizes=(16, 32), mixed_step=(16, 2, 64),
    attention_shape=(4, 2, 128), chain_length=2, repeats=1, interpret=True,
    model_shape=TINY_LLAMA, attention_backend="triton",
    num_requests=4, scale=0.05, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=4,
    hf_batch_size=4,
    limits_s={"machine": 60, "tests": 90, "kernels": 90, "transformers": 60, "jpaged": 90},
    time_limit_s=360,
)


# The parent: sections in child processes, the report.


@dataclass(frozen=True)
class ChildRun:
    output: str
    returncode: int | None  # None when killed at its time limit
    elapsed_s: float


def run_child(command: list[str], timeout_s: float, env: dict) -> ChildRun:
    """Run a command in its own process group; past timeout_s kill the whole group
    (pytest's own children too) and keep what it printed."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        returncode = process.returncode
    except BaseException as error:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        returncode = None
    return ChildRun(output, returncode, time.monotonic() - started)


def with_outcome(result: dict, run: ChildRun) -> dict:
    result["section_s"] = run.elapsed_s
    if run.returncode is None:
        result["timed_out"] = True
    elif run.returncode:
        result["returncode"] = run.returncode
    return result


def run_section(name: str, smoke: bool, timeout_s: float, env: dict) -> dict:
    """A section's last complete JSON line (the sections print theirs as they go)."""
    command = [sys.executable, "-m", "benchmarks.accelerator", "--section", name]
    run = run_child(command + (["--smoke"] if smoke else []), timeout_s, env)
    result = {"error": "the section printed no result"}
    for line in reversed(run.output.splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            result = json.loads(line)
            break
    return with_outcome(result, run)


TEST_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", re.MULTILINE)


def run_tests(plan: Plan, timeout_s: float, env: dict) -> dict:
    """pytest with the backend's own kernel compiled; counts from its verbose lines, so a
    run stopped at its time limit still counts the tests it finished."""
    command = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider",
               "-m", "not default_model", *plan.test_args]
    run = run_child(command, timeout_s, env | {"JPAGED_TEST_COMPILED": "1"})
    outcomes = TEST_OUTCOME.findall(run.output)
    counts = Counter(outcome.lower() for _, outcome in outcomes)
    result = {
        "command": "JPAGED_TEST_COMPILED=1 " + " ".join(command[1:]),
        "passed": counts["passed"], "failed": counts["failed"], "errors": counts["error"],
        "skipped": counts["skipped"],
        "failures": [node for node, outcome in outcomes if outcome in ("FAILED", "ERROR")][:50],
    }
    if run.returncode != 0:
        result["output_tail"] = run.output[-3000:]
    return with_outcome(result, run)


def child_environment(smoke: bool) -> dict:
    # Unbuffered: a section killed at its time limit has printed all it did.
    env = dict(os.environ) | {"PYTHONUNBUFFERED": "1"}
    if smoke:
        # On CPU even where there is an accelerator: the smoke run checks code paths.
        env |= {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return env


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2))
    os.replace(partial, path)


def engine_ratio(engine: dict) -> float | None:
    speeds = [engine.get(side, {}).get("output_tokens_per_s")
              for side in ("jpaged", "transformers")]
    return None if None in speeds else speeds[0] / speeds[1]


def orchestrate(plan: Plan, smoke: bool, out: Path, time_limit_s: float, header: dict) -> dict:
    """Every section in turn within the time limit; the report, `header`
    (experiments.report's new_report) and the sections, rewritten to `out` after each."""
    deadline = time.monotonic() + time_limit_s
    env = child_environment(smoke)
    report = header | {"smoke": smoke, "out": str(out),
                       "settings": asdict(plan) | {"time_limit_s": time_limit_s},
                       "sections": {}}

    def within_budget(name: str, run: Callable[[float], dict]) -> dict:
        """run(its time limit): the section's own limit or what is left, if a second is."""
        left = deadline - time.monotonic()
        if left < 1:
            return {"skipped": "the run's time limit was reached"}
        return run(min(plan.limits_s.get(name, left), left))

    def section(name: str, env: dict) -> dict:
        return within_budget(name, lambda limit: run_section(name, smoke, limit, env))

    def record(name: str, result: dict) -> None:
        report["sections"][name] = result
        write_report(out, report)

    record("machine", section("machine", env))
    if report["sections"]["machine"].get("backend") == "cpu" and not smoke:
        report["error"] = "no GPU or TPU here; `--smoke` runs the same code paths on CPU"
    else:
        record("tests", within_budget("tests", lambda limit: run_tests(plan, limit, env)))
        record("kernels", section("kernels", env))
        engine = {}
        # transformers first: jpaged, the subject, gets whatever time is left.
        for side in ("transformers", "jpaged"):
            # Importing jpaged loads jax; it must not take GPU memory from torch.
            side_env = (env | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
                        if side == "transformers" else env)
            engine[side] = section(side, side_env)
            engine["output_tokens_per_s_ratio"] = engine_ratio(engine)
            record("engine", engine)
        record("step_cost", section("step_cost", env))
    report["elapsed_s"] = time_limit_s - (deadline - time.monotonic())
    write_report(out, report)
    return report


# The sections, each run in its own process; each yields its results so far. They
# import jax, torch and jpaged themselves: the parent never loads them, so it holds
# no device memory.


def machine_section(plan: Plan) -> Iterator[dict]:
    import jax

    try:
        importlib.import_module("jax.experimental.pallas.triton")
        triton = "present"
    except Exception as error:
        triton = f"absent: {type(error).__name__}: {error}"
    device = jax.devices()[0]
    yield {"backend": jax.default_backend(), "device_kind": device.device_kind,
           "num_devices": jax.device_count(), "pallas_triton_backend": triton}


@dataclass(frozen=True)
class DecodeData:
    """One grid point's arrays, every sequence at full length.

    q: [B, Hq, D]; k, v: contiguous [B, Hkv, S, D]; k_pool, v_pool: the same K/V in
    [Hkv, B * S / bs, bs, D] pools, laid on a random permutation of the pool's blocks;
    tables: int32 [B, S / bs]; lens: int32 [B], all S.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    k_pool: jax.Array
    v_pool: jax.Array
    tables: jax.Array
    lens: jax.Array


def decode_data(rng, shape: tuple[int, int, int], batch: int, context: int,
                block_size: int) -> DecodeData:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.kernels import paged_copy

    num_q_heads, num_kv_heads, head_dim = shape
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    kv_shape = (batch, num_kv_heads, context, head_dim)
    k = jax.random.normal(keys[0], kv_shape, jnp.bfloat16)
    v = jax.random.normal(keys[1], kv_shape, jnp.bfloat16)
    q = jax.random.normal(keys[2], (batch, num_q_heads, head_dim), jnp.bfloat16)
    num_blocks = batch * context // block_size
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, -1)
    return DecodeData(q, k, v, paged_copy(k, block_size, tables, num_blocks),
                      paged_copy(v, block_size, tables, num_blocks), jnp.asarray(tables),
                      jnp.full((batch,), context, jnp.int32))


def jpaged_implementation(plan: Plan, block_size: int) -> tuple[str, str | None]:
    """The kernel the engine would run here, or the next one and the reasons when it
    does not compile (the engine hands over the same way: Mosaic GPU to Triton, a
    Pallas kernel to the XLA loop)."""
    import kernels_pallas as kp

    implementation = kp.default_implementation(plan.interpret)
    reasons = []
    while True:
        _, error = try_decode(plan, implementation, block_size)
        if error is None or implementation == "xla":
            return implementation, "; ".join(reasons) or None
        reasons.append(error)
        implementation = kp.FALLBACKS[implementation]


# jpaged's implementations a GPU can run, compared beside the engine's own choice.
GPU_IMPLEMENTATIONS = ("mosaic_gpu", "triton", "xla")


def other_implementations(plan: Plan, default: str) -> tuple[list[str], dict]:
    """(the GPU_IMPLEMENTATIONS other than `default` that run here, {name: why not} for
    the others). The TPU has one kernel and its XLA loop; a CPU runs them interpreted."""
    import jax

    import kernels_pallas as kp

    if jax.default_backend() == "tpu":
        return [], {}
    running, absent = [], {}
    for name in GPU_IMPLEMENTATIONS:
        if name == default:
            continue
        if name == "mosaic_gpu" and not plan.interpret and (reason := kp.mosaic_gpu_support()):
            absent[name] = reason
            continue
        _, error = try_decode(plan, name, min(plan.block_sizes))
        if error is None:
            running.append(name)
        else:
            absent[name] = error
    return running, absent


def try_decode(plan: Plan, implementation: str, block_size: int) -> tuple[str, str | None]:
    """(implementation, None) if one tiny decode of it runs here, else (it, the error)."""
    import jax
    import jax.numpy as jnp

    import kernels_pallas as kp

    num_q_heads, num_kv_heads, head_dim = plan.attention_shape
    q = jnp.zeros((1, num_q_heads, head_dim), jnp.bfloat16)
    cache = jnp.zeros((num_kv_heads, 1, block_size, head_dim), jnp.bfloat16)
    try:
        jax.block_until_ready(kp.paged_decode_attention(
            q, cache, cache, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
            implementation=implementation, interpret=plan.interpret))
    except Exception as error:
        return implementation, f"{implementation}: {type(error).__name__}: {error}"[:2000]
    return implementation, None


def measured_copy_bandwidth(plan: Plan) -> float:
    """Bytes/s a jitted copy of a large bfloat16 array moves (read plus write): what a
    memory-bound kernel can reach here, measured rather than taken from a datasheet."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import time_call

    num_bytes = (1 << 24) if plan.interpret else (1 << 30)
    data = jnp.ones(num_bytes // 2, jnp.bfloat16)
    copy = jax.jit(lambda x: x * jnp.bfloat16(1))
    return 2 * num_bytes / time_call(copy, data, repeats=plan.repeats + 2)


def jax_paged_attention_ops(backend: str, interpret: bool) -> tuple[dict, dict]:
    """({name: decode(q, k_pool, v_pool, tables, lens)} of JAX's own Pallas paged-attention
    ops that run here, {name: why not} for the others). A GPU runs the GPU op, a TPU
    the TPU op; in interpret mode (the smoke run) both run."""
    import jax

    adapters = {GPU_OP: _gpu_op, TPU_OP: _tpu_op}
    wanted = {"gpu": (GPU_OP,), "tpu": (TPU_OP,)}.get(backend, ())
    ops, absent = {}, {}
    for name, adapter in adapters.items():
        if not interpret and name not in wanted:
            absent[name] = f"not an op for the {backend} backend"
            continue
        try:
            module = importlib.import_module(name)
        except Exception as error:
            absent[name] = f"absent from jax {jax.__version__}: {type(error).__name__}: {error}"
            continue
        ops[name] = adapter(module.paged_attention, interpret)
    return ops, absent


def _scaled(q):
    """JAX's ops leave the 1 / sqrt(head_dim) score scale to the caller."""
    return (q * q.shape[-1] ** -0.5).astype(q.dtype)


def _gpu_op(paged_attention, interpret: bool) -> Callable:
    def decode(q, k_pool, v_pool, tables, lens):
        # Its defaults, but key splits must divide the pages of a table row.
        return paged_attention(_scaled(q), k_pool, v_pool, tables, lens,
                               k_splits=min(16, tables.shape[1]), interpret=interpret)

    return decode


def _tpu_op(paged_attention, interpret: bool) -> Callable:
    from jax.experimental.pallas import tpu as pltpu

    from kernels_pallas.tpu_attention import DEFAULT_CHUNK_TOKENS

    def decode(q, k_pool, v_pool, tables, lens):
        # As many keys per compute block as jpaged's TPU kernel reads per step.
        pages = min(tables.shape[1], max(1, DEFAULT_CHUNK_TOKENS // k_pool.shape[2]))
        mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
        with mode:
            return paged_attention(_scaled(q), k_pool, v_pool, lens, tables,
                                   pages_per_compute_block=pages)

    return decode


def _first_and_chain(decode: Callable, length: int, q, *arrays):
    """(decode(q), then length - 1 decodes more, each one's output the next one's query)."""
    import jax

    first = decode(q, *arrays).astype(q.dtype)
    last = jax.lax.fori_loop(1, length, lambda _, x: decode(x, *arrays).astype(x.dtype), first)
    return first, last


def measure(decode: Callable, q, arrays: tuple, expected, kv_bytes: int, flops: int,
            peak: Peaks | None, copy_bandwidth: float, plan: Plan) -> dict:
    """One op at one point: seconds per call, bandwidth (also against the device's peak
    and its measured copy bandwidth), FLOP/s (also against the peak), max abs error vs
    the reference. kv_bytes, flops: the K/V bytes the call must read and its products'
    FLOPs."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import time_call

    chain = jax.jit(functools.partial(_first_and_chain, decode, plan.chain_length))
    first, _ = chain(q, *arrays)
    error = float(jnp.abs(first.astype(jnp.float32) - expected).max())
    seconds = time_call(chain, q, *arrays, repeats=plan.repeats) / plan.chain_length
    bandwidth = kv_bytes / seconds
    return {"seconds": seconds, "bandwidth_gb_s": bandwidth / 1e9,
            "fraction_of_peak": None if peak is None else bandwidth / peak.bandwidth,
            "fraction_of_copy_bandwidth": bandwidth / copy_bandwidth,
            "tflop_s": flops / seconds / 1e12,
            "fraction_of_peak_flops": None if peak is None or peak.flops is None
            else flops / seconds / peak.flops,
            "max_abs_error": error if math.isfinite(error) else None,
            "finite": math.isfinite(error)}


def fits(batch: int, context: int, plan: Plan) -> bool:
    """K, V, their pools and the reference's float32 gathers within free device memory."""
    import jax

    _, num_kv_heads, head_dim = plan.attention_shape
    one_array = batch * num_kv_heads * context * head_dim * 2
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return True
    return 10 * one_array <= stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def decode_point(rng, plan: Plan, batch: int, context: int, block_size: int, ops: dict,
                 peak: Peaks | None, copy_bandwidth: float) -> dict:
    """Every op on the same K/V at one grid point."""
    import jax.numpy as jnp

    import kernels_pallas as kp

    data = decode_data(rng, plan.attention_shape, batch, context, block_size)
    paged = (data.k_pool, data.v_pool, data.tables, data.lens)
    expected = kp.paged_decode_attention_reference(data.q.astype(jnp.float32), *paged)
    kv_bytes = 2 * data.k.size * data.k.dtype.itemsize
    num_q_heads, head_dim = data.q.shape[1:]
    flops = 4 * batch * num_q_heads * context * head_dim
    results = {}
    for name, (decode, arrays) in ops.items():
        try:
            results[name] = measure(decode, data.q, arrays(data), expected, kv_bytes, flops,
                                    peak, copy_bandwidth, plan)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    point = {"batch": batch, "context": context, "block_size": block_size,
             "kv_bytes": kv_bytes, "ops": results}
    with contextlib.suppress(KeyError):
        point["paged_over_dense_time"] = results["jpaged"]["seconds"] / results["dense"]["seconds"]
    return point


def mixed_point(rng, plan: Plan, implementations: list[str], peak: Peaks | None,
                copy_bandwidth: float) -> dict:
    """One ragged step of plan.mixed_step: a prefill chunk of P new tokens ending at the
    context, and D decode rows at the same context, each implementation on one pool.
    kv_bytes counts every sequence's K/V once; flops the causal products' work."""
    import jax
    import jax.numpy as jnp

    import kernels_pallas as kp

    prefill, decodes, context = plan.mixed_step
    block_size = min(plan.block_sizes)
    data = decode_data(rng, plan.attention_shape, 1 + decodes, context, block_size)
    num_q_heads, head_dim = data.q.shape[1:]
    num_tokens = prefill + decodes
    q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))),
                          (num_tokens, num_q_heads, head_dim), jnp.bfloat16)
    starts = jnp.asarray([0, *range(prefill, num_tokens + 1)], jnp.int32)
    arrays = (data.k_pool, data.v_pool, data.tables, data.lens, starts)
    expected = kp.ragged_paged_attention_reference(q.astype(jnp.float32), *arrays)
    # The chunk's token i sees context - prefill + i + 1 keys; a decode row all of them.
    keys_seen = prefill * (context - prefill) + prefill * (prefill + 1) // 2 + decodes * context
    flops = 4 * num_q_heads * head_dim * keys_seen
    kv_bytes = 2 * data.k.size * data.k.dtype.itemsize
    results = {}
    for name in implementations:
        step = functools.partial(kp.ragged_paged_attention, implementation=name,
                                 interpret=plan.interpret)
        try:
            results[f"jpaged_{name}"] = measure(step, q, arrays, expected, kv_bytes, flops, peak,
                                                copy_bandwidth, plan)
        except Exception as error:
            results[f"jpaged_{name}"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    return {"prefill_tokens": prefill, "decode_rows": decodes, "context": context,
            "block_size": block_size, "kv_bytes": kv_bytes, "flops": flops, "ops": results}


def kernels_summary(points: list[dict]) -> dict:
    """Per op, the median share of peak bandwidth (or bandwidth) over the points it ran."""
    summary = {}
    names = {name for point in points for name in point["ops"]}
    for name in sorted(names):
        runs = [p["ops"][name] for p in points if "seconds" in p["ops"].get(name, {})]
        shares = [r["fraction_of_peak"] for r in runs if r["fraction_of_peak"] is not None]
        summary[name] = {
            "points": len(runs),
            "median_bandwidth_gb_s": statistics.median(r["bandwidth_gb_s"] for r in runs)
            if runs else None,
            "median_fraction_of_peak": statistics.median(shares) if shares else None,
            "max_abs_error": max((r["max_abs_error"] for r in runs if r["finite"]), default=None),
        }
    ratios = [p["paged_over_dense_time"] for p in points if "paged_over_dense_time" in p]
    summary["median_paged_over_dense_time"] = statistics.median(ratios) if ratios else None
    return summary


def kernels_section(plan: Plan) -> Iterator[dict]:
    import jax
    import numpy as np

    import kernels_pallas as kp
    from benchmarks.kernels import dense_decode_attention

    device = jax.devices()[0]
    implementation, fallback = jpaged_implementation(plan, min(plan.block_sizes))
    others, others_absent = other_implementations(plan, implementation)
    peers, absent = jax_paged_attention_ops(jax.default_backend(), plan.interpret)
    copy_bandwidth = measured_copy_bandwidth(plan)
    peak = peaks(device.device_kind)
    head_dim = plan.attention_shape[2]
    paged_arrays = lambda d: (d.k_pool, d.v_pool, d.tables, d.lens)  # noqa: E731
    ops = {
        "jpaged": (functools.partial(kp.paged_decode_attention, implementation=implementation,
                              interpret=plan.interpret), paged_arrays),
        "dense": (functools.partial(dense_decode_attention, scale=head_dim**-0.5),
                  lambda d: (d.k, d.v, d.lens)),
    } | {f"jpaged_{name}": (functools.partial(
        kp.paged_decode_attention, implementation=name, interpret=plan.interpret),
        paged_arrays) for name in others} | {name: (op, paged_arrays)
                                             for name, op in peers.items()}
    section = {
        "dtype": "bfloat16", "attention_shape": dict(zip(
            ("num_q_heads", "num_kv_heads", "head_dim"), plan.attention_shape, strict=True)),
        "jpaged_implementation": implementation, "jpaged_fallback_reason": fallback,
        "jpaged_others": {name: "measured" for name in others} | others_absent,
        "copy_bandwidth_gb_s": copy_bandwidth / 1e9,
        "interpret": plan.interpret,
        "jax_ops": {name: "measured" for name in peers} | absent,
        "device_kind": device.device_kind,
        "peak_bandwidth_gb_s": peak and peak.bandwidth / 1e9,
        "peak_tflop_s": peak and peak.flops and peak.flops / 1e12,
        "peak_source": peak.source if peak else "not in experiments.device_peaks",
        "points": [], "skipped": [],
    }
    yield section
    rng = np.random.default_rng(SEED)
    section["mixed"] = mixed_point(rng, plan, [implementation, *others], peak, copy_bandwidth)
    progress(json.dumps(section["mixed"]))
    yield section
    # Small contexts first: a run stopped at its time limit keeps the cheap points.
    for context, batch, block_size in itertools.product(plan.contexts, plan.batches,
                                                        plan.block_sizes):
        if not fits(batch, context, plan):
            section["skipped"].append({"batch": batch, "context": context, "reason": "memory"})
            continue
        point = decode_point(rng, plan, batch, context, block_size, ops, peak, copy_bandwidth)
        progress(json.dumps(point))
        section["points"].append(point)
        section["summary"] = kernels_summary(section["points"])
        yield section


def engine_workload(plan: Plan):
    from benchmarks.throughput import mixed_workload

    return mixed_workload(plan.num_requests, plan.scale, plan.model_shape["vocab_size"],
                          SEED, SEED + 1, max_total_len=plan.max_model_len)


class TokenIdText:
    """The tokenizer of a random model: no token has a text, so each one decodes to its
    id; the engine's detokenizer and stop checks still run on every token."""

    eos_token_id = None

    def decode(self, token_ids, **_) -> str:
        return "".join(f" {token}" for token in token_ids)


def jpaged_section(plan: Plan) -> Iterator[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jpaged import LLM, SamplingParams
    from jpaged.core.step_shapes import BucketSizes
    from jpaged.engine.stats import num_compilations
    from jpaged.model.config import LlamaConfig
    from jpaged.model.llama import LlamaForCausalLM

    config = LlamaConfig.from_hf_config(plan.model_shape)
    started = time.perf_counter()
    model = LlamaForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(SEED))
    jax.block_until_ready(nnx.state(model))
    section = {"init_s": time.perf_counter() - started}
    yield section
    started = time.perf_counter()
    # Every step padded to max_num_seqs rows and full-width tables: few step shapes.
    buckets = BucketSizes(min_num_tokens=plan.max_num_seqs, min_num_seqs=plan.max_num_seqs,
                          min_blocks_per_seq=-(-plan.max_model_len // BLOCK_SIZE))
    llm = LLM("random Llama-3-8B shape", loaded=(model, config, TokenIdText()),
              dtype="bfloat16", block_size=BLOCK_SIZE, max_num_seqs=plan.max_num_seqs,
              max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
              attention_backend=plan.attention_backend, interpret=plan.interpret,
              buckets=buckets, persistent_compilation_cache=False)
    backend = llm.engine.runner.attention_backend
    section |= {
        "start_s": time.perf_counter() - started, "attention_backend": backend,
        "interpret": plan.interpret, "kv_cache": str(llm.engine.kv_cache_info),
    }
    yield section
    started = time.perf_counter()
    section["step_shapes"] = llm.engine.warmup()
    section["warmup_s"] = time.perf_counter() - started
    yield section
    workload = engine_workload(plan)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    compilations = num_compilations()
    started = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in workload], params)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert num_tokens == sum(n for _, n in workload), "a request lost tokens"
    section |= {
        "elapsed_s": elapsed, "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / elapsed,
        "compilations_during_run": num_compilations() - compilations,
        "preemptions": llm.engine.stats.summary()["preemptions"],
    }
    yield section
    del llm, outputs  # its KV pool, before the engines below take theirs
    gc.collect()
    section["decode"] = {}
    for name, options in DECODE_SYSTEMS.items():
        section["decode"][name] = decode_run(plan, model, config, buckets, options)
        yield section


# Decoding systems compared on one batch: host round trip per step, device loops of
# DECODE_LOOP_STEPS steps, async scheduling.
DECODE_LOOP_STEPS = 8
DECODE_SYSTEMS = {"single": {}, f"loop{DECODE_LOOP_STEPS}": {"num_decode_steps": DECODE_LOOP_STEPS},
                  "async": {"async_scheduling": True}}
DECODE_PROMPT_TOKENS = 32
DECODE_MAX_TOKENS = 64


def decode_run(plan: Plan, model, config, buckets, options: dict) -> dict:
    """max_num_seqs greedy requests of DECODE_PROMPT_TOKENS prompt tokens and up to
    DECODE_MAX_TOKENS new ones, on an engine with `options`: output tok/s of a second
    run (the first compiles), and host round trips per token."""
    import numpy as np

    from jpaged import LLM, SamplingParams

    max_tokens = min(plan.max_model_len - DECODE_PROMPT_TOKENS, DECODE_MAX_TOKENS)
    num_blocks = plan.max_num_seqs * -(-plan.max_model_len // BLOCK_SIZE) + 1
    llm = LLM("random Llama-3-8B shape", loaded=(model, config, TokenIdText()),
              dtype="bfloat16", block_size=BLOCK_SIZE, num_blocks=num_blocks,
              max_num_seqs=plan.max_num_seqs,
              max_num_batched_tokens=max(plan.max_num_batched_tokens, DECODE_PROMPT_TOKENS),
              max_model_len=plan.max_model_len, attention_backend=plan.attention_backend,
              interpret=plan.interpret, buckets=buckets, persistent_compilation_cache=False,
              **options)
    rng = np.random.default_rng(SEED)
    prompts = [{"prompt_token_ids": rng.integers(0, config.vocab_size,
                                                 DECODE_PROMPT_TOKENS).tolist()}
               for _ in range(plan.max_num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    first_s = time.perf_counter() - started
    steps = llm.engine.stats.num_steps
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {"options": options, "first_run_s": first_s, "output_tokens": num_tokens,
            "output_tokens_per_s": num_tokens / elapsed,
            "round_trips_per_token": (llm.engine.stats.num_steps - steps) / num_tokens}


def transformers_section(plan: Plan) -> Iterator[dict]:
    import torch
    import transformers

    from benchmarks.throughput import hf_generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(SEED)
    shape = {key: value for key, value in plan.model_shape.items() if key != "model_type"}
    started = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**shape), dtype=torch.bfloat16).eval()
    section = {"device": device, "init_s": time.perf_counter() - started,
               "attn_implementation": model.config._attn_implementation,
               "batch_size": plan.hf_batch_size}
    yield section
    workload = engine_workload(plan)
    hf_generate(model, torch, [workload[0][0]], 4, pad_id=0)
    started = time.perf_counter()
    for start in range(0, len(workload), plan.hf_batch_size):
        batch = workload[start : start + plan.hf_batch_size]
        hf_generate(model, torch, [prompt for prompt, _ in batch], max(n for _, n in batch),
                    pad_id=0)
    elapsed = time.perf_counter() - started
    num_tokens = sum(n for _, n in workload)
    yield section | {"elapsed_s": elapsed, "output_tokens": num_tokens,
                     "output_tokens_per_s": num_tokens / elapsed}


# jax's device_kind (a part of it) -> the step-cost model's device.
STEP_COST_DEVICES = {"A100-SXM4-40GB": "a100-40gb", "H100": "h100", "H200": "h200",
                     "TPU v6": "tpu-v6e"}


def step_cost_device(device_kind: str, backend: str):
    """(key, Device) of the step-cost model for this device: the table's, or on a CPU
    (the smoke run) its peaks measured now; (None, None) for a device not in the table."""
    from experiments.accelerator_study import measure_cpu
    from experiments.step_cost import DEVICES

    for part, key in STEP_COST_DEVICES.items():
        if part in device_kind:
            return key, DEVICES[key]
    return ("cpu", measure_cpu()) if backend == "cpu" else (None, None)


def step_cost_section(plan: Plan) -> Iterator[dict]:
    """The engine's own steps on this device, each with its shape and time (the sweep's
    experiments.engine_runs.serve), on the Llama-3-8B-shaped model with the engine's
    default buckets: a ShareGPT-like burst twice with other tokens (the first compiles
    its shapes). experiments.step_cost.fit on the first run's steps predicts the
    second's (held-out errors); the calibration fitted to both is this device's, for
    `python -m experiments.sweep --device-calibration`."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.throughput import mixed_workload
    from experiments.accelerator_study import usable_steps
    from experiments.engine_runs import serve
    from experiments.step_cost import ModelShape, StepCost, error_summary, fit, relative_errors
    from experiments.workloads import RequestSpec
    from jpaged import LLM
    from jpaged.model.config import LlamaConfig
    from jpaged.model.llama import LlamaForCausalLM

    key, device = step_cost_device(jax.devices()[0].device_kind, jax.default_backend())
    section = {"device_key": key}
    if device is None:
        yield section | {"error": "this device is not in experiments.step_cost.DEVICES"}
        return
    config = LlamaConfig.from_hf_config(plan.model_shape)
    model = LlamaForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(SEED))
    llm = LLM("random Llama-3-8B shape", loaded=(model, config, TokenIdText()),
              dtype="bfloat16", block_size=BLOCK_SIZE, max_num_seqs=plan.max_num_seqs,
              max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.max_model_len,
              attention_backend=plan.attention_backend, interpret=plan.interpret,
              persistent_compilation_cache=False)
    runs = []
    for run, token_seed in enumerate((SEED + 1, SEED + 2)):
        workload = mixed_workload(plan.num_requests, plan.scale, config.vocab_size, SEED,
                                  token_seed, max_total_len=plan.max_model_len)
        specs = [RequestSpec(f"{run}-{i}", 0.0, tuple(prompt), n)
                 for i, (prompt, n) in enumerate(workload)]
        runs.append(usable_steps(serve(llm.engine, specs).summary()["step_log"]))
        section[f"run{run}_steps"] = len(runs[-1][0])
        yield section
    cost = StepCost(device, ModelShape.of(config, "Llama-3-8B shape", dtype_bytes=2))
    first = dataclasses.replace(cost, calibration=fit(cost, *runs[0], "first run"))
    errors = relative_errors(first, *runs[1])
    calibration = fit(cost, runs[0][0] + runs[1][0], runs[0][1] + runs[1][1],
                      f"fitted to {section['run0_steps'] + section['run1_steps']} engine steps "
                      f"on {device.name} ({plan.model_shape['num_hidden_layers']}-layer "
                      "Llama-3-8B shape, bfloat16)")
    yield section | {
        "device": dataclasses.asdict(device),
        "held_out_error": error_summary(errors),
        "calibration": calibration.as_dict()}


SECTIONS = {"machine": machine_section, "kernels": kernels_section,
            "jpaged": jpaged_section, "transformers": transformers_section,
            "step_cost": step_cost_section}


def run_own_section(name: str, plan: Plan) -> int:
    """In a child: print each partial result as one JSON line; on an error, the last one
    with the error in it."""
    latest: dict = {}
    try:
        for latest in SECTIONS[name](plan):
            print(json.dumps(latest), flush=True)
    except Exception as error:
        traceback.print_exc()
        print(json.dumps(latest | {"error": f"{type(error).__name__}: {error}"[:2000]}),
              flush=True)
        return 1
    return 0


def exit_on_sigterm(signum, frame) -> None:
    """SIGTERM as SystemExit, so that run_child kills the running section on its way out."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="the same code paths on CPU with tiny shapes, in about a minute")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "accelerator.json",
                        help="the JSON report, rewritten after every section")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole run (default 580; 360 with --smoke)")
    parser.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else ACCELERATOR
    if args.section:
        return run_own_section(args.section, plan)
    time_limit = plan.time_limit_s if args.time_limit is None else args.time_limit
    if time_limit <= 0:
        parser.error(f"--time-limit must be > 0 seconds, got {time_limit}")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    header = new_report("benchmarks.accelerator", argv, peers=PEERS)
    report = orchestrate(plan, args.smoke, args.out.resolve(), time_limit, header)
    print(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
