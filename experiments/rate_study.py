"""The paper's Figure 12 on the real engine: normalized latency against request rate.

Paged allocation and Orca's three reservation policies (jpaged.memory.reservation)
serve the same requests on the same model, kernels and KV pool, with Poisson
arrivals replayed on a virtual clock of measured step times
(experiments.engine_runs). Every rule below was fixed before measuring:

- Budget: the pool holds what orca-oracle needs for a quarter of max_num_seqs
  requests of the workload's mean length (prompt + output), rounded up to whole
  blocks. max_num_seqs (64) is then well above what paging can run in that pool,
  so memory binds, not the sequence cap.
- Rates: paged first serves the workload all at once; its request throughput
  there is the capacity C. Every policy then runs at RATE_FRACTIONS x C, in
  ascending order, and stops after the first rate whose mean normalized latency
  exceeds the threshold: the interpolation needs no point past it, and a run
  past a policy's capacity is the slowest to serve.
- Threshold: THRESHOLD_FACTOR x the mean normalized latency paged measures at
  the lowest rate (the unloaded system). The rate a policy sustains is where its
  curve first crosses the threshold, interpolated linearly between the two
  measured rates around the crossing.

The Orca policies here reserve paged blocks, which fragment nothing outside a
sequence: they flatter Orca, whose contiguous slabs also fragment externally.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from experiments.engine_runs import make_engine, serve
from experiments.workloads import RequestSpec, scaled_workload
from jpaged.memory.reservation import ALLOCATIONS

RATE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25)
THRESHOLD_FACTOR = 3.0
# Lengths scaled as benchmarks/throughput.py scales them to fit a CPU.
LENGTH_SCALES = {"sharegpt": 0.25, "alpaca": 1.0}
PAPER_RATE_RATIOS = {"vs_orca_oracle": "1.7-2.7", "vs_orca_max": "2.7-8"}


@dataclass(frozen=True)
class RateSettings:
    """One dataset's Figure-12 runs."""

    dataset: str
    num_requests: int = 16
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    rate_fractions: tuple[float, ...] = RATE_FRACTIONS
    policies: tuple[str, ...] = ALLOCATIONS
    seed: int = 0
    length_scale_override: float | None = None

    def __post_init__(self):
        if self.policies[0] != "paged":
            raise ValueError(f"policies must start with 'paged' (it sets the threshold), "
                             f"got {self.policies}")

    @property
    def length_scale(self) -> float:
        """LENGTH_SCALES of the dataset unless overridden (--quick shortens requests)."""
        return self.length_scale_override or LENGTH_SCALES[self.dataset]


def workload(settings: RateSettings, vocab_size: int, request_rate: float = math.inf
             ) -> list[RequestSpec]:
    """The dataset's scaled requests; the same lengths and tokens at every rate."""
    return scaled_workload(settings.dataset, settings.num_requests, scale=settings.length_scale,
                           max_total_len=settings.max_model_len, vocab_size=vocab_size,
                           request_rate=request_rate, seed=settings.seed)


def pool_tokens(requests: list[RequestSpec], settings: RateSettings) -> int:
    """The budget rule: orca-oracle's need for max_num_seqs / 4 mean-length requests,
    in whole blocks."""
    mean_len = float(np.mean([r.total_len for r in requests]))
    tokens = settings.max_num_seqs / 4 * mean_len
    return math.ceil(tokens / settings.block_size) * settings.block_size


def engines(loaded, settings: RateSettings, num_pool_tokens: int) -> dict:
    """One engine per policy (an engine keeps its compiled steps across runs)."""
    return {
        policy: make_engine(loaded, allocation=policy, block_size=settings.block_size,
                            num_pool_tokens=num_pool_tokens,
                            max_num_seqs=settings.max_num_seqs,
                            max_num_batched_tokens=settings.max_num_batched_tokens,
                            max_model_len=settings.max_model_len)
        for policy in settings.policies
    }


def sustained_rate(rates: list[float], latencies: list[float], threshold: float
                   ) -> dict[str, float | str]:
    """Where the latency-vs-rate curve first crosses `threshold`, interpolated.

    rates ascending. "bound" says whether the rate is the crossing ("interpolated"),
    or the curve never crossed ("at least" the highest rate) or started above it
    ("at most" the lowest rate).
    """
    for i, latency in enumerate(latencies):
        if latency > threshold:
            if i == 0:
                return {"rate": rates[0], "bound": "at most"}
            r0, r1, l0, l1 = rates[i - 1], rates[i], latencies[i - 1], latencies[i]
            return {"rate": r0 + (threshold - l0) * (r1 - r0) / (l1 - l0),
                    "bound": "interpolated"}
    return {"rate": rates[-1], "bound": "at least"}


def run_dataset(loaded, settings: RateSettings, vocab_size: int
                ) -> tuple[dict, list[RequestSpec]]:
    """Figure 12 for one dataset, and the requests it served all at once (its
    "all_at_once" runs of paged and orca-oracle are the simulator validation's)."""
    burst = workload(settings, vocab_size)
    num_pool_tokens = pool_tokens(burst, settings)
    by_policy = engines(loaded, settings, num_pool_tokens)
    at_once = {}
    for policy in ("paged", "orca-oracle"):
        at_once[policy] = serve(by_policy[policy], burst,
                                f"{settings.dataset} {policy} all at once").summary()
    capacity = settings.num_requests / at_once["paged"]["virtual_s"]
    rates = [fraction * capacity for fraction in settings.rate_fractions]
    curves = {policy: [] for policy in settings.policies}
    threshold = None
    for policy in settings.policies:
        for rate in rates:
            run = serve(by_policy[policy], workload(settings, vocab_size, rate),
                        f"{settings.dataset} {policy} {rate:.2f} req/s").summary()
            curves[policy].append({"request_rate": rate, **run})
            if threshold is None:
                threshold = THRESHOLD_FACTOR * run["normalized_latency_s_mean"]
            if run["normalized_latency_s_mean"] > threshold:
                break
    sustained = {
        policy: sustained_rate([p["request_rate"] for p in points],
                               [p["normalized_latency_s_mean"] for p in points], threshold)
        for policy, points in curves.items()
    }
    return {
        "settings": asdict(settings) | {"length_scale": settings.length_scale},
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in burst])),
        "mean_output_len": float(np.mean([r.output_len for r in burst])),
        "pool_tokens": num_pool_tokens,
        "capacity_requests_per_s": capacity,
        "threshold_normalized_latency_s": threshold,
        "curves": curves,
        "sustained_rate": sustained,
        "rate_ratios": rate_ratios(sustained),
        "all_at_once": at_once,
    }, burst


def rate_ratios(sustained: dict[str, dict]) -> dict[str, float | str | None]:
    """paged's sustained rate over each Orca policy's, with the bound that applies."""
    ratios = {}
    paged = sustained.get("paged")
    for policy in ("orca-oracle", "orca-pow2", "orca-max"):
        if paged is None or policy not in sustained:
            continue
        key = "rate_ratio_vs_" + policy.replace("-", "_")
        ratios[key] = paged["rate"] / sustained[policy]["rate"]
        ratios[key + "_bound"] = _ratio_bound(paged["bound"], sustained[policy]["bound"])
    return ratios


def _ratio_bound(numerator: str, denominator: str) -> str:
    """Whether paged / orca is exact, a lower or an upper bound, or unknown."""
    low = numerator == "at least" or denominator == "at most"
    high = numerator == "at most" or denominator == "at least"
    if low and high:
        return "unknown"
    return "at least" if low else "at most" if high else "interpolated"
