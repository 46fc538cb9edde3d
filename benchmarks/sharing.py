"""What block sharing saves and buys: parallel sampling and beam search on the default model.

    python -m benchmarks.sharing [--num-requests 16] [--quick]

The paper's Figure 15 measures the KV memory that sharing saves when every
request asks for n parallel samples or a beam search of width w. This runs the
same on the real engine (SmolLM2-135M-Instruct, float32, prefix caching off so
that forks are the only sharing), for Alpaca-like and ShareGPT-like request
lengths from experiments.workloads, all requests arriving at once:

- memory saved, two ways, on a pool too large to bind: within the sharing run,
  1 - physical / logical block-steps (logical counts every sequence's table as
  if private); and across runs, 1 - the sharing run's physical block-steps /
  the `share_blocks=False` run's (the same requests; seeded samples and
  greedy beams make both runs take the same steps);
- output tokens/s with sharing on and off at one KV budget that binds: a pool
  holding max_num_seqs / 2 sequences of the dataset's mean length (n = 4 and
  beam width 4);
- jpaged's beam search (width 4, transformers' scoring) against transformers'
  `generate(num_beams=4)` on the same Alpaca-like requests, the peer at its
  best of static batches of 1, 4 and 8.

Lengths are scaled as benchmarks.throughput scales them: ShareGPT-like by
--sharegpt-scale (a CPU cannot serve the full lengths), Alpaca-like not at all;
the block size is 16 times the scale, so a request spans as many blocks as at
full length with the paper's block size 16. Prompts are random token ids;
outputs run to their sampled length (ignore_eos). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.throughput import MAX_TOTAL_LEN, mixed_workload

# The paper's section 6.3: memory saved by sharing, OPT-13B, widths / n of 2 to 6.
PAPER_FIGURE_15_PCT = {
    "alpaca": {"parallel": [6.1, 9.8], "beam": [37.6, 55.2]},
    "sharegpt": {"parallel": [16.2, 30.5], "beam": [44.3, 66.3]},
}
PAPER_BLOCK_SIZE = 16
SHARING_DEGREES = (2, 4, 6)
THROUGHPUT_DEGREE = 4
PEER_BATCH_SIZES = (1, 4, 8)
BEAM_WIDTH_VS_PEER = 4

Workload = list[tuple[list[int], int]]  # (prompt token ids, output length) per request


@dataclass(frozen=True)
class Case:
    """One sharing setting: every request asks for n samples or a beam of this width."""

    kind: str  # "parallel" or "beam"
    degree: int

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.degree}"

    def params(self, index: int, max_tokens: int, scoring: str = "vllm"):
        from jpaged import BeamSearchParams, SamplingParams

        if self.kind == "parallel":
            return SamplingParams(n=self.degree, temperature=1.0, seed=index,
                                  max_tokens=max_tokens, ignore_eos=True)
        return BeamSearchParams(beam_width=self.degree, max_tokens=max_tokens,
                                ignore_eos=True, scoring=scoring)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def serve(engine, workload: Workload, case: Case, scoring: str = "vllm") -> dict:
    """Run every request of `workload` at once under `case`; the engine's stats of the run."""
    from jpaged.engine.stats import EngineStats

    engine.stats = EngineStats()
    pending = set()
    for index, (prompt, max_tokens) in enumerate(workload):
        request_id = f"{case.name}-{index}"
        engine.add_request(request_id, {"prompt_token_ids": prompt},
                           case.params(index, max_tokens, scoring))
        pending.add(request_id)
    started = time.perf_counter()
    num_tokens = 0
    while pending:
        for output in engine.step():
            if output.finished:
                pending.discard(output.request_id)
                num_tokens += sum(len(o.token_ids) for o in output.outputs)
    elapsed = time.perf_counter() - started
    stats = engine.stats
    return {
        "elapsed_s": elapsed,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / elapsed,
        "steps": stats.num_steps,
        "logical_block_steps": stats.logical_block_steps,
        "physical_block_steps": stats.physical_block_steps,
        "preemptions": stats.num_preemptions,
        "running_requests_mean": stats.num_running.mean,
        "kv_utilization_mean": stats.kv_utilization.mean,
    }


