"""The paper's Figure 12 on the real engine: normalized latency against request rate.

Paged allocation and Orca's three reservation policies (jpaged.memory.reservation)
serve the same requests on the same model, kernels and KV pool, with Poisson
arrivals replayed on a virtual clock of measured step times
(experiments.engine_runs). Every rule below was fixed before measuring:

- Budget: the pool holds what orca-oracle needs for a quarter of max_num_seqs
  requests of the workload's mean length (prompt + output), rounded up to whole
  blocks. max_num_seqs (64) is then well above what paging can run in that pool,
  so memory binds, not the sequence cap.
- Requests: NUM_REQUESTS per run, three times the max_num_seqs / 4 that the
  pool holds for orca-oracle and more than any policy holds at once in it, so
  that a queue forms past each policy's capacity and memory binds for all.
- Capacity: each policy first serves the requests all at once; its request
  throughput there (requests / virtual seconds) is its capacity C. It is the
  rate the policy can serve with the queue never empty, so its latency curve
  turns up near it.
- Threshold: THRESHOLD_FACTOR x paged's mean normalized latency at
  BASE_FRACTION x its capacity, where few requests are in flight (the
  unloaded system). It must sit below paged's latency with every request
  queued, so that its curve crosses it within the rates measured; the README
  compares it with how much paged's steps themselves grow with the batch.
- Rates: each policy runs at fractions of its own capacity from RATE_FRACTIONS,
  starting at START_FRACTION x C and stepping down while its mean normalized
  latency is above the threshold, up while below, until two neighbouring
  fractions bracket the threshold (or the ladder ends). Where the search
  starts decides how many runs it takes, not which bracket it finds (on a
  curve that rises with the rate). The rate a policy sustains is where its
  curve crosses the threshold, interpolated linearly between the bracketing
  rates.

The Orca policies here reserve paged blocks, which fragment nothing outside a
sequence: they flatter Orca, whose contiguous slabs also fragment externally.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from experiments.engine_runs import make_engine, serve
from experiments.workloads import RequestSpec, scaled_workload
from jpaged.memory.reservation import ALLOCATIONS

NUM_REQUESTS = 48
RATE_FRACTIONS = (0.5, 0.7, 1.0, 1.4, 2.0, 3.0)
# Curves cross the threshold past capacity (the README reports where), so the search starts there.
START_FRACTION = 1.4
BASE_FRACTION = 0.25
THRESHOLD_FACTOR = 3.0
# Lengths scaled as benchmarks/throughput.py scales them to fit a CPU.
LENGTH_SCALES = {"sharegpt": 0.25, "alpaca": 1.0}
ORCA_POLICIES = ("orca-oracle", "orca-pow2", "orca-max")


@dataclass(frozen=True)
class RateSettings:
    """One dataset's Figure-12 runs; curves=False measures the capacities only."""

    dataset: str
    num_requests: int = NUM_REQUESTS
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    rate_fractions: tuple[float, ...] = RATE_FRACTIONS
    start_fraction: float = START_FRACTION
    base_fraction: float = BASE_FRACTION
    threshold_factor: float = THRESHOLD_FACTOR
    policies: tuple[str, ...] = ALLOCATIONS
    curves: bool = True
    seed: int = 0
    length_scale_override: float | None = None

    def __post_init__(self):
        if self.policies[0] != "paged":
            raise ValueError(f"policies must start with 'paged' (it sets the threshold), "
                             f"got {self.policies}")
        if self.start_fraction not in self.rate_fractions or list(
                self.rate_fractions) != sorted(set(self.rate_fractions)):
            raise ValueError(f"rate_fractions must ascend without repeats and hold "
                             f"start_fraction={self.start_fraction} (where the search "
                             f"starts), got {self.rate_fractions}")

    @property
    def length_scale(self) -> float:
        """LENGTH_SCALES of the dataset unless overridden (--quick shortens requests)."""
        return self.length_scale_override or LENGTH_SCALES[self.dataset]


@dataclass(frozen=True)
class RateRules:
    """The rules above for a study that brings its own workload and servers
    (`rate_search`): the ladder, where the search starts, the unloaded run and the
    threshold's factor."""

    rate_fractions: tuple[float, ...] = RATE_FRACTIONS
    start_fraction: float = START_FRACTION
    base_fraction: float = BASE_FRACTION
    threshold_factor: float = THRESHOLD_FACTOR


def rate_search(run_at: Callable[[str, float], dict], servers: tuple[str, ...],
                rules: RateRules, curves: bool = True) -> dict:
    """The rules above over servers (the first, "paged", sets the threshold):
    run_at(server, rate) serves the workload at `rate` (inf: all at once) and gives a
    run's summary (experiments.engine_runs.RunResult.summary's "num_requests",
    "virtual_s" and "normalized_latency_s_mean" at least). Capacities, the runs all at
    once and paged's capacity over the others'; with curves, also the curves, the
    sustained rates and their ratios."""
    at_once = {name: run_at(name, math.inf) for name in servers}
    capacity = {name: run["num_requests"] / run["virtual_s"] for name, run in at_once.items()}
    result = {"capacity_requests_per_s": capacity,
              "capacity_ratios": ratios_to_paged(capacity, "capacity_ratio_vs_"),
              "all_at_once": at_once}
    if not curves:
        return result

    def point(name: str, fraction: float) -> dict:
        rate = fraction * capacity[name]
        return {"request_rate": rate, "capacity_fraction": fraction, **run_at(name, rate)}

    baseline = servers[0]
    base = point(baseline, rules.base_fraction)
    threshold = threshold_of(base, rules)
    searched = {name: search_curve(functools.partial(point, name), rules, threshold,
                                   {rules.base_fraction: base} if name == baseline else {})
                for name in servers}
    result |= curves_result(baseline, base, threshold, searched, rules)
    result["rate_ratios"] = rate_ratios(result["sustained_rate"])
    return result


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


