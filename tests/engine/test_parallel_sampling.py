"""Parallel sampling (n > 1): the prompt is computed once and its samples share its
blocks; each sample has its own seeded random stream.

Oracles: the same request run alone (seeded outputs must not depend on the
batch or on preemption), and block counts derived from the lengths alone (which
blocks a prompt and its samples must hold, with and without sharing).
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams

SMALL_BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)
SAMPLED = SamplingParams(n=4, temperature=1.0, top_k=40, max_tokens=10, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=4, num_blocks=96, max_num_seqs=16, max_num_batched_tokens=64,
                  max_model_len=64, buckets=SMALL_BUCKETS, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


def _samples(output) -> list[list[int]]:
    assert [c.index for c in output.outputs] == list(range(len(output.outputs)))
    return [c.token_ids for c in output.outputs]


def _prompts(vocab_size, num, seed=0, max_len=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(rng.integers(5, max_len))).tolist()
            for _ in range(num)]


def test_seeded_samples_do_not_depend_on_the_batch(loaded):
    llm = _llm(loaded)
    prompts = _prompts(loaded[1].vocab_size, 6)
    alone = _samples(llm.generate([prompts[0]], SAMPLED)[0])
    assert len({tuple(s) for s in alone}) > 1, "the samples drew the same stream"
    others = [SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=i) for i in range(5)]
    batch = llm.generate(prompts, [SAMPLED, *others])
    assert _samples(batch[0]) == alone
    assert all(len(o.outputs) == 2 for o in batch[1:])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_samples_survive_preemption(loaded, mode):
    prompts = _prompts(loaded[1].vocab_size, 5, seed=1, max_len=12)
    single = _llm(loaded)
    alone = [_samples(single.generate([p], SAMPLED)[0]) for p in prompts]
    # 30 usable blocks of 4 tokens: one group needs at most 15, all five do not fit.
    llm = _llm(loaded, num_blocks=31, preemption_mode=mode,
               kv_offloading_size=0.01 if mode == "swap" else None, enable_prefix_caching=False)
    outputs = llm.generate(prompts, SAMPLED)
    assert llm.engine.stats.num_preemptions > 0
    assert [_samples(o) for o in outputs] == alone
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_device_blocks


def _expected_physical(prompt_len, num_cached, block_size, n, shared):
    """Blocks a prompt of prompt_len tokens and its n samples hold once each sample has
    num_cached tokens in the cache: the prompt's full blocks once (shared), plus each
    sample's own blocks past them; without sharing, every sample holds all its blocks."""
    per_sample = -(-num_cached // block_size)
    if not shared:
        return n * per_sample
    full = prompt_len // block_size
    return full + n * (per_sample - full)


def _check_exact_sharing(llm, prompt, block_size, n, share_blocks):
    """Every step, the pool holds exactly the blocks derived from the lengths."""
    engine, manager = llm.engine, llm.engine.block_manager
    prompt_len = len(prompt)
    engine.add_request("r", prompt, SamplingParams(n=n, max_tokens=8, ignore_eos=True, seed=3))
    engine.step()  # the prompt: one sequence, then the fork
    assert manager.physical_blocks_used == -(-prompt_len // block_size)
    for generated in range(1, 7):
        engine.step()
        expected = _expected_physical(prompt_len, prompt_len + generated, block_size, n,
                                      share_blocks)
        assert manager.physical_blocks_used == expected, generated
        assert manager.logical_blocks_used == n * -(-(prompt_len + generated) // block_size)
    (output,) = engine.step()
    assert output.finished and len(output.outputs) == n
    saved = output.metrics.kv_memory_saved
    assert (saved > 0.3) if share_blocks else saved == 0.0
    assert manager.num_free_blocks == manager.num_device_blocks


@pytest.mark.parametrize("share_blocks", [True, False])
def test_samples_share_the_prompt_blocks_exactly(loaded, share_blocks):
    prompt = np.random.default_rng(3).integers(0, loaded[1].vocab_size, 41).tolist()
    llm = _llm(loaded, share_blocks=share_blocks)  # 41 tokens: 10 full blocks and a partial one
    _check_exact_sharing(llm, prompt, 4, 4, share_blocks)


def test_smollm2_samples_hold_one_copy_of_a_long_prompt(smollm2):
    """n = 4 samples of a 245-token prompt: 61 full blocks of 4 tokens, held once."""
    tokenizer = smollm2[2]
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(20))
    prompt = tokenizer.encode(text)[:245]
    assert len(prompt) == 245
    llm = LLM("smollm2", loaded=smollm2, block_size=4, num_blocks=400, max_num_seqs=4,
              max_num_batched_tokens=256, max_model_len=320,
              buckets=BucketSizes(min_num_tokens=4, min_num_seqs=4, min_blocks_per_seq=80),
              persistent_compilation_cache=False)
    _check_exact_sharing(llm, prompt, 4, 4, share_blocks=True)


def test_n_above_the_batch_limit_is_rejected(loaded):
    llm = _llm(loaded, max_num_seqs=4)
    with pytest.raises(ValueError, match="n=5 is more than min"):
        llm.generate(["hi"], SamplingParams(n=5))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["hi"], SamplingParams(n=4, max_tokens=2))[0].outputs) == 4
