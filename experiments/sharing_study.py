"""The paper's Figures 14 and 15 on the real engine: parallel sampling and beam search.

Requests of one dataset (Alpaca-like at full length by default), all at once,
every request asking for n parallel samples (seeded, temperature 1) or a beam
search of width n (vLLM's scoring), prefix caching off so that forks are the
only sharing. benchmarks.sharing takes its memory figures from here too.

- Memory saved (Figure 15, `memory_saved`): 1 - physical / logical block-steps
  of the run with sharing, where logical counts every sequence's block table as
  if private, summed over the run's steps (a time average, as the paper's).
  It is measured on a run that nothing preempted, since a recomputed group
  loses its sharing: on a pool that holds every sequence of every request
  privately at its full length, or, in `run`, on the throughput run with
  sharing when that one preempted nothing.
- Throughput (Figure 14, `run`): output tokens per virtual second with block
  sharing on and off (`share_blocks=False`: forks copy their parent's blocks)
  on one pool that binds, holding max_num_seqs / 2 sequences of the mean length.

Why two runs can disagree. Summed block-steps weigh each request by its blocks
times its steps, so a small workload's few longest requests decide the figure,
and two workloads of different sizes (the sweep's 8 requests, benchmarks.sharing's
16, which are not the 8 and 8 more: lengths are drawn in batches sized by the
count) give different answers from the same code. For parallel sampling the
engine's figure is the simulator's exactly (the same scheduler and block
manager, outputs of fixed length), so the simulator shows the spread over
workload seeds cheaply; a thousand requests land inside the paper's range. Where
n times the requests exceeds max_num_seqs, a prompt computed but for its last
token waits for its samples' n rows, holding blocks no sample shares yet, which
lowers the figure a little.

Beam search can save less at a larger width: in the sweep's default run width 6
saves less than width 4 because its longest request, about half the
block-steps, has beams that part after a few output tokens into lineages that
stay apart, where width 4's share a long prefix; the other requests save about
the same at both widths. How long beams stay together is the model's doing (the
simulator's beams, which pick random parents, merge soon). Each row's
`by_request` gives every request's share of the block-steps, what it saved and
its outputs' common prefix, so that a row's figure can be traced to its requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from experiments.engine_runs import RunResult, make_engine, serve
from experiments.paper import FIGURE15_MEMORY_SAVED_PCT
from experiments.workloads import RequestSpec, scaled_workload

DEGREES = (2, 4, 6)
KINDS = ("parallel", "beam")


@dataclass(frozen=True)
class SharingSettings:
    """One dataset's runs: its lengths times length_scale (experiments.workloads'
    scaled_workload), every request with each kind and degree."""

    dataset: str = "alpaca"
    length_scale: float = 1.0
    num_requests: int = 12
    degrees: tuple[int, ...] = DEGREES
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    seed: int = 0

    def cases(self) -> list[tuple[str, int]]:
        return [(kind, degree) for kind in KINDS for degree in self.degrees]


def workload(settings: SharingSettings, vocab_size: int,
             token_seed: int | None = None) -> list[RequestSpec]:
    """The requests; another token_seed gives the same lengths (and steps) with other
    prompt tokens, as a warm-up run needs."""
    return scaled_workload(settings.dataset, settings.num_requests, scale=settings.length_scale,
                           max_total_len=settings.max_model_len, vocab_size=vocab_size,
                           seed=settings.seed, token_seed=token_seed)


def throughput_pool_tokens(requests: Sequence[RequestSpec], settings: SharingSettings) -> int:
    """A pool that binds: max_num_seqs / 2 sequences of the requests' mean length."""
    mean_len = float(np.mean([r.total_len for r in requests]))
    blocks = math.ceil(settings.max_num_seqs / 2 * mean_len / settings.block_size)
    return blocks * settings.block_size


def private_pool_tokens(requests: Sequence[RequestSpec], settings: SharingSettings) -> int:
    """A pool that holds every sequence of every request privately at its full length,
    at the widest degree, so that no run on it can preempt."""
    blocks = sum(math.ceil(r.total_len / settings.block_size) for r in requests)
    return max(settings.degrees) * blocks * settings.block_size


def engine_for(loaded, settings: SharingSettings, pool_tokens: int, share_blocks: bool = True):
    return make_engine(loaded, allocation="paged", block_size=settings.block_size,
                       num_pool_tokens=pool_tokens, max_num_seqs=settings.max_num_seqs,
                       max_num_batched_tokens=settings.max_num_batched_tokens,
                       max_model_len=settings.max_model_len, share_blocks=share_blocks)


