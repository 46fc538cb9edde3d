"""Compile cost: every step shape from an empty compilation cache, and the step times
the compiled code then gives.

    python -m benchmarks.warmup [--model DIR] [--prompt-len N] [--num-decode-steps S]
                                [--async-scheduling]

Runs in a fresh child process (so nothing is compiled yet, in memory or on disk:
the persistent compilation cache is off) on the default model (or --model) with
the engine's default limits (`EngineConfig()`):

- cold_warmup_s: `LLMEngine.warmup()`, which compiles every model step shape
  the limits allow, the sampler with and without penalties for every row
  count, and the prompt log-probabilities for every token count;
- step times after warm-up, on real requests: a 512-token prefill step, a
  decode step of 32 sequences and a decode step of one sequence (medians);
- the compiled decode step's memory analysis beside the KV cache's size: the
  cache aliased to the output, and scratch far below it (no copy per step).

--num-decode-steps and --async-scheduling set those options (warm-up then also
compiles the decode loop of every decode shape, or the feeding of each step's inputs);
with the loop, step times are left out (a step is then a whole loop).

Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments.report import new_report, progress

TARGET_COLD_WARMUP_S = 30.0
NUM_DECODE_STEPS = 16


def _timed_steps(engine, num_steps: int) -> list[float]:
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def _step_times(engine, vocab: int, prompt_len: int, seed: int) -> dict:
    """Median seconds of prefill and decode steps at the engine's limits, then at batch 1."""
    from jpaged import SamplingParams

    config = engine.config
    rng = np.random.default_rng(seed)
    num_seqs = config.max_num_seqs
    max_tokens = NUM_DECODE_STEPS + 4
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"batch-{i}", rng.integers(0, vocab, prompt_len).tolist(), params)
    num_prefill_steps = num_seqs * prompt_len // config.max_num_batched_tokens
    prefill = _timed_steps(engine, num_prefill_steps)
    while any(not s.group.seqs[0].output_token_ids
              for s in engine.output_processor.requests.values()):
        engine.step()
    decode = _timed_steps(engine, NUM_DECODE_STEPS)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("single", rng.integers(0, vocab, prompt_len).tolist(), params)
    engine.step()
    single = _timed_steps(engine, NUM_DECODE_STEPS)
    return {
        f"prefill_step_{config.max_num_batched_tokens}_tokens_s": float(np.median(prefill)),
        f"decode_step_{num_seqs}_seqs_s": float(np.median(decode)),
        "decode_step_1_seq_s": float(np.median(single)),
    }


def _step_memory(engine) -> dict:
    """Bytes of the largest decode step's memory analysis beside the KV cache's."""
    import jax

    from jpaged.core.step_shapes import bucket

    config, buckets = engine.config, engine.shapes.buckets
    num_seqs = bucket(config.max_num_seqs, buckets.min_num_seqs, buckets.linear_step)
    num_blocks = bucket(-(-engine.max_model_len // config.block_size), buckets.min_blocks_per_seq)
    memory = engine.runner.compile_step(num_seqs, num_seqs, num_blocks, True).memory_analysis()
    return {"kv_cache_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(engine.runner.kv_cache)),
            "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes}


def run_child(args) -> dict:
    import jax

    from jpaged.engine.llm_engine import EngineConfig, LLMEngine
    from jpaged.model.loader import load_model

    assert jax.config.jax_compilation_cache_dir is None, "a persistent compilation cache is set"
    started = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(persistent_compilation_cache=False,
                                    num_decode_steps=args.num_decode_steps,
                                    async_scheduling=args.async_scheduling), loaded=loaded)
    engine_start_s = time.perf_counter() - started
    progress(f"model loaded in {load_s:.1f} s, engine started in {engine_start_s:.1f} s")
    started = time.perf_counter()
    num_shapes = engine.warmup()
    cold_warmup_s = time.perf_counter() - started
    progress(f"warm-up: {num_shapes} step shapes in {cold_warmup_s:.1f} s")
    config = engine.config
    return {
        "cold_warmup_s": cold_warmup_s,
        "num_step_shapes": num_shapes,
        "model_load_s": load_s,
        "engine_start_s": engine_start_s,
        "attention_backend": engine.runner.attention_backend,
        "limits": {"max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_model_len": engine.max_model_len, "block_size": config.block_size},
        "kv_cache": str(engine.kv_cache_info),
        # A step of the decode loop is a whole loop: step times are single steps'.
        "step_times": (_step_times(engine, loaded[1].vocab_size, args.prompt_len, args.seed)
                       if config.num_decode_steps == 1 else None),
        "decode_step_memory": _step_memory(engine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, or a Hugging Face directory or GGUF file")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-decode-steps", type=int, default=None)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    report = new_report("benchmarks.warmup")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    command = [sys.executable, "-m", "benchmarks.warmup", "--child", *sys.argv[1:]]
    lines = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    result = json.loads(lines.strip().splitlines()[-1])
    report |= {
        "settings": vars(args) | {"dtype": "float32",
                                  "engine_config": "EngineConfig() defaults but for the "
                                                   "options above",
                                  "persistent_compilation_cache": False},
        **result,
        "targets": {"cold_warmup_s": f"<= {TARGET_COLD_WARMUP_S}"},
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
