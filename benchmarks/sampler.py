"""Device time of one sampling step: the candidate-based sampler against the full sort.

For batches of 1, 8 and 32 rows over a 49152-token vocabulary (SmolLM2's), each
workload times `jpaged.model.sampler.sample` (token, its log-probability and rank, no top
log-probabilities) and the peer measured in the same run: the previous sampler,
copied below, which sorts the whole vocabulary whenever a row uses top-k or top-p and
returns tokens only.

Workloads (temperature 1 unless greedy): top_p 0.9, top_k 50, plain temperature and
greedy on peaked logits (N(0, 1) * 5: the 128 largest hold about 95% of the mass, as
for most rows of a real model), and top_p 0.9 where one row in eight, or every row, is
flat (N(0, 1) * 3: the 128 largest hold about half the mass, 1024 about 82%, so the
row retries alone with 1024, then 8192 candidates). `answered_by_candidates` is the
share of rows the first 128 candidates settle. Times are the median of this process's
CPU time per step (a shared machine's other processes do not inflate it), wall-clock
median beside. Prints one JSON object last.

On Linux, glibc serves allocations above 32 MiB with fresh mmaps, so an executable
whose temporaries exceed that (the sampler's do at batch 32: 36 MiB) page-faults them
on every call; MALLOC_MMAP_THRESHOLD_=2000000000 in the environment removes that cost
(about 20 ms of a filtered batch-32 step here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import new_report, progress
from jpaged.model import sampler
from jpaged.model.sampler import nucleus_cutoffs, sample
from jpaged.worker.sampling_rows import SamplingRow, sampling_tensors

VOCAB = 49152
PEAKED, FLAT = 5.0, 3.0


# The previous sampler, verbatim but for names: the peer.
def _old_filter(scaled, top_k, top_p):
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = scaled.shape[-1]
    kth = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab) - 1
    kth_logit = jnp.take_along_axis(sorted_logits, kth[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    nucleus_size = jnp.sum(mass_before < top_p[:, None], axis=-1)
    nucleus_logit = jnp.take_along_axis(sorted_logits, (nucleus_size - 1)[:, None], axis=-1)
    return jnp.where(scaled >= jnp.maximum(kth_logit, nucleus_logit), scaled, -jnp.inf)


def _old_draw(logits, temperature, top_k, top_p, seeds, steps):
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    filtered = jax.lax.cond(needs_filter, _old_filter, lambda s, k, p: s, scaled, top_k, top_p)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


@jax.jit
def old_sample(logits, temperature, top_k, top_p, seeds, steps):
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.lax.cond(jnp.any(temperature > 0), _old_draw, lambda *args: greedy_tokens,
                           logits, temperature, top_k, top_p, seeds, steps)
    return jnp.where(temperature > 0, sampled, greedy_tokens)


WORKLOADS = {
    # name: (temperature, top_k, top_p, share of flat rows)
    "top_p=0.9": (1.0, 0, 0.9, 0.0),
    "top_k=50": (1.0, 50, 1.0, 0.0),
    "temperature=1": (1.0, 0, 1.0, 0.0),
    "greedy": (0.0, 0, 1.0, 0.0),
    "top_p=0.9, 1/8 rows flat": (1.0, 0, 0.9, 0.125),
    "top_p=0.9, all rows flat": (1.0, 0, 0.9, 1.0),
}


def logits_for(batch: int, flat_share: float, seed: int) -> np.ndarray:
    """f32 [batch, VOCAB]: N(0, 1) times 5, or times 3 for the first flat_share of rows
    (at least one row once flat_share > 0)."""
    scale = np.full((batch, 1), PEAKED, np.float32)
    scale[: int(np.ceil(batch * flat_share))] = FLAT
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, VOCAB), np.float32) * scale).astype(np.float32)


def time_step(fn, repeats: int) -> dict[str, float]:
    """Median CPU and wall milliseconds of fn() after one warm-up (compilation) call."""
    jax.block_until_ready(fn())
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn())
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall)}


def run(batch: int, workload: str, repeats: int, seed: int) -> dict:
    temperature, top_k, top_p, flat_share = WORKLOADS[workload]
    logits = jnp.asarray(logits_for(batch, flat_share, seed))
    rows = [SamplingRow(temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.0,
                        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                        seed=seed + i, sample_index=0, position=7) for i in range(batch)]
    tensors = jax.tree.map(jnp.asarray, sampling_tensors(rows, batch, VOCAB))
    old_args = (tensors.temperature, tensors.top_k, tensors.top_p, tensors.seeds,
                tensors.positions)
    new = time_step(lambda: sample(logits, tensors, num_top=0), repeats)
    old = time_step(lambda: old_sample(logits, *old_args), repeats)
    _, answered = nucleus_cutoffs(logits / temperature if temperature else logits,
                                  tensors.top_k, tensors.top_p, sampler.CANDIDATES)
    return {
        "batch": batch, "workload": workload,
        "new_cpu_ms": new["cpu_ms"], "old_cpu_ms": old["cpu_ms"],
        "new_wall_ms": new["wall_ms"], "old_wall_ms": old["wall_ms"],
        "speedup_cpu": old["cpu_ms"] / new["cpu_ms"],
        "answered_by_candidates": float(np.mean(answered)) if temperature else None,
    }


def top_k_ms(batch: int, sizes: tuple[int, ...], repeats: int) -> dict[str, float]:
    """CPU milliseconds of lax.top_k over [batch, VOCAB] by candidate count, and the sort."""
    logits = jnp.asarray(logits_for(batch, 0.0, 0))
    out = {}
    for k in sizes:
        head = jax.jit(lambda x, k=k: jax.lax.top_k(x, k)[0])
        out[str(k)] = time_step(lambda head=head: head(logits), repeats)["cpu_ms"]
    sort = jax.jit(jnp.sort)
    out["sort"] = time_step(lambda: sort(logits), max(repeats // 2, 1))["cpu_ms"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = new_report("benchmarks.sampler", argv)
    report["machine"]["device"] = str(jax.devices()[0])
    results = []
    for batch in args.batches:
        for workload in WORKLOADS:
            row = run(batch, workload, args.repeats, args.seed)
            progress(json.dumps(row))
            results.append(row)
    report |= {
        "settings": vars(args) | {
            "vocab": VOCAB, "candidates": sampler.CANDIDATES, "escalation": sampler.ESCALATION,
            "logit_scales": {"peaked": PEAKED, "flat": FLAT}, "num_top": 0,
            "peer": "previous sampler: full vocabulary sort whenever a row filters",
        },
        "results": results,
        "top_k_cpu_ms_at_batch_32": top_k_ms(32, (32, 64, 128, 256, 512), args.repeats),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