def make_engine(loaded, block_size: int, num_blocks: int, share_blocks: bool, args):
    from jpaged.engine.llm_engine import EngineConfig, LLMEngine

    config = EngineConfig(
        block_size=block_size, num_blocks=num_blocks, share_blocks=share_blocks,
        enable_prefix_caching=False, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=MAX_TOTAL_LEN,
    )
    return LLMEngine(config, loaded=loaded)


def _pct(saved: float) -> float:
    return round(100.0 * saved, 2)


def memory_study(loaded, dataset: str, workload: Workload, block_size: int, cases, args) -> dict:
    """Memory saved per case, on a pool that holds max_num_seqs full-length sequences."""
    num_blocks = args.max_num_seqs * math.ceil(MAX_TOTAL_LEN / block_size) + 1
    runs = {}
    for share_blocks in (True, False):
        engine = make_engine(loaded, block_size, num_blocks, share_blocks, args)
        for case in cases:
            runs[case.name, share_blocks] = serve(engine, workload, case)
            _progress(f"{dataset} memory {case.name} share_blocks={share_blocks}: "
                      f"{runs[case.name, share_blocks]['elapsed_s']:.1f} s")
        del engine
    result = {}
    for case in cases:
        on, off = runs[case.name, True], runs[case.name, False]
        result[case.name] = {
            "memory_saved_pct": _pct(1 - on["physical_block_steps"] / on["logical_block_steps"]),
            "memory_saved_vs_no_sharing_pct": _pct(
                1 - on["physical_block_steps"] / off["physical_block_steps"]),
            "steps": {"sharing": on["steps"], "no_sharing": off["steps"]},
            "kv_blocks_physical_mean": {"sharing": on["physical_block_steps"] / on["steps"],
                                        "no_sharing": off["physical_block_steps"] / off["steps"]},
        }
    return result


def throughput_study(loaded, dataset: str, workload: Workload, warmup: Workload,
                     block_size: int, cases, args) -> dict:
    """Output tokens/s with sharing on and off at one binding KV budget."""
    mean_len = np.mean([len(p) + o for p, o in workload])
    num_blocks = math.ceil(args.max_num_seqs / 2 * mean_len / block_size) + 1
    engines = {share: make_engine(loaded, block_size, num_blocks, share, args)
               for share in (True, False)}
    for share, engine in engines.items():
        for case in cases:
            serve(engine, warmup, case)  # compiles the shapes the timed run meets
        _progress(f"{dataset} throughput warm-up, share_blocks={share}: done")
    result = {"kv_pool_blocks": num_blocks - 1, "block_size": block_size}
    for case in cases:
        on, off = (serve(engines[share], workload, case) for share in (True, False))
        _progress(f"{dataset} throughput {case.name}: {on['output_tokens_per_s']:.0f} vs "
                  f"{off['output_tokens_per_s']:.0f} tok/s")
        result[case.name] = {
            "output_tokens_per_s": {"sharing": on["output_tokens_per_s"],
                                    "no_sharing": off["output_tokens_per_s"]},
            "speedup": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            "running_requests_mean": {"sharing": on["running_requests_mean"],
                                      "no_sharing": off["running_requests_mean"]},
            "kv_utilization_mean": {"sharing": on["kv_utilization_mean"],
                                    "no_sharing": off["kv_utilization_mean"]},
            "preemptions": {"sharing": on["preemptions"], "no_sharing": off["preemptions"]},
        }
    return result


def jpaged_beam_time(loaded, workload: Workload, warmup: Workload, args) -> dict:
    case = Case("beam", BEAM_WIDTH_VS_PEER)
    num_blocks = args.max_num_seqs * math.ceil(MAX_TOTAL_LEN / PAPER_BLOCK_SIZE) + 1
    engine = make_engine(loaded, PAPER_BLOCK_SIZE, num_blocks, True, args)
    serve(engine, warmup, case, scoring="transformers")
    run = serve(engine, workload, case, scoring="transformers")
    return {"elapsed_s": run["elapsed_s"], "requests_per_s": len(workload) / run["elapsed_s"]}


