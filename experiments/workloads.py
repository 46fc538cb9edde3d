"""Synthetic request workloads shaped like the paper's datasets.

These are synthetic fits to published means, not the datasets themselves:
prompt and output lengths are independent log-normal draws whose location is
fitted so that, after vLLM's benchmark filter (drop prompts or outputs shorter
than 4 tokens, prompts longer than 1024, prompt + output longer than 2048), the
mean lengths equal those the vLLM paper reports in its Figure 11
(`experiments.paper.FIGURE11_MEAN_LENGTHS`).

The spreads (log-normal sigma) are assumptions: wide for ShareGPT's chat
conversations, narrower for Alpaca's short instructions. Prompt tokens are
uniform random ids, so they share nothing unless a shared prefix is asked for:
the one-shot and five-shot prefixes of the paper's prefix-sharing experiment
(its Figure 16). Arrivals are a Poisson process.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from experiments.paper import FIGURE11_MEAN_LENGTHS, FIGURE16_PREFIX_TOKENS

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
VOCAB_SIZE = 32000
PREFIX_LENS = FIGURE16_PREFIX_TOKENS


@dataclass(frozen=True)
class LengthModel:
    """A dataset's published mean lengths and the assumed log-normal spreads."""

    name: str
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


def _length_model(name: str, input_sigma: float, output_sigma: float) -> LengthModel:
    means = FIGURE11_MEAN_LENGTHS[name]
    return LengthModel(name, means.input_tokens, means.output_tokens, input_sigma, output_sigma)


DATASETS = {
    "sharegpt": _length_model("sharegpt", input_sigma=1.1, output_sigma=0.9),
    "alpaca": _length_model("alpaca", input_sigma=0.6, output_sigma=0.9),
}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: the simulator runs it for exactly `output_len` tokens.

    n > 1 asks for n parallel samples, or a beam of width n if beam_search.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    n: int = 1
    beam_search: bool = False

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + self.output_len


def _keep(prompt_lens: np.ndarray, output_lens: np.ndarray) -> np.ndarray:
    """vLLM's benchmark filter. prompt_lens, output_lens: int [N] -> bool [N]."""
    return (
        (prompt_lens >= MIN_LEN)
        & (output_lens >= MIN_LEN)
        & (prompt_lens <= MAX_PROMPT_LEN)
        & (prompt_lens + output_lens <= MAX_TOTAL_LEN)
    )


def _lengths(mu: float, sigma: float, normals: np.ndarray) -> np.ndarray:
    """Rounded log-normal lengths. normals: float [N] -> int64 [N]."""
    return np.maximum(np.rint(np.exp(mu + sigma * normals)), 1).astype(np.int64)


@functools.cache
def fitted_locations(dataset: str) -> tuple[float, float]:
    """(mu_input, mu_output) whose filtered means equal the published means.

    A fixed-point iteration on a fixed sample: scaling the location by the
    log-ratio of target to current mean converges in a few rounds because the
    filter trims only the tails.
    """
    model = DATASETS[dataset]
    normals = np.random.default_rng(12345).standard_normal((2, 200_000))
    mu_in = math.log(model.input_mean) - model.input_sigma**2 / 2
    mu_out = math.log(model.output_mean) - model.output_sigma**2 / 2
    for _ in range(30):
        prompt_lens = _lengths(mu_in, model.input_sigma, normals[0])
        output_lens = _lengths(mu_out, model.output_sigma, normals[1])
        keep = _keep(prompt_lens, output_lens)
        mu_in += math.log(model.input_mean / prompt_lens[keep].mean())
        mu_out += math.log(model.output_mean / output_lens[keep].mean())
    return mu_in, mu_out


