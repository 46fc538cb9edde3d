"""The prefix cache's host tier on the engine: a conversation's first round, evicted
from a small device pool by other requests, comes back from host memory for its next
round instead of being computed again.

Oracles: transformers' greedy continuations (tests.plugins.hf_models), the same
rounds with no prefix cache (seeded sampling), and, for every cache dtype, the same
rounds on a device pool large enough to keep the first round: a block loaded from
the tier holds the bits the device held, scales included, so those outputs are
equal token for token.
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import greedy_continuations

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=MAX_TOKENS,
                        ignore_eos=True)
BUCKETS = BucketSizes(min_num_tokens=16, min_num_seqs=4, min_blocks_per_seq=4)
SMALL_POOL = 25  # blocks of 4 tokens: the fillers below push the first round out
HOST_GIB = 0.01


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=4, num_blocks=SMALL_POOL, max_num_seqs=4,
                  max_num_batched_tokens=32, max_model_len=64, buckets=BUCKETS,
                  enable_prefix_caching=True, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


def _conversation(vocab_size: int, seed: int = 0):
    """A first round of 30 tokens, three unrelated 40-token fillers (each of which takes
    most of the small pool) and the tokens the second round adds to the first's."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, vocab_size, 30).tolist()
    fillers = [rng.integers(0, vocab_size, 40).tolist() for _ in range(3)]
    question = rng.integers(0, vocab_size, 5).tolist()
    return first, fillers, question


def _rounds(llm: LLM, first, fillers, question, params: SamplingParams):
    """Round one, the fillers one at a time, then round two (history, answer and a new
    question, with a greedy and a seeded sample): (round two's outputs, its prompt)."""
    answer = llm.generate([first], GREEDY)[0].outputs[0].token_ids
    for filler in fillers:
        llm.generate([filler], GREEDY)
    second = first + answer + question
    return llm.generate([second, second], [GREEDY, params]), second


@pytest.mark.parametrize("kv_cache_dtype", [
    "auto", pytest.param("int8", marks=pytest.mark.full),
    pytest.param("fp8_e4m3", marks=pytest.mark.full),
    pytest.param("bfloat16", marks=pytest.mark.full)])
def test_a_round_served_from_the_tier_equals_one_the_device_kept(loaded, tiny_llama_dir,
                                                                   kv_cache_dtype):
    first, fillers, question = _conversation(loaded[1].vocab_size)
    tier = _llm(loaded, kv_cache_dtype=kv_cache_dtype, kv_offloading_size=HOST_GIB)
    outputs, second = _rounds(tier, first, fillers, question, SEEDED)
    state = tier.engine.state()
    # The first round's 7 full blocks (and its answer's) left the device; the tier
    # loaded them back, and they count as cached prompt tokens.
    assert state.host_pool.loaded_blocks >= 7
    assert state.prefix_cache_tier_hit_tokens >= 28
    assert outputs[0].num_cached_tokens >= 28
    kept = _llm(loaded, kv_cache_dtype=kv_cache_dtype, num_blocks=200)
    expected, _ = _rounds(kept, first, fillers, question, SEEDED)
    assert kept.engine.state().prefix_cache_tier_hit_tokens == 0
    assert outputs[1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert outputs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    if kv_cache_dtype == "auto":
        assert outputs[0].outputs[0].token_ids == greedy_continuations(
            tiny_llama_dir, [second], MAX_TOKENS)[0]


def test_without_a_tier_the_round_is_computed_again_and_samples_alike(loaded):
    first, fillers, question = _conversation(loaded[1].vocab_size, seed=1)
    device_only = _llm(loaded)
    outputs, _ = _rounds(device_only, first, fillers, question, SEEDED)
    assert outputs[0].num_cached_tokens == 0  # the small pool evicted the first round
    tier = _llm(loaded, kv_offloading_size=HOST_GIB)
    from_tier, _ = _rounds(tier, first, fillers, question, SEEDED)
    assert from_tier[0].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in from_tier] == [
        o.outputs[0].token_ids for o in outputs]


@pytest.mark.full
def test_a_gemma_shaped_model_loads_only_its_window_blocks(tiny_gemma3_dir):
    """Sliding-window groups load the blocks in the window of the hit's end; the global
    group loads them all; greedy outputs equal transformers'."""
    loaded = load_model(tiny_gemma3_dir)
    first, fillers, question = _conversation(loaded[1].vocab_size, seed=2)
    llm = _llm(loaded, num_blocks=4 * SMALL_POOL, kv_offloading_size=HOST_GIB)
    outputs, second = _rounds(llm, first, fillers, question, SEEDED)
    state = llm.engine.state()
    assert state.prefix_cache_tier_hit_tokens > 0
    hit_blocks = outputs[0].num_cached_tokens // 4
    # Four one-layer groups, three of them sliding (window 8: the hit's last 3 blocks).
    assert hit_blocks < state.host_pool.loaded_blocks < 4 * hit_blocks
    assert outputs[0].outputs[0].token_ids == greedy_continuations(
        tiny_gemma3_dir, [second], MAX_TOKENS)[0]
