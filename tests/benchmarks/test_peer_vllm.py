"""benchmarks.peer_vllm's jpaged half on a tiny model: every workload runs and counts the
tokens it asked for, and the greedy outputs it compares with vLLM's are transformers'."""

from __future__ import annotations

from argparse import Namespace

import pytest

import jpaged
from benchmarks.peer_vllm import agreement, run_workloads, workloads
from tests.plugins.hf_models import greedy_continuations, tiny_tokenizer

ARGS = Namespace(num_requests=6, sharegpt_scale=0.05, alpaca_scale=0.5, max_total_len=128,
                 prefill_prompts=2, prefill_lengths=[48, 160], seed=0)


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    vocab_size = len(tiny_tokenizer())
    loads = {"warmup": workloads(ARGS, vocab_size, 2), "timed": workloads(ARGS, vocab_size, 1)}
    llm = jpaged.LLM(str(tiny_llama_dir), max_model_len=256)
    return loads["timed"], run_workloads(jpaged, llm, loads, loads["timed"])


@pytest.mark.full
def test_every_workload_counts_the_tokens_it_asked_for(run):
    load, result = run
    figures = result["figures"]
    for name in ("sharegpt", "alpaca", "batch1"):
        assert figures[name]["tokens"] == sum(load[name]["max_tokens"])
    assert figures["n4"]["tokens"] == len(load["n4"]["prompts"]) * 4 * load["n4"]["max_tokens"]
    assert figures["beam"]["tokens"] == len(load["beam"]["prompts"]) * load["beam"]["max_tokens"]
    for length in ARGS.prefill_lengths:
        assert figures[f"prefill_{length}"]["tokens"] == ARGS.prefill_prompts * length
    for figure in figures.values():
        assert figure["per_s"] == pytest.approx(figure["tokens"] / figure["elapsed_s"])


@pytest.mark.full
def test_the_greedy_outputs_compared_are_transformers(run, tiny_llama_dir):
    load, result = run
    sharegpt = load["sharegpt"]
    for prompt, length, tokens in list(zip(sharegpt["prompts"], sharegpt["max_tokens"],
                                           result["token_ids"]["sharegpt"], strict=True))[:3]:
        assert tokens == greedy_continuations(tiny_llama_dir, [prompt], length)[0]


def test_agreement_counts_identical_outputs_and_matching_prefixes():
    ours = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]]
    theirs = [[1, 2, 3, 4], [1, 2, 9, 4], [7, 6]]
    assert agreement(ours, theirs) == {"identical": 1, "of": 3,
                                       "mean_matching_prefix": (4 + 2 + 0) / 3,
                                       "mean_length": 10 / 3}