def sample_lengths(
    dataset: str, num_requests: int, rng: np.random.Generator, prefix_len: int = 0
) -> np.ndarray:
    """Filtered (prompt_len, output_len) pairs: int64 [num_requests, 2].

    The filter sees prompts as `prefix_len` tokens longer (a shared prefix goes in
    front of them); the returned prompt lengths exclude the prefix.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
    model = DATASETS[dataset]
    mu_in, mu_out = fitted_locations(dataset)
    kept: list[np.ndarray] = []
    num_kept = 0
    while num_kept < num_requests:
        normals = rng.standard_normal((2, 2 * num_requests + 16))
        prompt_lens = _lengths(mu_in, model.input_sigma, normals[0])
        output_lens = _lengths(mu_out, model.output_sigma, normals[1])
        keep = _keep(prompt_lens + prefix_len, output_lens)
        kept.append(np.stack([prompt_lens[keep], output_lens[keep]], axis=1))
        num_kept += int(keep.sum())
    return np.concatenate(kept)[:num_requests]


def arrival_times(num_requests: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals at `request_rate` per second (inf: all at 0). float64 [num_requests]."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf for all at once), got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    return np.cumsum(rng.exponential(1.0 / request_rate, num_requests))


def make_workload(
    dataset: str,
    num_requests: int,
    *,
    request_rate: float = math.inf,
    seed: int = 0,
    n: int = 1,
    beam_search: bool = False,
    prefix: str | None = None,
) -> list[RequestSpec]:
    """A seeded synthetic workload (see the module docstring: fits to published means).

    prefix: None, "one-shot" or "five-shot": every prompt starts with the same
    prefix of PREFIX_LENS[prefix] tokens, followed by the dataset's own prompt.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if prefix is not None and prefix not in PREFIX_LENS:
        raise ValueError(f"prefix must be None or one of {sorted(PREFIX_LENS)}, got {prefix!r}")
    rng = np.random.default_rng(seed)
    prefix_len = PREFIX_LENS[prefix] if prefix else 0
    lengths = sample_lengths(dataset, num_requests, rng, prefix_len)
    arrivals = arrival_times(num_requests, request_rate, rng)
    shared = rng.integers(0, VOCAB_SIZE, prefix_len)
    tokens = rng.integers(0, VOCAB_SIZE, int(lengths[:, 0].sum()))
    starts = np.concatenate([[0], np.cumsum(lengths[:, 0])])
    return [
        RequestSpec(
            request_id=f"{dataset}-{i}",
            arrival_time=float(arrivals[i]),
            prompt_token_ids=tuple(shared.tolist() + tokens[starts[i] : starts[i + 1]].tolist()),
            output_len=int(lengths[i, 1]),
            n=n,
            beam_search=beam_search,
        )
        for i in range(num_requests)
    ]


def scaled_workload(
    dataset: str,
    num_requests: int,
    *,
    scale: float,
    max_total_len: int,
    vocab_size: int,
    request_rate: float = math.inf,
    seed: int = 0,
    token_seed: int | None = None,
) -> list[RequestSpec]:
    """A workload whose lengths are the dataset's scaled by `scale` (to fit a small
    machine) and clipped: prompts to [4, max_total_len // 2], outputs to [4, the room
    left]. Poisson arrivals at `request_rate` from the same seed; prompt token ids in
    [0, vocab_size) from `token_seed` (default: seed + 1), so a run with other
    tokens takes the same steps without sharing a prefix.
    """
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(dataset, num_requests, rng)
    prompt_lens = np.clip((lengths[:, 0] * scale).astype(int), MIN_LEN, max_total_len // 2)
    output_lens = np.clip((lengths[:, 1] * scale).astype(int), MIN_LEN,
                          max_total_len - prompt_lens)
    arrivals = arrival_times(num_requests, request_rate, rng)
    tokens = np.random.default_rng(seed + 1 if token_seed is None else token_seed)
    return [
        RequestSpec(
            request_id=f"{dataset}-{i}",
            arrival_time=float(arrivals[i]),
            prompt_token_ids=tuple(tokens.integers(0, vocab_size, prompt_lens[i]).tolist()),
            output_len=int(output_lens[i]),
        )
        for i in range(num_requests)
    ]
