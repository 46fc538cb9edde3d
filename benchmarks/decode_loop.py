"""Decode steps on the device and async scheduling: how much host time they take off a
step, and what they cost.

    python -m benchmarks.decode_loop [--rounds N] [--max-tokens T] [--quick]

Two models: the default model (SmolLM2-135M, float32), whose CPU step of 30-150 ms
dwarfs the host's work, and a tiny random Llama (2 layers, hidden 128, 512 tokens),
whose step is short enough that the host's scheduling, batch building and output
processing dominate: what an accelerator's few-millisecond step of a small model
meets. For each, batches of 1, 8 and 64 requests (random 32-token prompts, greedy, T
new tokens each with ignore_eos) run on engines that differ only in
`num_decode_steps` (1: a host round trip per token; 4 and 16: the loop) or
`async_scheduling` (single steps, each scheduled while the one before it runs),
sharing one loaded model. Each engine first runs the same batch once, so that every
shape it meets is compiled; then the systems alternate within each of --rounds rounds,
and each figure is the median over rounds.

Reported per (model, batch, system): output tokens/s and its ratio to single steps,
host round trips (engine steps) per generated token, host milliseconds per generated
token (wall time not spent waiting for the device in the runner's calls that wait:
`fetch`, which a decode loop's results pass through too, and `token_logprobs`), and
the host's share of the wall time.
Targets: the tiny model at batch 8 with 16 steps at least 2x single steps' tokens/s;
SmolLM2 with the loop no slower than single steps (at least 0.98x) at every batch. One
JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from experiments.report import new_report, progress, record_end_load

BATCHES = (1, 8, 64)
# name -> (num_decode_steps, async_scheduling)
SYSTEMS = {"single": (1, False), "loop4": (4, False), "loop16": (16, False), "async": (1, True)}
PROMPT_TOKENS = 32
TINY_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024)
TARGET_TINY_BATCH8_LOOP16 = 2.0
TARGET_SMOLLM2 = 0.98
# The runner's calls that wait for the device (a decode loop waits in its fetch); the
# others only dispatch, which is host work.
DEVICE_WAITS = ("fetch", "token_logprobs")


class TokenIdText:
    """The tokenizer of a random model: each token decodes to its id."""

    eos_token_id = None

    def decode(self, token_ids, **_) -> str:
        return "".join(f" {token}" for token in token_ids)


class DeviceClock:
    """Wall time the host spends waiting for the device, in the runner's calls that wait."""

    def __init__(self, runner):
        self.seconds = 0.0
        for name in DEVICE_WAITS:
            setattr(runner, name, self._timed(getattr(runner, name)))

    def _timed(self, call):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def load(model: str):
    """(model, config, tokenizer) of `model`: "tiny" is a random Llama."""
    if model != "tiny":
        from jpaged.model.loader import load_model
        return load_model(model)
    import jax.numpy as jnp
    from flax import nnx

    from jpaged.model.config import LlamaConfig
    from jpaged.model.llama import LlamaForCausalLM
    config = LlamaConfig.from_hf_config(TINY_LLAMA)
    return LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), config, TokenIdText()


def engines(loaded, max_tokens: int) -> dict:
    from jpaged import LLM
    return {name: LLM(f"decode loop {steps}", loaded=loaded, num_decode_steps=steps,
                      async_scheduling=overlapped,
                      max_num_seqs=max(BATCHES), max_model_len=PROMPT_TOKENS + max_tokens,
                      block_size=16, num_blocks=max(BATCHES) * (PROMPT_TOKENS + max_tokens) // 16
                      + 1, persistent_compilation_cache=False)
            for name, (steps, overlapped) in SYSTEMS.items()}


def run(llm, clock: DeviceClock, prompts: list[list[int]], max_tokens: int) -> dict:
    from jpaged import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stats = llm.engine.stats
    steps, device = stats.num_steps, clock.seconds
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == len(prompts) * max_tokens, "a request lost tokens"
    host = elapsed - (clock.seconds - device)
    return {"output_tokens_per_s": tokens / elapsed,
            "round_trips_per_token": (stats.num_steps - steps) / tokens,
            "host_ms_per_token": 1e3 * host / tokens, "host_share": host / elapsed,
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def measure(model: str, rounds: int, max_tokens: int, batches: list[int]) -> dict:
    loaded = load(model)
    llms = engines(loaded, max_tokens)
    clocks = {name: DeviceClock(llm.engine.runner) for name, llm in llms.items()}
    vocab = loaded[1].vocab_size
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(0, vocab, (b, PROMPT_TOKENS)).tolist() for b in batches}
    for batch in batches:  # compile every shape of every system
        for name, llm in llms.items():
            progress(f"{model}: compiling batch {batch}, {name}")
            run(llm, clocks[name], prompts[batch], max_tokens)
    runs = {(b, name): [] for b in batches for name in SYSTEMS}
    for round_ in range(rounds):
        for batch in batches:
            for name, llm in llms.items():
                progress(f"{model}: round {round_ + 1}, batch {batch}, {name}")
                runs[batch, name].append(run(llm, clocks[name], prompts[batch], max_tokens))
    results = {}
    for batch in batches:
        single = statistics.median(r["output_tokens_per_s"] for r in runs[batch, "single"])
        rows = {}
        for name in SYSTEMS:
            figures = {key: statistics.median(r[key] for r in runs[batch, name])
                       for key in ("output_tokens_per_s", "round_trips_per_token",
                                   "host_ms_per_token", "host_share")}
            figures["vs_single"] = figures["output_tokens_per_s"] / single
            figures["tokens_equal_single"] = all(
                r["tokens"] == s["tokens"]
                for r, s in zip(runs[batch, name], runs[batch, "single"], strict=True))
            rows[name] = figures
        results[f"batch_{batch}"] = rows
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"],
                        choices=["tiny", "smollm2"])
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--quick", action="store_true",
                        help="the tiny model only, batch 8, 1 round of 16 tokens (a check, "
                        "not a figure)")
    args = parser.parse_args(argv)
    report = new_report("benchmarks.decode_loop", argv)
    models = ("tiny",) if args.quick else tuple(args.models)
    rounds, max_tokens = (1, 16) if args.quick else (args.rounds, args.max_tokens)
    batches = [8] if args.quick else args.batches
    report["settings"] = {"rounds": rounds, "max_tokens": max_tokens,
                          "prompt_tokens": PROMPT_TOKENS, "batches": batches,
                          "systems": SYSTEMS, "tiny_model": TINY_LLAMA}
    report["results"] = {model: measure(model, rounds, max_tokens, batches)
                         for model in models}
    targets = {}
    if "batch_8" in report["results"].get("tiny", {}):
        tiny = report["results"]["tiny"]["batch_8"]["loop16"]["vs_single"]
        targets["tiny_batch8_loop16_vs_single"] = {
            "target": TARGET_TINY_BATCH8_LOOP16, "measured": tiny,
            "met": tiny >= TARGET_TINY_BATCH8_LOOP16}
    if "smollm2" in report["results"]:
        worst = min(row["vs_single"] for batch in report["results"]["smollm2"].values()
                    for name, row in batch.items() if name.startswith("loop"))
        targets["smollm2_worst_loop_vs_single"] = {"target": TARGET_SMOLLM2, "measured": worst,
                                                   "met": worst >= TARGET_SMOLLM2}
    report["targets"] = targets
    record_end_load(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
