"""The paper's Figures 14 and 15 on the real engine: parallel sampling and beam search.

Alpaca-like requests (full length), all at once, every request asking for n
parallel samples (seeded, temperature 1) or a beam search of width n, as
benchmarks/sharing.py measures them:

- memory saved (Figure 15): 1 - physical / logical block-steps of the run with
  sharing, where logical counts every sequence's block table as if private;
- throughput (Figure 14): output tokens per virtual second with block sharing
  on and off (`share_blocks=False`: forks copy their parent's blocks) on one
  pool that binds, holding max_num_seqs / 2 sequences of the mean length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from experiments.engine_runs import make_engine, serve
from experiments.workloads import RequestSpec, scaled_workload

PAPER_FIGURE_15_PCT = {"parallel": "6.1-9.8", "beam": "37.6-55.2"}  # Alpaca, OPT-13B
DEGREES = (2, 4, 6)


@dataclass(frozen=True)
class SharingSettings:
    num_requests: int = 12
    degrees: tuple[int, ...] = DEGREES
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    seed: int = 0


def params_for(kind: str, degree: int):
    """spec -> the request's parameters for n parallel samples or a beam of width n."""
    from jpaged import BeamSearchParams, SamplingParams

    def params_of(spec: RequestSpec):
        if kind == "parallel":
            seed = int(spec.request_id.rsplit("-", 1)[1])
            return SamplingParams(n=degree, temperature=1.0, seed=seed,
                                  max_tokens=spec.output_len, ignore_eos=True)
        return BeamSearchParams(beam_width=degree, max_tokens=spec.output_len, ignore_eos=True)

    return params_of


def run(loaded, settings: SharingSettings, vocab_size: int, progress) -> list[dict]:
    """One row per (kind, degree): memory saved and throughput with sharing on and off."""
    requests = scaled_workload("alpaca", settings.num_requests, scale=1.0,
                               max_total_len=settings.max_model_len, vocab_size=vocab_size,
                               seed=settings.seed)
    mean_len = float(np.mean([r.total_len for r in requests]))
    pool = math.ceil(settings.max_num_seqs / 2 * mean_len / settings.block_size) \
        * settings.block_size
    engines = {
        share: make_engine(loaded, allocation="paged", block_size=settings.block_size,
                           num_pool_tokens=pool, max_num_seqs=settings.max_num_seqs,
                           max_num_batched_tokens=settings.max_num_batched_tokens,
                           max_model_len=settings.max_model_len, share_blocks=share)
        for share in (True, False)
    }
    rows = []
    for kind in ("parallel", "beam"):
        for degree in settings.degrees:
            params_of = params_for(kind, degree)
            on, off = (serve(engines[share], requests, f"{kind} n={degree} share={share}",
                             params_of).summary() for share in (True, False))
            rows.append({
                "kind": kind, "degree": degree, "pool_tokens": pool,
                "memory_saved_pct": on["kv_memory_saved_pct"],
                "paper_memory_saved_pct": PAPER_FIGURE_15_PCT[kind],
                "output_tokens_per_s_sharing": on["output_tokens_per_virtual_s"],
                "output_tokens_per_s_no_sharing": off["output_tokens_per_virtual_s"],
                "throughput_ratio": (on["output_tokens_per_virtual_s"]
                                     / off["output_tokens_per_virtual_s"]),
                "mean_running_requests_sharing": on["mean_running_requests"],
                "mean_running_requests_no_sharing": off["mean_running_requests"],
                "preemptions_sharing": on["num_preemptions"],
                "preemptions_no_sharing": off["num_preemptions"],
            })
            progress(f"{kind} n={degree}: saved {rows[-1]['memory_saved_pct']:.1f} %, "
                     f"throughput x{rows[-1]['throughput_ratio']:.2f}")
    return rows
