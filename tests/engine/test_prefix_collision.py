"""Prefix caching in the engine must not trust its hash: every block made to collide.

With `hash_block` replaced by a constant, only the comparison of a cached
block's content key can tell a hit from a collision. The oracle: the engine's
greedy outputs with prefix caching off. A positive control keeps the real hash
and a shared prefix: it must still hit.
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.memory.test_prefix_collision import distinct_prompts

BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def make_llm(loaded, enable_prefix_caching: bool, **kwargs) -> LLM:
    config = dict(block_size=BLOCK_SIZE, num_blocks=64, max_num_seqs=4,
                  max_num_batched_tokens=64, max_model_len=64,
                  buckets=BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2),
                  persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, enable_prefix_caching=enable_prefix_caching,
               **(config | kwargs))


@pytest.fixture(scope="module")
def prompt_rounds(loaded):
    """Rounds of prompts run one after another: later rounds look up earlier rounds' blocks.

    Round 0 and 1 share no prefix with any prompt; rounds 2 and 3 share a
    three-block prefix (24 tokens).
    """
    vocab_size = loaded[1].vocab_size
    first, second = (distinct_prompts(seed, [19, 26, 33], vocab_size) for seed in (1, 2))
    second = [[3 + p[0], *p[1:]] for p in second]  # first tokens 3..5: unlike round 0's
    shared = np.random.default_rng(3).integers(0, vocab_size, 3 * BLOCK_SIZE).tolist()
    return [first, second, [shared + [1, 2, 3]], [shared + [4, 5], shared + [6]]]


def run_rounds(llm: LLM, rounds: list[list[list[int]]]) -> list[list[list[int]]]:
    """Greedy output tokens of each round's prompts, one `generate` per round."""
    return [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] for prompts in rounds]


@pytest.fixture(scope="module")
def uncached_outputs(loaded, prompt_rounds):
    return run_rounds(make_llm(loaded, enable_prefix_caching=False), prompt_rounds)


def test_engine_with_every_hash_equal_matches_no_caching(
    colliding_hash, loaded, prompt_rounds, uncached_outputs
):
    llm = make_llm(loaded, enable_prefix_caching=True)
    assert run_rounds(llm, prompt_rounds[:2]) == uncached_outputs[:2]
    stats = llm.engine.block_manager.prefix_cache_stats
    lookups = sum((len(p) - 1) // BLOCK_SIZE for prompts in prompt_rounds[:2] for p in prompts)
    assert stats.query_blocks == lookups > 0
    assert stats.hit_rate == 0.0


def test_engine_with_colliding_hashes_and_a_host_tier_matches_no_caching(
    depth_hash, loaded, prompt_rounds, uncached_outputs
):
    """Blocks at one depth collide on the device and in the host tier, where a pool of
    9 blocks sends every round's blocks: no lookup may take another prefix's copy."""
    llm = make_llm(loaded, enable_prefix_caching=True, num_blocks=9, kv_offloading_size=0.01)
    assert run_rounds(llm, prompt_rounds) == uncached_outputs
    assert llm.engine.state().host_pool.stored_blocks > 0


def test_engine_with_the_real_hash_still_hits_a_shared_prefix(
    loaded, prompt_rounds, uncached_outputs
):
    llm = make_llm(loaded, enable_prefix_caching=True)
    assert run_rounds(llm, prompt_rounds) == uncached_outputs
    stats = llm.engine.block_manager.prefix_cache_stats
    assert stats.hit_tokens == 2 * 3 * BLOCK_SIZE  # both prompts of round 3
    assert stats.hit_rate > 0
