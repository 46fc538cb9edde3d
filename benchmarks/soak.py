"""Soak: the engine under random traffic, random aborts and injected faults, for a set time.

    python -m benchmarks.soak [--seconds 600] [--model smollm2]

Half the time with recompute preemption, half with swap, each on a pool small
enough that preemption is routine. Requests draw random sampling parameters
(temperature, top-p, top-k, n, logprobs, stop strings, lengths; some beam
searches); a share of the running ones is aborted at random; runner calls
(the model step, block copies and swaps, the sampler) raise at random, and
some failures also consume the donated KV cache. The block invariants are
checked after every step (`LLMEngine.check_invariants`).

A fixed set of greedy prompts is first run fault-free on a roomy engine; every
copy of them that later completes under the soak must give the same tokens.
Prints one JSON object last; `leaked_blocks` and `greedy_mismatches` must be 0.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field

import jax

from experiments.report import new_report
from jpaged import BeamSearchParams, SamplingParams
from jpaged.engine.llm_engine import EngineConfig, LLMEngine
from jpaged.model.loader import load_model

GREEDY_PROMPTS = 6
GREEDY_TOKENS = 12
# The block ops' moves to and from the host pool (swaps, and the prefix cache tier's
# stores and loads) fail on their own too.
RUNNER_CALLS = ("execute", "sample", "apply_block_ops", "_to_host", "_from_host")
HOST_POOL_GIB = 0.05


class InjectedFault(RuntimeError):
    pass


@dataclass
class Counts:
    requests: int = 0
    completed: int = 0
    errored: int = 0
    aborted: int = 0
    faults_injected: int = 0
    kv_caches_consumed: int = 0
    preemptions: int = 0
    steps: int = 0
    invariant_checks: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    leaked_blocks: int = 0
    by_mode: dict = field(default_factory=dict)


def inject_faults(engine: LLMEngine, rng: random.Random, rate: float, counts: Counts) -> None:
    """Make each runner call raise with probability `rate`; the first failing model
    step, and a quarter of the later ones, first consume the donated KV cache."""
    runner = engine.runner
    for name in RUNNER_CALLS:
        original = getattr(runner, name)

        def call(*args, name=name, original=original, **kwargs):
            if rng.random() < rate:
                counts.faults_injected += 1
                if name == "execute" and (not counts.kv_caches_consumed or rng.random() < 0.25):
                    counts.kv_caches_consumed += 1
                    for array in jax.tree.leaves(runner.kv_cache):
                        array.delete()
                raise InjectedFault(f"injected into {name}")
            return original(*args, **kwargs)

        setattr(runner, name, call)


def random_params(rng: random.Random, max_tokens: int):
    if rng.random() < 0.1:
        return BeamSearchParams(beam_width=rng.choice([2, 3]), ignore_eos=rng.random() < 0.5,
                                max_tokens=rng.randint(1, max_tokens))
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]),
        temperature=rng.choice([0.0, 0.5, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([-1, 20]),
        max_tokens=rng.randint(1, max_tokens),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 2]),
        stop=rng.choice([None, ["."], ["the", "\n"]]),
        seed=rng.choice([None, rng.randrange(1000)]),
    )


def greedy_requests(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))]
            for _ in range(GREEDY_PROMPTS)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)


def reference_outputs(loaded, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy prompts on a roomy, fault-free engine."""
    engine = LLMEngine(EngineConfig(block_size=8, max_num_seqs=8, max_model_len=256,
                                    num_blocks=512), loaded=loaded)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = output.outputs[0].token_ids
    return [outputs[i] for i in range(len(prompts))]


def soak(loaded, mode: str, seconds: float, args, references, counts: Counts) -> None:
    """Random traffic with faults on a small pool for `seconds`, then drain."""
    rng = random.Random(f"{args.seed}-{mode}")
    vocab = loaded[1].vocab_size
    engine = LLMEngine(EngineConfig(
        block_size=4, num_blocks=args.num_blocks, kv_offloading_size=HOST_POOL_GIB,
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
        preemption_mode=mode, persistent_compilation_cache=False,
    ), loaded=loaded)
    inject_faults(engine, rng, args.fault_rate, counts)
    greedy_prompts = greedy_requests(vocab, args.seed)
    greedy_of: dict[str, int] = {}
    live: set[str] = set()
    deadline = time.perf_counter() + seconds
    start_preemptions = engine.scheduler.num_preemptions
    next_id = 0
    def soaking() -> bool:
        return time.perf_counter() < deadline or engine.stats.num_steps < args.min_steps

    while soaking() or live:
        arriving = soaking() and len(live) < 12
        if arriving and rng.random() < 0.5:
            request_id = f"{mode}-{next_id}"
            next_id += 1
            if rng.random() < 0.3:
                index = rng.randrange(len(greedy_prompts))
                engine.add_request(request_id, greedy_prompts[index], GREEDY)
                greedy_of[request_id] = index
            else:
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
                engine.add_request(request_id, prompt, random_params(rng, 40))
            live.add(request_id)
            counts.requests += 1
        if live and rng.random() < 0.03:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
            counts.aborted += 1
        for output in engine.step():
            if not output.finished:
                continue
            live.discard(output.request_id)
            reasons = {o.finish_reason for o in output.outputs}
            if "error" in reasons or not output.outputs:
                counts.errored += 1
                continue
            counts.completed += 1
            index = greedy_of.get(output.request_id)
            if index is not None:
                counts.greedy_checked += 1
                counts.greedy_mismatches += output.outputs[0].token_ids != references[index]
        counts.steps += 1
        engine.check_invariants()
        counts.invariant_checks += 1
    manager = engine.block_manager
    # A free host block may still wait for the tier's last store to commit: held ones leak.
    counts.leaked_blocks += (manager.num_device_blocks - manager.num_free_blocks
                             + int(manager.state.host.refcounts.astype(bool).sum()))
    preemptions = engine.scheduler.num_preemptions - start_preemptions
    counts.preemptions += preemptions
    counts.by_mode[mode] = {"steps": engine.stats.num_steps, "preemptions": preemptions}


def run(model: str, seconds: float, args) -> dict:
    loaded = load_model(model)
    prompts = greedy_requests(loaded[1].vocab_size, args.seed)
    references = reference_outputs(loaded, prompts)
    counts = Counts()
    started = time.perf_counter()
    for mode in ("recompute", "swap"):
        soak(loaded, mode, seconds / 2, args, references, counts)
    result = {"model": model, "seconds": time.perf_counter() - started,
              "settings": {"fault_rate": args.fault_rate, "num_blocks": args.num_blocks,
                           "min_steps": args.min_steps, "seed": args.seed}}
    return result | vars(counts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--model", default="smollm2",
                        help='"smollm2", a Hugging Face directory or a .gguf file')
    parser.add_argument("--num-blocks", type=int, default=48,
                        help="device (and host) blocks of 4 tokens: few, so preemption is routine")
    parser.add_argument("--fault-rate", type=float, default=0.01,
                        help="probability that one runner call raises")
    parser.add_argument("--min-steps", type=int, default=0,
                        help="soak each preemption mode for at least this many steps too")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = new_report("benchmarks.soak", argv) | run(args.model, args.seconds, args)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
