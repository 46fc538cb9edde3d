"""Synthetic workloads against the paper's published means and vLLM's benchmark filter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.workloads import PREFIX_LENS, make_workload, sample_lengths

PUBLISHED_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


@pytest.mark.parametrize("dataset", sorted(PUBLISHED_MEANS))
def test_mean_lengths_match_the_paper(dataset):
    lengths = sample_lengths(dataset, 50_000, np.random.default_rng(7))
    input_mean, output_mean = PUBLISHED_MEANS[dataset]
    assert lengths[:, 0].mean() == pytest.approx(input_mean, rel=0.03)
    assert lengths[:, 1].mean() == pytest.approx(output_mean, rel=0.03)


@pytest.mark.parametrize("dataset", sorted(PUBLISHED_MEANS))
def test_lengths_pass_vllm_benchmark_filter(dataset):
    prompt, output = sample_lengths(dataset, 20_000, np.random.default_rng(1)).T
    assert prompt.min() >= 4 and output.min() >= 4
    assert prompt.max() <= 1024 and (prompt + output).max() <= 2048
    assert len(np.unique(output)) > 100, "lengths should spread, not collapse to the mean"


def test_workloads_are_seeded():
    first = make_workload("alpaca", 50, request_rate=3.0, seed=4)
    assert first == make_workload("alpaca", 50, request_rate=3.0, seed=4)
    assert first != make_workload("alpaca", 50, request_rate=3.0, seed=5)


def test_poisson_arrivals():
    requests = make_workload("alpaca", 4000, request_rate=8.0, seed=2)
    gaps = np.diff([0.0] + [r.arrival_time for r in requests])
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.1)  # exponential: std == mean
    assert all(r.arrival_time == 0 for r in make_workload("alpaca", 10, request_rate=math.inf))


@pytest.mark.parametrize("prefix", sorted(PREFIX_LENS))
def test_shared_prefix(prefix):
    requests = make_workload("alpaca", 20, prefix=prefix, seed=3)
    size = PREFIX_LENS[prefix]
    prefixes = {r.prompt_token_ids[:size] for r in requests}
    assert len(prefixes) == 1
    assert all(len(r.prompt_token_ids) > size for r in requests)
    assert all(len(r.prompt_token_ids) <= 1024 and r.total_len <= 2048 for r in requests)


def test_sampling_variants_and_bad_arguments():
    beams = make_workload("alpaca", 3, n=4, beam_search=True)
    assert all(r.n == 4 and r.beam_search for r in beams)
    with pytest.raises(ValueError, match="dataset"):
        make_workload("wikitext", 3)
    with pytest.raises(ValueError, match="request_rate"):
        make_workload("alpaca", 3, request_rate=0.0)
    with pytest.raises(ValueError, match="prefix"):
        make_workload("alpaca", 3, prefix="ten-shot")
    with pytest.raises(ValueError, match="num_requests"):
        make_workload("alpaca", 0)
