"""Tensor parallelism on simulated CPU devices: step time and bytes per device.

    python -m benchmarks.tp [--layers N] [--rounds N] [--batch N] [--context N]

A randomly initialised Llama-family model with 32 query heads and 8 KV heads
(small enough for a laptop) runs a decode step and a 64-token prefill step with
tensor_parallel_size 1, 2, 4 and 8 on 8 simulated CPU devices
(--xla_force_host_platform_device_count=8, set before JAX starts; TP 1 is the
plain one-device step). The sizes are timed in turn within each round, so every
size sees the same machine load, and the medians are compared with TP 1.

Simulated devices share the host's cores: the times measure the overhead of
the sharded program (its collectives, the per-device dispatch), not the
speed-up of more hardware; a ratio below 1 there only says that the shards'
work spread over more of the host's threads than the one-device step used.
The bytes per device, read from the arrays' shardings, are what a real mesh
would hold.

Prints one JSON object last.
"""

from __future__ import annotations

import os
import sys

NUM_DEVICES = 8
if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={NUM_DEVICES}"]
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.report import new_report, progress  # noqa: E402
from jpaged.core.attention_metadata import AttentionMetadata  # noqa: E402
from jpaged.model.config import LlamaConfig  # noqa: E402
from jpaged.model.llama import LlamaForCausalLM  # noqa: E402
from jpaged.model.sharding import bytes_per_device, model_mesh, shard_model  # noqa: E402
from jpaged.worker.model_runner import ModelRunner  # noqa: E402

SIZES = (1, 2, 4, 8)
BLOCK_SIZE = 16
PREFILL_TOKENS = 64


def model_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816,
                       num_layers=num_layers, num_heads=32, num_kv_heads=8, head_dim=32)


def decode_inputs(batch: int, context: int) -> tuple[np.ndarray, AttentionMetadata]:
    """One new token for each of `batch` sequences of `context` tokens, in disjoint blocks."""
    blocks = -(-context // BLOCK_SIZE)
    tables = 1 + np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    last = context - 1
    metadata = AttentionMetadata(
        slot_mapping=(tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE)[None],
        positions=np.full(batch, last, np.int32),
        block_tables=tables[None],
        context_lens=np.full(batch, context, np.int32),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        logits_indices=np.arange(batch, dtype=np.int32),
    )
    return np.ones(batch, np.int32), metadata


def prefill_inputs() -> tuple[np.ndarray, AttentionMetadata]:
    """One sequence's first PREFILL_TOKENS tokens."""
    blocks = PREFILL_TOKENS // BLOCK_SIZE
    positions = np.arange(PREFILL_TOKENS, dtype=np.int32)
    metadata = AttentionMetadata(
        slot_mapping=(BLOCK_SIZE + positions)[None],
        positions=positions,
        block_tables=1 + np.arange(blocks, dtype=np.int32)[None, None],
        context_lens=np.array([PREFILL_TOKENS], np.int32),
        query_start_loc=np.array([0, PREFILL_TOKENS], np.int32),
        logits_indices=np.array([PREFILL_TOKENS - 1], np.int32),
    )
    return np.ones(PREFILL_TOKENS, np.int32), metadata


def runner_for(model, config: LlamaConfig, size: int, num_blocks: int) -> ModelRunner:
    mesh = None
    if size > 1:
        mesh = model_mesh(jax.devices()[:size])
        model, config = shard_model(model, config, mesh)
    return ModelRunner(model, config, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                       attention_backend="xla", mesh=mesh)


def timed(runner: ModelRunner, inputs, decode_only: bool) -> float:
    input_ids, metadata = inputs
    started = time.perf_counter()
    logits, _ = runner.execute(input_ids, metadata, decode_only=decode_only,
                               num_rows=len(metadata.context_lens))
    logits.block_until_ready()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    report = new_report("benchmarks.tp")
    if jax.device_count() < NUM_DEVICES:
        raise SystemExit(f"needs {NUM_DEVICES} devices, JAX sees {jax.device_count()}: "
                         "start it in a fresh process")
    config = model_config(args.layers)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    num_blocks = 1 + args.batch * -(-args.context // BLOCK_SIZE)
    runners = {size: runner_for(model, config, size, num_blocks) for size in SIZES}
    decode, prefill = decode_inputs(args.batch, args.context), prefill_inputs()
    for runner in runners.values():  # compile
        timed(runner, decode, True)
        timed(runner, prefill, False)
    times = {size: {"decode": [], "prefill": []} for size in SIZES}
    for _ in range(args.rounds):
        for size, runner in runners.items():
            times[size]["decode"].append(timed(runner, decode, True))
            times[size]["prefill"].append(timed(runner, prefill, False))
    results = {}
    for size, runner in runners.items():
        decode_ms = 1e3 * statistics.median(times[size]["decode"])
        prefill_ms = 1e3 * statistics.median(times[size]["prefill"])
        results[f"tp{size}"] = {
            "decode_step_ms": round(decode_ms, 2),
            "prefill_step_ms": round(prefill_ms, 2),
            "decode_vs_tp1": round(decode_ms / (1e3 * statistics.median(times[1]["decode"])), 3),
            "prefill_vs_tp1": round(
                prefill_ms / (1e3 * statistics.median(times[1]["prefill"])), 3),
            "param_bytes_per_device": sum(
                bytes_per_device(leaf) for leaf in jax.tree.leaves(runner.params)),
            "kv_bytes_per_device": sum(
                bytes_per_device(leaf) for leaf in jax.tree.leaves(runner.kv_cache)),
        }
        progress(f"TP={size}: {results[f'tp{size}']}")
    report["machine"]["devices"] = jax.device_count()
    print(json.dumps(report | {
        "note": ("simulated CPU devices share the host's cores: times measure the overhead "
                 "of the sharded step, not the speed-up of more hardware (a ratio below 1 "
                 "is the shards' work spread over more host threads); bytes per device "
                 "are what a real mesh holds"),
        "settings": {"model": {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                               "intermediate_size": config.intermediate_size,
                               "num_heads": config.num_heads,
                               "num_kv_heads": config.num_kv_heads,
                               "head_dim": config.head_dim, "vocab_size": config.vocab_size,
                               "dtype": "float32", "random_init": True},
                     "decode_batch": args.batch, "context": args.context,
                     "prefill_tokens": PREFILL_TOKENS, "block_size": BLOCK_SIZE,
                     "num_blocks": num_blocks, "attention_backend": "xla",
                     "rounds": args.rounds},
        "results": results,
    }))


if __name__ == "__main__":
    main()
