"""A model of local and global layers (tiny Gemma 3: a window of 8 on three of its four
layers) in KV cache groups over one pool, against transformers' `generate`: warm-up
covers every shape its steps reach, and a prompt whose window blocks left the prefix
cache is served from what remains of it.
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup
from tests.plugins.hf_models import greedy_continuations

MAX_TOKENS = 12
# The blocks of a 36-token prompt and its 12 tokens in tiny Gemma 3's four one-layer
# groups: 12 in the global one, every one of the 12 once in each sliding one.
FIRST_REQUEST_BLOCKS = 4 * 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BUCKETS = BucketSizes(min_num_tokens=16, min_num_seqs=8, min_blocks_per_seq=4)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=16,
                  max_model_len=64, buckets=BUCKETS, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("int8", marks=pytest.mark.full)])
def test_a_gemma_shaped_model_compiles_nothing_after_warmup(tiny_gemma3_dir, kv_cache_dtype,
                                                            no_compilation_cache):
    """Local and global layers, both RoPEs and the window in one scanned step (on float
    and on int8 pages, in KV cache groups): warm-up covers every shape and sampler
    variant the requests below reach."""
    import jax

    from jpaged.engine.stats import num_compilations

    loaded = load_model(tiny_gemma3_dir)
    llm = _llm(loaded, max_model_len=32, kv_cache_dtype=kv_cache_dtype)
    llm.engine.warmup()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, loaded[1].vocab_size, int(n)).tolist()
               for n in rng.integers(1, 20, 24)]
    kinds = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS),
             SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=MAX_TOKENS)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    assert jax.config.jax_compilation_cache_dir is None  # a disk cache hides compiles
    before = num_compilations()
    outputs = llm.generate(prompts, params)
    assert num_compilations() - before == 0
    assert all(o.finished for o in outputs)



def _hit_lengths(manager, prompt) -> tuple[int, int]:
    """(group 0's hit alone, the hit every group holds) in blocks for `prompt` now."""
    seq = Sequence(-1, list(prompt))
    group = SequenceGroup("probe", [seq])
    anchor = len(manager.group_tables[0].prefix_hit(seq, group)[0])
    joint = len(manager.prefix_hits([seq], group)[0][0][0])
    manager.free(seq)
    return anchor, joint


def test_a_prompt_whose_window_blocks_left_the_cache_is_served_from_what_remains(
        tiny_gemma3_dir):
    """A first request's global blocks stay cached while the blocks its sliding layers'
    window left early are handed to a second request: a follow-up prompt whose global
    prefix is cached but whose window blocks are gone gets a shorter hit (or none) and
    the same greedy tokens as transformers."""
    loaded = load_model(tiny_gemma3_dir)
    rng = np.random.default_rng(11)
    vocab = loaded[1].vocab_size
    first, filler = rng.integers(0, vocab, 36).tolist(), rng.integers(0, vocab, 20).tolist()
    expected = greedy_continuations(tiny_gemma3_dir, [first, filler], MAX_TOKENS)
    # The filler's 32 blocks take the 8 never used and then the sliding blocks the first
    # request's windows left first: all but the last two of each group (8 and 9).
    llm = _llm(loaded, num_blocks=1 + FIRST_REQUEST_BLOCKS + 8)
    assert _tokens(llm.generate([first], GREEDY)) == expected[:1]
    assert _tokens(llm.generate([filler], GREEDY)) == expected[1:]
    computed = first + expected[0]
    follow_ups = [computed[:n] + [7, 8] for n in (42, 30, 17)]
    manager = llm.engine.block_manager
    hits = [_hit_lengths(manager, prompt) for prompt in follow_ups]
    assert hits[0] == (10, 10)  # its window at position 40 reads blocks 8 and 9
    assert all(joint < anchor for anchor, joint in hits[1:]), hits
    expected = greedy_continuations(tiny_gemma3_dir, follow_ups, MAX_TOKENS)
    for prompt, tokens in zip(follow_ups, expected, strict=True):
        assert _tokens(llm.generate([prompt], GREEDY)) == [tokens]
    llm.engine.check_invariants()