def transformers_beam_time(model, workload: Workload, batch_size: int) -> dict:
    """transformers' generate(num_beams) over static, left-padded batches."""
    import torch

    pad_id = 0

    def generate(batch: Workload) -> None:
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        max_new = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, num_beams=BEAM_WIDTH_VS_PEER,
                           do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                           pad_token_id=pad_id)

    generate(workload[:1])
    started = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        generate(workload[start : start + batch_size])
    elapsed = time.perf_counter() - started
    return {"elapsed_s": elapsed, "requests_per_s": len(workload) / elapsed}


def beam_vs_transformers(loaded, vocab: int, args) -> dict:
    num_requests = args.beam_requests
    workload = mixed_workload(num_requests, 1.0, vocab, args.seed, args.seed + 1, "alpaca")
    warmup = mixed_workload(num_requests, 1.0, vocab, args.seed, args.seed + 2, "alpaca")
    ours = jpaged_beam_time(loaded, workload, warmup, args)
    _progress(f"jpaged beam search width {BEAM_WIDTH_VS_PEER}: {ours['elapsed_s']:.1f} s")
    import torch
    import transformers

    from jpaged.model.loader import default_model_directory

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_directory(), dtype=torch.float32).eval()
    peers = {}
    for batch_size in PEER_BATCH_SIZES:
        peers[batch_size] = transformers_beam_time(model, workload, batch_size)
        _progress(f"transformers beam search, batch {batch_size}: "
                  f"{peers[batch_size]['elapsed_s']:.1f} s")
    best = min(peers, key=lambda b: peers[b]["elapsed_s"])
    return {
        "requests": num_requests,
        "output_tokens_per_beam": sum(o for _, o in workload),
        "jpaged": ours,
        "transformers_by_batch_size": peers,
        "transformers_best_batch_size": best,
        "beam_speedup_vs_transformers": peers[best]["elapsed_s"] / ours["elapsed_s"],
    }


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("jax", "jaxlib", "flax", "torch", "transformers")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--beam-requests", type=int, default=16,
                        help="Alpaca-like requests for the beam search against transformers")
    parser.add_argument("--sharegpt-scale", type=float, default=0.25,
                        help="factor on ShareGPT-like lengths, to fit a CPU")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a few requests, widths 2 and 4: checks the script, not the numbers")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.beam_requests = 6, 4
    degrees = SHARING_DEGREES[:2] if args.quick else SHARING_DEGREES
    cases = [Case(kind, degree) for kind in ("parallel", "beam") for degree in degrees]

    from jpaged.model.loader import load_model

    loaded = load_model("smollm2")
    vocab = loaded[1].vocab_size
    datasets = {}
    for dataset, scale in (("alpaca", 1.0), ("sharegpt", args.sharegpt_scale)):
        block_size = max(1, round(PAPER_BLOCK_SIZE * scale))
        workload = mixed_workload(args.num_requests, scale, vocab, args.seed, args.seed + 1,
                                  dataset)
        warmup = mixed_workload(args.num_requests, scale, vocab, args.seed, args.seed + 2,
                                dataset)
        datasets[dataset] = {
            "length_scale": scale,
            "block_size": block_size,
            "mean_prompt_len": float(np.mean([len(p) for p, _ in workload])),
            "mean_output_len": float(np.mean([o for _, o in workload])),
            "memory": memory_study(loaded, dataset, workload, block_size, cases, args),
            "throughput": throughput_study(
                loaded, dataset, workload, warmup, block_size,
                [case for case in cases if case.degree == THROUGHPUT_DEGREE], args),
            "paper_figure_15_memory_saved_pct": PAPER_FIGURE_15_PCT[dataset],
        }
    beam = beam_vs_transformers(loaded, vocab, args)
    report = {
        "benchmark": "sharing",
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "cpus": len(os.sched_getaffinity(0))},
        "versions": _versions(),
        "settings": vars(args) | {"model": "smollm2 (SmolLM2-135M-Instruct)", "dtype": "float32",
                                  "max_total_len": MAX_TOTAL_LEN, "prefix_caching": False},
        "datasets": datasets,
        "beam_search_vs_transformers": beam,
        "targets": {"beam_speedup_vs_transformers": ">= 3"},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
