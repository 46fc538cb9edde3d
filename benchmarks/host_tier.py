"""The prefix cache's host tier: what writing every registered block through to host
memory costs a batch, and what loading a block back costs against computing it again.

    python -m benchmarks.host_tier [--rounds N] [--quick]

SmolLM2-135M-Instruct (float32, greedy, prefix caching on) on one device pool:

1. write-through: --num-requests distinct random prompts of --prompt-len tokens, all
   at once, --max-tokens each (ignore_eos), on two warmed engines alike but for the
   host pool (kv_offloading_size 1 GiB, or none). Every full block either engine
   registers is new, so the tier's engine stores each one: the most a batch pays.
   The engines alternate within each of --rounds rounds (other prompts each round);
   reported: output tokens/s medians, each round's ratio (tier over none) and their
   range, and the blocks and bytes the tier stored.
2. load against recompute: one prompt of --long-len tokens. Recompute: its prefill
   alone (max_tokens 1, prefix caching off), per full block. Load: the host-to-device
   copy of its blocks (`ModelRunner.apply_block_ops` with a load of every block, the
   copies first stored there), per block. Medians of --rounds, alternating.

On this CPU the device and the host are the same memory: a load is a copy within RAM,
where an accelerator copies over its host link (experiments' chatbot study projects
that). One JSON object last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np

from experiments.report import new_report, progress, record_end_load
from jpaged import LLM, SamplingParams
from jpaged.memory.allocator import BlockOps
from jpaged.model.loader import default_model_directory, load_model

BLOCK_SIZE = 16
HOST_GIB = 1.0


def _prompts(rng: np.random.Generator, vocab_size: int, count: int, length: int):
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(count)]


def _engine(loaded, args, **kwargs) -> LLM:
    config = dict(block_size=BLOCK_SIZE,
                  num_blocks=args.num_requests * ((args.prompt_len + args.max_tokens)
                                                  // BLOCK_SIZE + 2) + 1,
                  max_num_seqs=args.num_requests, max_num_batched_tokens=2048,
                  max_model_len=max(args.long_len, args.prompt_len + args.max_tokens) + 16,
                  enable_prefix_caching=True, num_decode_steps=1)
    return LLM("smollm2", loaded=loaded, **(config | kwargs))


def write_through(loaded, args, rng) -> dict:
    engines = {"tier": _engine(loaded, args, kv_offloading_size=HOST_GIB),
               "none": _engine(loaded, args)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = loaded[1].vocab_size
    for llm in engines.values():  # compiles every shape the rounds meet
        llm.generate(_prompts(rng, vocab, args.num_requests, args.prompt_len), params)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        prompts = _prompts(rng, vocab, args.num_requests, args.prompt_len)
        for name in order:
            started = time.perf_counter()
            outputs = engines[name].generate(prompts, params)
            seconds = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(tokens / seconds)
        progress(f"round {round_index}: tier {rates['tier'][-1]:.1f}, none "
                 f"{rates['none'][-1]:.1f} tokens/s")
    ratios = [t / n for t, n in zip(rates["tier"], rates["none"], strict=True)]
    pool = engines["tier"].engine.state().host_pool
    return {
        "tokens_per_s_median": {name: statistics.median(r) for name, r in rates.items()},
        "ratio_tier_over_none": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)], "ratios": ratios,
        "stored_blocks": pool.stored_blocks, "host_block_bytes": pool.block_bytes,
        "stored_bytes": pool.stored_blocks * pool.block_bytes,
    }


def load_against_recompute(loaded, args, rng) -> dict:
    llm = _engine(loaded, args, kv_offloading_size=HOST_GIB, enable_prefix_caching=False)
    runner = llm.engine.runner
    prompt = _prompts(rng, loaded[1].vocab_size, 1, args.long_len)[0]
    num_blocks = args.long_len // BLOCK_SIZE
    pairs = np.stack([np.arange(1, num_blocks + 1), np.arange(num_blocks)], axis=1)
    stores = dataclasses.replace(BlockOps.none(), store=pairs.astype(np.int32))
    loads = dataclasses.replace(BlockOps.none(), load=pairs[:, ::-1].astype(np.int32).copy())
    first_token = SamplingParams(temperature=0.0, max_tokens=1)

    def recompute() -> float:
        started = time.perf_counter()
        llm.generate([prompt], first_token)
        return time.perf_counter() - started

    def load() -> float:
        started = time.perf_counter()
        runner.apply_block_ops(loads)
        jax.block_until_ready(runner.kv_cache)
        return time.perf_counter() - started

    runner.apply_block_ops(stores)
    recompute(), load()  # compiled
    times: dict[str, list[float]] = {"recompute": [], "load": []}
    for _ in range(args.rounds):
        times["recompute"].append(recompute())
        times["load"].append(load())
    per_block = {name: statistics.median(t) / num_blocks for name, t in times.items()}
    return {
        "prompt_tokens": args.long_len, "blocks": num_blocks,
        "host_block_bytes": runner.host_kv.block_bytes,
        "seconds_per_block": per_block,
        "load_over_recompute": per_block["load"] / per_block["recompute"],
        "load_bytes_per_s": runner.host_kv.block_bytes / per_block["load"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 4 requests of 64 tokens, a 256-token prompt")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.num_requests, args.prompt_len, args.long_len = 2, 4, 64, 256
    report = new_report("benchmarks.host_tier")
    loaded = load_model(default_model_directory())
    rng = np.random.default_rng(0)
    report["write_through"] = write_through(loaded, args, rng)
    report["load_against_recompute"] = load_against_recompute(loaded, args, rng)
    record_end_load(report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
