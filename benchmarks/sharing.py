"""What block sharing saves and buys: parallel sampling and beam search on the default model.

    python -m benchmarks.sharing [--num-requests 16] [--quick]

On the real engine (SmolLM2-135M-Instruct, float32, prefix caching off so that
forks are the only sharing), for Alpaca-like and ShareGPT-like request lengths
from experiments.workloads, all requests arriving at once, every request asking
for n parallel samples or a beam search of width n:

- memory saved (the paper's Figure 15): experiments.sharing_study's
  `memory_saved`, 1 - physical / logical block-steps of the run with sharing
  on a pool no run can preempt in (its docstring says why a small workload's
  figure depends on its longest requests);
- output tokens/s (wall clock, after a warm-up run with other prompt tokens
  that compiles the same shapes) with sharing on and off at one KV budget that
  binds: the study's pool of max_num_seqs / 2 sequences of the mean length
  (n = 4 and beam width 4);
- jpaged's beam search (width 4, transformers' scoring) against transformers'
  `generate(num_beams=4)` on the same Alpaca-like requests, the peer at its
  best of static batches of 1, 4 and 8.

Lengths are scaled as benchmarks.throughput scales them: ShareGPT-like by
--sharegpt-scale (a CPU cannot serve the full lengths), Alpaca-like not at all;
the block size is the paper's 16 times the scale, so a request spans as many
blocks as at full length with the paper's block size. Prompts are random token
ids; outputs run to their sampled length (ignore_eos). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from benchmarks.throughput import MAX_TOTAL_LEN
from experiments import sharing_study
from experiments.engine_runs import serve
from experiments.paper import BLOCK_SIZE_TOKENS, FIGURE15_MEMORY_SAVED_PCT
from experiments.report import new_report, progress
from experiments.sharing_study import SharingSettings
from experiments.workloads import RequestSpec

SHARING_DEGREES = (2, 4, 6)
THROUGHPUT_DEGREE = 4
PEER_BATCH_SIZES = (1, 4, 8)
BEAM_WIDTH_VS_PEER = 4
WARMUP_TOKEN_SEED_OFFSET = 2  # the timed requests' tokens come from seed + 1


def study_settings(args, dataset: str, scale: float, degrees: tuple[int, ...]
                   ) -> SharingSettings:
    return SharingSettings(
        dataset=dataset, length_scale=scale, num_requests=args.num_requests, degrees=degrees,
        block_size=max(1, round(BLOCK_SIZE_TOKENS * scale)), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=MAX_TOTAL_LEN,
        seed=args.seed)


def warmup_workload(settings: SharingSettings, vocab: int) -> list[RequestSpec]:
    return sharing_study.workload(settings, vocab, settings.seed + WARMUP_TOKEN_SEED_OFFSET)


def _sides(on, off, measure) -> dict:
    return {"sharing": measure(on), "no_sharing": measure(off)}


def throughput_study(loaded, settings: SharingSettings, vocab: int) -> dict:
    """Output tokens/s with sharing on and off on the study's binding pool, per case."""
    requests = sharing_study.workload(settings, vocab)
    warmup = warmup_workload(settings, vocab)
    pool = sharing_study.throughput_pool_tokens(requests, settings)
    engines = {share: sharing_study.engine_for(loaded, settings, pool, share)
               for share in (True, False)}
    for share, engine in engines.items():
        for kind, degree in settings.cases():
            sharing_study.serve_case(engine, warmup, kind, degree, share)
        progress(f"{settings.dataset} throughput warm-up, share_blocks={share}: done")
    result = {"kv_pool_blocks": pool // settings.block_size, "block_size": settings.block_size}
    for kind, degree in settings.cases():
        on, off = (sharing_study.serve_case(engines[share], requests, kind, degree, share)
                   for share in (True, False))
        tokens_per_s = _sides(on, off, lambda run: run.output_tokens / run.wall_s)
        progress(f"{settings.dataset} throughput {kind}_{degree}: "
                 f"{tokens_per_s['sharing']:.0f} vs {tokens_per_s['no_sharing']:.0f} tok/s")
        result[f"{kind}_{degree}"] = {
            "output_tokens_per_s": tokens_per_s,
            "speedup": tokens_per_s["sharing"] / tokens_per_s["no_sharing"],
            "running_requests_mean": _sides(on, off, lambda run: run.mean_running_requests),
            "kv_utilization_mean": _sides(on, off, lambda run: run.mean_kv_utilization),
            "preemptions": _sides(on, off, lambda run: run.num_preemptions),
        }
    return result


def jpaged_beam_time(loaded, settings: SharingSettings, vocab: int) -> dict:
    """Wall time of the beam searches with transformers' scoring, after a warm-up run."""
    requests = sharing_study.workload(settings, vocab)
    pool = sharing_study.private_pool_tokens(requests, settings)
    engine = sharing_study.engine_for(loaded, settings, pool)
    params_of = sharing_study.params_for("beam", BEAM_WIDTH_VS_PEER, scoring="transformers")
    serve(engine, warmup_workload(settings, vocab), params_of=params_of)
    elapsed = serve(engine, requests, params_of=params_of).wall_s
    return {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed}


def transformers_beam_time(model, requests: list[RequestSpec], batch_size: int) -> dict:
    """transformers' generate(num_beams) over static, left-padded batches."""
    import torch

    pad_id = 0

    def generate(batch: list[RequestSpec]) -> None:
        prompts = [list(r.prompt_token_ids) for r in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        max_new = max(r.output_len for r in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, num_beams=BEAM_WIDTH_VS_PEER,
                           do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                           pad_token_id=pad_id)

    generate(requests[:1])
    started = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        generate(requests[start : start + batch_size])
    elapsed = time.perf_counter() - started
    return {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed}


def beam_vs_transformers(loaded, vocab: int, args) -> dict:
    settings = dataclasses.replace(
        study_settings(args, "alpaca", 1.0, (BEAM_WIDTH_VS_PEER,)),
        num_requests=args.beam_requests)
    ours = jpaged_beam_time(loaded, settings, vocab)
    progress(f"jpaged beam search width {BEAM_WIDTH_VS_PEER}: {ours['elapsed_s']:.1f} s")
    import torch
    import transformers

    from jpaged.model.loader import default_model_directory

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_directory(), dtype=torch.float32).eval()
    requests = sharing_study.workload(settings, vocab)
    peers = {}
    for batch_size in PEER_BATCH_SIZES:
        peers[batch_size] = transformers_beam_time(model, requests, batch_size)
        progress(f"transformers beam search, batch {batch_size}: "
                 f"{peers[batch_size]['elapsed_s']:.1f} s")
    best = min(peers, key=lambda b: peers[b]["elapsed_s"])
    return {
        "requests": settings.num_requests,
        "output_tokens_per_beam": sum(r.output_len for r in requests),
        "jpaged": ours,
        "transformers_by_batch_size": peers,
        "transformers_best_batch_size": best,
        "beam_speedup_vs_transformers": peers[best]["elapsed_s"] / ours["elapsed_s"],
    }


def dataset_section(loaded, vocab: int, dataset: str, scale: float, degrees: tuple[int, ...],
                    args) -> dict:
    settings = study_settings(args, dataset, scale, degrees)
    requests = sharing_study.workload(settings, vocab)
    memory = sharing_study.memory_saved(loaded, settings, vocab, progress)
    throughput_settings = dataclasses.replace(settings, degrees=(THROUGHPUT_DEGREE,))
    return {
        "length_scale": scale,
        "block_size": settings.block_size,
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in requests])),
        "mean_output_len": float(np.mean([r.output_len for r in requests])),
        "memory": {f"{row['kind']}_{row['degree']}": row for row in memory},
        "throughput": throughput_study(loaded, throughput_settings, vocab),
        "paper_figure_15_memory_saved_pct": {
            kind: [span.low, span.high]
            for kind, span in FIGURE15_MEMORY_SAVED_PCT[dataset].items()},
    }


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
    report = new_report("benchmarks.sharing", peers=("torch", "transformers"))
    if args.quick:
        args.num_requests, args.beam_requests = 6, 4
    degrees = SHARING_DEGREES[:2] if args.quick else SHARING_DEGREES

    from jpaged.model.loader import load_model

    loaded = load_model("smollm2")
    vocab = loaded[1].vocab_size
    datasets = {dataset: dataset_section(loaded, vocab, dataset, scale, degrees, args)
                for dataset, scale in (("alpaca", 1.0), ("sharegpt", args.sharegpt_scale))}
    report |= {
        "settings": vars(args) | {"model": "smollm2 (SmolLM2-135M-Instruct)", "dtype": "float32",
                                  "max_total_len": MAX_TOTAL_LEN, "prefix_caching": False},
        "datasets": datasets,
        "beam_search_vs_transformers": beam_vs_transformers(loaded, vocab, args),
        "targets": {"beam_speedup_vs_transformers": ">= 3"},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
