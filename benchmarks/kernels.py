"""Paged decode attention against dense contiguous attention; write_kv peers.

    python -m benchmarks.kernels [--batches 8 32] [--contexts 512 4096] [--block-sizes 16]

On an accelerator it times, for every batch x context x block size, the paged
decode op (the Pallas kernel of this backend, random-permutation block tables)
and two peers measured in the same run on the same shapes: dense attention on
contiguous K/V [B, Hkv, S, D] (XLA) and the paged kernel on block tables that
happen to be in order (contiguous pages). It reports bytes of K/V read per
second, that as a fraction of the chip's peak HBM bandwidth, and the paged
over dense overhead, with the targets (<= 10% overhead, >= 70% of peak at
contexts >= 4k). It also times write_kv (XLA scatter) against a Pallas kernel
that writes through input_output_aliases.

On CPU the same sweep (smaller) times the reference path, and the default
CPU implementation where that differs, against dense attention and a measured
streaming-read bandwidth. The Pallas kernels only run in interpret mode on
CPU; that one timing is printed too, but interpret-mode timings say nothing
about accelerator speed.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import kernels_pallas as kp
from experiments.device_peaks import peaks
from experiments.report import new_report, progress

# Llama-3-8B attention shape: 32 query heads over 8 KV heads of 128.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
TARGET_OVERHEAD = 0.10
TARGET_BANDWIDTH_FRACTION = 0.70
TARGET_MIN_CONTEXT = 4096
INTERPRET_NOTE = (
    "CPU run: the Pallas kernels execute only in interpret mode here, and "
    "interpret-mode timings say nothing about accelerator speed; accelerator "
    "latency, bandwidth and overhead are unmeasured in this run."
)


def time_call(fn, *args, repeats: int) -> float:
    """Median seconds per call after one warm-up (compilation) call."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measured_read_bandwidth(num_bytes: int = 1 << 28) -> float:
    """Bytes/s of a jitted sum over a large f32 array: the streaming-read peer on CPU."""
    data = jnp.ones(num_bytes // 4, jnp.float32)
    return num_bytes / time_call(jax.jit(jnp.sum), data, repeats=5)


@functools.partial(jax.jit, static_argnames=("scale",))
def dense_decode_attention(q, k, v, context_lens, *, scale):
    """Decode attention on contiguous K/V: the non-paged peer.

    q: [B, Hq, D]; k, v: [B, Hkv, S, D]; context_lens: int32 [B] -> [B, Hq, D]
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, seq_len = k.shape[1], k.shape[2]
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(seq_len)[None, None, None, :] < context_lens[:, None, None, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)
    out = jnp.einsum(
        "bhgs,bhsd->bhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(q.shape).astype(q.dtype)


def paged_copy(dense: jax.Array, block_size: int, tables: np.ndarray, num_blocks: int):
    """Scatter contiguous [B, Hkv, S, D] K or V into a pool [Hkv, num_blocks, bs, D]."""
    batch, num_kv_heads, seq_len, head_dim = dense.shape
    pages = dense.reshape(batch, num_kv_heads, seq_len // block_size, block_size, head_dim)
    pages = pages.transpose(1, 0, 2, 3, 4).reshape(num_kv_heads, -1, block_size, head_dim)
    pool = jnp.zeros((num_kv_heads, num_blocks, block_size, head_dim), dense.dtype)
    return pool.at[:, tables.reshape(-1)].set(pages)


def decode_case(rng, batch, context, block_size, dtype, implementation, interpret, repeats, peak):
    """One batch x context x block size point: paged, in-order paged and dense timings."""
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    kv_shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
    k = jax.random.normal(keys[0], kv_shape, dtype)
    v = jax.random.normal(keys[1], kv_shape, dtype)
    q = jax.random.normal(keys[2], (batch, NUM_Q_HEADS, HEAD_DIM), dtype)
    lens = jnp.full((batch,), context, jnp.int32)
    blocks_per_seq = context // block_size
    num_blocks = 1 + batch * blocks_per_seq
    in_order = np.arange(1, num_blocks, dtype=np.int32).reshape(batch, blocks_per_seq)
    shuffled = rng.permutation(np.arange(1, num_blocks, dtype=np.int32)).reshape(in_order.shape)
    k_pool = paged_copy(k, block_size, shuffled, num_blocks)
    v_pool = paged_copy(v, block_size, shuffled, num_blocks)
    scale = HEAD_DIM**-0.5
    paged = functools.partial(
        kp.paged_decode_attention, implementation=implementation, interpret=interpret
    )
    tables = jnp.asarray(shuffled)
    paged_out = paged(q, k_pool, v_pool, tables, lens)
    dense_out = dense_decode_attention(q, k, v, lens, scale=scale)
    max_abs_diff = float(
        jnp.abs(paged_out.astype(jnp.float32) - dense_out.astype(jnp.float32)).max()
    )
    paged_s = time_call(paged, q, k_pool, v_pool, tables, lens, repeats=repeats)
    dense_s = time_call(
        functools.partial(dense_decode_attention, scale=scale), q, k, v, lens, repeats=repeats
    )
    k_pool_in_order = paged_copy(k, block_size, in_order, num_blocks)
    v_pool_in_order = paged_copy(v, block_size, in_order, num_blocks)
    in_order_s = time_call(
        paged, q, k_pool_in_order, v_pool_in_order, jnp.asarray(in_order), lens, repeats=repeats
    )
    kv_bytes = 2 * k.size * k.dtype.itemsize
    bandwidth = kv_bytes / paged_s
    return {
        "implementation": implementation,
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "kv_bytes_read": kv_bytes,
        "paged_s": paged_s,
        "paged_in_order_tables_s": in_order_s,
        "dense_contiguous_s": dense_s,
        "paged_bandwidth_gb_s": bandwidth / 1e9,
        "dense_bandwidth_gb_s": kv_bytes / dense_s / 1e9,
        "paged_fraction_of_peak": None if peak is None else bandwidth / peak,
        "paged_over_dense_overhead": paged_s / dense_s - 1.0,
        "max_abs_diff_vs_dense": max_abs_diff,
    }


def _aliased_write_kernel(slot_ref, k_ref, v_ref, _k_in, _v_in, k_cache_ref, v_cache_ref):
    """One token per program: store its [Hkv, D] rows at its slot, in place."""
    token = pl.program_id(0)
    slot = slot_ref[token]
    block_size = k_cache_ref.shape[2]
    block, offset = slot // block_size, slot % block_size
    k_cache_ref[:, block, offset, :] = k_ref[token]
    v_cache_ref[:, block, offset, :] = v_ref[token]


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def pallas_write_kv(k_cache, v_cache, k, v, slot_mapping, *, interpret):
    """The Pallas peer of write_kv: caches aliased to the outputs, one program per token.

    k/v_cache: [Hkv, N, bs, D]; k, v: [T, Hkv, D]; slot_mapping: int32 [T].
    """
    # Imported on use: the rest of this module runs on a JAX without the Triton backend.
    from jax.experimental.pallas import triton as pltriton

    whole = pl.BlockSpec()
    return pl.pallas_call(
        _aliased_write_kernel,
        grid=(slot_mapping.shape[0],),
        in_specs=[whole] * 5,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltriton.CompilerParams(num_warps=1),
        interpret=interpret,
    )(slot_mapping, k, v, k_cache, v_cache)


def write_kv_case(num_tokens, num_blocks, block_size, dtype, interpret, repeats):
    """XLA scatter (the kept write_kv) against the aliasing Pallas kernel."""
    rng = np.random.default_rng(0)
    shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False)
    slot_mapping = jnp.asarray(slots.astype(np.int32))
    k = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)), dtype)
    scatter = jax.jit(kp.write_kv, donate_argnums=(0, 1))
    peer = functools.partial(pallas_write_kv, interpret=interpret)
    results = {}
    for name, fn in (("xla_scatter", scatter), ("pallas_aliased", peer)):
        caches = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        caches = fn(*caches, k, v, slot_mapping)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            caches = jax.block_until_ready(fn(*caches, k, v, slot_mapping))
            samples.append(time.perf_counter() - start)
        results[name] = (statistics.median(samples), caches)
    expected = kp.write_kv_reference(
        jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), k, v, slot_mapping
    )
    for name, (_, caches) in results.items():
        for got, want in zip(caches, expected, strict=True):
            if not bool(jnp.array_equal(got, want)):
                raise AssertionError(f"write_kv peer {name} disagrees with the reference")
    scatter_s, pallas_s = results["xla_scatter"][0], results["pallas_aliased"][0]
    return {
        "num_tokens": num_tokens,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "xla_scatter_s": scatter_s,
        "pallas_aliased_s": pallas_s,
        "pallas_over_scatter": pallas_s / scatter_s,
        "pallas_interpreted": interpret,
    }


def fits(batch, context, dtype, device) -> bool:
    """Dense K/V plus two paged pools must fit in a third of device memory."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    needed = 3 * 2 * batch * NUM_KV_HEADS * context * HEAD_DIM * jnp.dtype(dtype).itemsize
    return limit is None or needed <= limit / 3


def summarize(points, peak):
    overheads = [p["paged_over_dense_overhead"] for p in points]
    long = [p for p in points if p["context"] >= TARGET_MIN_CONTEXT]
    fractions = [p["paged_fraction_of_peak"] for p in long if p["paged_fraction_of_peak"]]
    return {
        "median_overhead": statistics.median(overheads) if overheads else None,
        "max_overhead": max(overheads) if overheads else None,
        "min_fraction_of_peak_at_long_contexts": min(fractions) if fractions else None,
        "median_fraction_of_peak_at_long_contexts": (
            statistics.median(fractions) if fractions else None
        ),
        "peak_bandwidth_gb_s": None if peak is None else peak / 1e9,
        "targets": {
            "overhead_at_most": TARGET_OVERHEAD,
            "fraction_of_peak_at_least": TARGET_BANDWIDTH_FRACTION,
            "at_contexts_from": TARGET_MIN_CONTEXT,
        },
    }


def main(argv=None) -> dict:
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8] if on_cpu else [8, 32, 128])
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[512, 4096] if on_cpu else [512, 1024, 2048, 4096, 8192, 16384],
    )
    parser.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=[16, 128] if on_cpu else [8, 16, 32, 64, 128, 256],
    )
    parser.add_argument("--repeats", type=int, default=5 if on_cpu else 20)
    args = parser.parse_args(argv)
    result = new_report("benchmarks.kernels", argv)

    device = jax.devices()[0]
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    default = kp.default_implementation(False)
    # On CPU both the definition and what the runner uses there (when they differ).
    implementations = list(dict.fromkeys(["reference", default])) if on_cpu else [default]
    if on_cpu:
        peak, peak_source = measured_read_bandwidth(), "measured jnp.sum read"
    else:
        known = peaks(device.device_kind)
        peak, peak_source = (known.bandwidth, known.source) if known else (
            None, "unknown device kind")
    rng = np.random.default_rng(0)
    points, skipped = [], []
    for batch in args.batches:
        for context in args.contexts:
            if not fits(batch, context, dtype, device):
                skipped.append({"batch": batch, "context": context, "reason": "memory"})
                continue
            for block_size, implementation in itertools.product(args.block_sizes, implementations):
                point = decode_case(
                    rng,
                    batch,
                    context,
                    block_size,
                    dtype,
                    implementation,
                    False,
                    args.repeats,
                    peak,
                )
                points.append(point)
                progress(json.dumps(point))
    result["machine"] |= {"backend": backend, "device_kind": device.device_kind,
                          "num_devices": jax.device_count()}
    result |= {
        "settings": {
            "implementations": implementations,
            "dtype": jnp.dtype(dtype).name,
            "num_q_heads": NUM_Q_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "repeats": args.repeats,
            "peak_bandwidth_source": peak_source,
        },
        "decode": points,
        "skipped": skipped,
        "summary": {
            name: summarize([p for p in points if p["implementation"] == name], peak)
            for name in implementations
        },
    }
    if on_cpu:
        interpret_batch = min(args.batches)
        result["interpret_mode"] = decode_case(
            rng,
            interpret_batch,
            min(args.contexts),
            max(args.block_sizes),
            dtype,
            "triton",
            True,
            1,
            peak,
        )
        result["write_kv"] = [
            write_kv_case(tokens, 4096, 16, dtype, True, args.repeats) for tokens in (1, 8, 64, 256)
        ]
        result["note"] = INTERPRET_NOTE
    else:
        result["write_kv"] = (
            [
                write_kv_case(tokens, 16384, 16, dtype, False, args.repeats)
                for tokens in (1, 8, 64, 256, 2048)
            ]
            if backend == "gpu"
            else {"skipped": "the aliasing peer is a Triton-style kernel; no TPU variant here"}
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