def params_for(kind: str, degree: int, scoring: str = "vllm"):
    """spec -> the request's parameters for n parallel samples or a beam of width n."""
    from jpaged import BeamSearchParams, SamplingParams

    def params_of(spec: RequestSpec):
        if kind == "parallel":
            seed = int(spec.request_id.rsplit("-", 1)[1])
            return SamplingParams(n=degree, temperature=1.0, seed=seed,
                                  max_tokens=spec.output_len, ignore_eos=True)
        return BeamSearchParams(beam_width=degree, max_tokens=spec.output_len, ignore_eos=True,
                                scoring=scoring)

    return params_of


def serve_case(engine, requests: Sequence[RequestSpec], kind: str, degree: int,
               share_blocks: bool = True) -> RunResult:
    return serve(engine, requests, f"{kind} n={degree} share={share_blocks}",
                 params_for(kind, degree))


def common_prefix_len(outputs: Sequence[Sequence[int]]) -> int:
    """Tokens every output has in common from its start."""
    length = 0
    for tokens in zip(*outputs, strict=False):
        if len(set(tokens)) > 1:
            break
        length += 1
    return length


def memory_fields(requests: Sequence[RequestSpec], result: RunResult, pool_tokens: int) -> dict:
    """Figure 15's figure of one run with sharing, and each request's part in it."""
    total = max(result.logical_block_steps, 1)
    by_request = []
    for spec in requests:
        output = result.outputs[spec.request_id]
        by_request.append({
            "request_id": spec.request_id,
            "prompt_len": len(spec.prompt_token_ids),
            "output_len": spec.output_len,
            "block_steps_share_pct": 100.0 * output.metrics.logical_block_steps / total,
            "memory_saved_pct": 100.0 * output.metrics.kv_memory_saved,
            "common_output_prefix": common_prefix_len([o.token_ids for o in output.outputs]),
        })
    return {"memory_saved_pct": result.kv_memory_saved_pct, "memory_pool_tokens": pool_tokens,
            "by_request": by_request}


def case_fields(settings: SharingSettings, kind: str, degree: int) -> dict:
    return {"dataset": settings.dataset, "kind": kind, "degree": degree,
            "paper_memory_saved_pct": str(FIGURE15_MEMORY_SAVED_PCT[settings.dataset][kind])}


def memory_saved(loaded, settings: SharingSettings, vocab_size: int, progress) -> list[dict]:
    """Figure 15 alone: one row per (kind, degree), served with sharing on a pool that
    holds every sequence privately."""
    requests = workload(settings, vocab_size)
    pool = private_pool_tokens(requests, settings)
    engine = engine_for(loaded, settings, pool)
    rows = []
    for kind, degree in settings.cases():
        rows.append(case_fields(settings, kind, degree)
                    | memory_fields(requests, serve_case(engine, requests, kind, degree), pool))
        progress(f"{settings.dataset} {kind} n={degree}: saved "
                 f"{rows[-1]['memory_saved_pct']:.1f} %")
    return rows


def throughput_fields(on: RunResult, off: RunResult, pool_tokens: int) -> dict:
    """Figure 14's figures: the same requests with sharing on and off on one pool."""
    on_summary, off_summary = on.summary(), off.summary()
    return {
        "pool_tokens": pool_tokens,
        "output_tokens_per_s_sharing": on_summary["output_tokens_per_virtual_s"],
        "output_tokens_per_s_no_sharing": off_summary["output_tokens_per_virtual_s"],
        "throughput_ratio": (on_summary["output_tokens_per_virtual_s"]
                             / off_summary["output_tokens_per_virtual_s"]),
        "mean_running_requests_sharing": on.mean_running_requests,
        "mean_running_requests_no_sharing": off.mean_running_requests,
        "preemptions_sharing": on.num_preemptions,
        "preemptions_no_sharing": off.num_preemptions,
    }


def run(loaded, settings: SharingSettings, vocab_size: int, progress) -> list[dict]:
    """Figures 14 and 15: one row per (kind, degree), throughput with sharing on and off
    on a pool that binds, and the memory saved."""
    requests = workload(settings, vocab_size)
    pool = throughput_pool_tokens(requests, settings)
    engines = {share: engine_for(loaded, settings, pool, share) for share in (True, False)}
    private_pool, private_engine = private_pool_tokens(requests, settings), None
    rows = []
    for kind, degree in settings.cases():
        on, off = (serve_case(engines[share], requests, kind, degree, share)
                   for share in (True, False))
        if on.num_preemptions:
            private_engine = private_engine or engine_for(loaded, settings, private_pool)
            memory = memory_fields(
                requests, serve_case(private_engine, requests, kind, degree), private_pool)
        else:
            memory = memory_fields(requests, on, pool)
        rows.append(case_fields(settings, kind, degree) | memory
                    | throughput_fields(on, off, pool))
        progress(f"{kind} n={degree}: saved {rows[-1]['memory_saved_pct']:.1f} %, "
                 f"throughput x{rows[-1]['throughput_ratio']:.2f}")
    return rows