def bracket_search(latency_at: Callable[[float], float], fractions: tuple[float, ...],
                   threshold: float, start: float) -> None:
    """Call latency_at on fractions from `start` towards the threshold's crossing:
    down while above it, up while at or below it, until the last two calls bracket
    it or the ladder ends. fractions ascending, holding start."""
    index = fractions.index(start)
    above = latency_at(fractions[index]) > threshold
    step = -1 if above else 1
    while 0 <= index + step < len(fractions):
        index += step
        if (latency_at(fractions[index]) > threshold) != above:
            return


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
    """Figure 12 for one dataset, and the requests every policy served all at once
    (its "all_at_once" runs; paged's and orca-oracle's are the simulator validation's)."""
    burst = workload(settings, vocab_size)
    num_pool_tokens = pool_tokens(burst, settings)
    by_policy = engines(loaded, settings, num_pool_tokens)
    at_once = {policy: serve(by_policy[policy], burst,
                             f"{settings.dataset} {policy} all at once").summary()
               for policy in settings.policies}
    capacity = {policy: settings.num_requests / run["virtual_s"]
                for policy, run in at_once.items()}
    result = {
        "settings": asdict(settings) | {"length_scale": settings.length_scale},
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in burst])),
        "mean_output_len": float(np.mean([r.output_len for r in burst])),
        "pool_tokens": num_pool_tokens,
        "capacity_requests_per_s": capacity,
        "capacity_ratios": ratios_to_paged(capacity, "capacity_ratio_vs_"),
        "all_at_once": at_once,
    }
    if settings.curves:
        result |= latency_curves(by_policy, settings, vocab_size, capacity)
        result["rate_ratios"] = rate_ratios(result["sustained_rate"])
    return result, burst


def latency_curves(servers: dict, settings: RateSettings, vocab_size: int,
                   capacity: dict[str, float]) -> dict:
    """The threshold from the first server's unloaded run (paged's, or float32's), then
    each server's bracketing search on fractions of its own capacity; the curves and
    sustained rates."""
    def run_at(name: str, fraction: float) -> dict:
        rate = fraction * capacity[name]
        run = serve(servers[name], workload(settings, vocab_size, rate),
                    f"{settings.dataset} {name} {rate:.2f} req/s")
        return {"request_rate": rate, "capacity_fraction": fraction, **run.summary()}

    baseline = next(iter(servers))
    base = run_at(baseline, settings.base_fraction)
    threshold = threshold_of(base, settings)
    curves = {name: search_curve(functools.partial(run_at, name), settings, threshold,
                                 {settings.base_fraction: base} if name == baseline else {})
              for name in servers}
    return curves_result(baseline, base, threshold, curves, settings)


def threshold_of(base: dict, settings: RateSettings | RateRules) -> float:
    """The threshold rule: threshold_factor x the unloaded run's mean normalized latency."""
    return settings.threshold_factor * base["normalized_latency_s_mean"]


def search_curve(run_at: Callable[[float], dict], settings: RateSettings | RateRules,
                 threshold: float,
                 points: dict[float, dict]) -> list[dict]:
    """One server's bracketing search: run_at(fraction of its capacity) gives a run's
    point (with "request_rate" and "normalized_latency_s_mean"); points: those run
    already, by fraction. Every point run, in ascending rate."""
    def latency_at(fraction: float) -> float:
        if fraction not in points:
            points[fraction] = run_at(fraction)
        return points[fraction]["normalized_latency_s_mean"]

    bracket_search(latency_at, settings.rate_fractions, threshold, settings.start_fraction)
    return [points[f] for f in sorted(points)]


def curves_result(baseline: str, base: dict, threshold: float, curves: dict[str, list[dict]],
                  settings: RateSettings | RateRules) -> dict:
    """The curves' section of a report: the threshold's rule and value, each server's
    points and the rate it sustains."""
    sustained = {
        name: sustained_rate([p["request_rate"] for p in points],
                             [p["normalized_latency_s_mean"] for p in points], threshold)
        for name, points in curves.items()
    }
    return {
        "threshold_rule": f"{settings.threshold_factor:g} x {baseline}'s mean normalized "
                          f"latency at {settings.base_fraction:g} x {baseline}'s capacity "
                          "(unloaded)",
        "unloaded_normalized_latency_s": base["normalized_latency_s_mean"],
        "threshold_normalized_latency_s": threshold,
        "curves": curves,
        "sustained_rate": sustained,
    }


def ratios_to_paged(values: dict[str, float], prefix: str) -> dict[str, float]:
    """paged's value over each Orca policy's present, keyed prefix + policy."""
    return {prefix + policy.replace("-", "_"): values["paged"] / values[policy]
            for policy in ORCA_POLICIES if policy in values}


def rate_ratios(sustained: dict[str, dict]) -> dict[str, float | str | None]:
    """paged's sustained rate over each Orca policy's, with the bound that applies."""
    ratios = ratios_to_paged({policy: s["rate"] for policy, s in sustained.items()},
                             "rate_ratio_vs_")
    for policy in ORCA_POLICIES:
        if policy in sustained:
            key = "rate_ratio_vs_" + policy.replace("-", "_") + "_bound"
            ratios[key] = _ratio_bound(sustained["paged"]["bound"], sustained[policy]["bound"])
    return ratios


def _ratio_bound(numerator: str, denominator: str) -> str:
    """Whether paged / orca is exact, a lower or an upper bound, or unknown."""
    low = numerator == "at least" or denominator == "at most"
    high = numerator == "at most" or denominator == "at least"
    if low and high:
        return "unknown"
    return "at least" if low else "at most" if high else "interpolated"
