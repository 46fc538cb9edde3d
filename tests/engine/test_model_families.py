"""The engine on every family past Llama and Qwen2, against transformers' `generate`.

Each tiny model (tests/plugins/hf_models.py) has a sliding window of 8 to 12 tokens (Gemma
3 and 2 on some layers, Mistral and Phi-3 on all) or none (Qwen3); prompts and
generations run past it. Greedy tokens must equal transformers' at block sizes 1, 4 and
16, in one batch with chunked prefill splitting the long prompts across the window, each
prompt alone, after recompute and swap preemption, with prefix caching on (a second run
hits it) and off; a seeded n = 4 request samples the same alone as in a batch.

Sequences stay within Phi-3's 32 tokens of short LongRoPE factors: past them,
transformers' `generate` computes the whole cache again with the long factors
(Phi3ForCausalLM.prepare_inputs_for_generation), which the engine does not do; the
switch itself is held to transformers fed as the engine feeds (tests/model/test_model.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup
from tests.plugins.hf_models import greedy_continuations

FAMILIES = ["tiny_qwen3_dir", "tiny_mistral_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
            "tiny_phi3_dir"]
MAX_TOKENS = 12
# The blocks of a 36-token prompt and its 12 tokens in tiny Gemma 3's four one-layer
# groups: 12 in the global one, every one of the 12 once in each sliding one.
FIRST_REQUEST_BLOCKS = 4 * 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BUCKETS = BucketSizes(min_num_tokens=16, min_num_seqs=8, min_blocks_per_seq=4)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(loaded model, prompts, transformers' greedy continuations) of one family."""
    directory = request.getfixturevalue(request.param)
    loaded = load_model(directory)
    rng = np.random.default_rng(0)
    vocab = loaded[1].vocab_size
    shared = rng.integers(0, vocab, 12).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 5, 13, 19)]
    prompts += [shared + [5, 6, 7], shared + [8, 9]]
    return loaded, prompts, greedy_continuations(directory, prompts, MAX_TOKENS)


def _llm(loaded, **kwargs) -> LLM:
    # A 16-token budget splits the 19-token prompt over steps, across the window.
    config = dict(block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=16,
                  max_model_len=64, buckets=BUCKETS, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_batch_matches_transformers(family, block_size):
    loaded, prompts, expected = family
    llm = _llm(loaded, block_size=block_size, num_blocks=2 + 8 * 64 // block_size)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert _tokens(llm.generate(prompts, GREEDY)) == expected  # from the prefix cache
    assert llm.engine.block_manager.prefix_cache_stats.hit_tokens > 0


def test_each_prompt_alone_matches(family):
    loaded, prompts, expected = family
    llm = _llm(loaded)
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert _tokens(llm.generate([prompt], GREEDY)) == [tokens]


@pytest.mark.parametrize("keep_every_block", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_without_prefix_caching_keeps_greedy_outputs(family, mode,
                                                                keep_every_block):
    loaded, prompts, expected = family
    # A pool of one 32-token sequence and a block: six sequences of up to 31 tokens
    # cannot all stay, whether a window's blocks are freed or kept.
    groups = KVCacheGroups.of(loaded[1].layer_windows, free_windows=not keep_every_block)
    num_blocks = 2 + groups.seq_blocks(32, 4, chunk_tokens=16)
    llm = _llm(loaded, num_blocks=num_blocks, max_model_len=32, preemption_mode=mode,
               num_host_blocks=64 * groups.num_groups if mode == "swap" else 0,
               enable_prefix_caching=False, disable_hybrid_kv_cache_manager=keep_every_block)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_device_blocks


def test_seeded_samples_are_the_same_alone_and_in_a_batch(family):
    loaded, prompts, _ = family
    llm = _llm(loaded)
    seeded = SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded)[0]
    batch = llm.generate(prompts, [GREEDY] * 3 + [seeded] + [GREEDY] * 2)[3]
    samples = [o.token_ids for o in alone.outputs]
    assert [o.token_ids for o in batch.outputs] == samples
    assert len({tuple(s) for s in samples}) > 1


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
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


@pytest.mark.parametrize("family_dir", ["tiny_mistral_dir", "tiny_phi3_dir", "tiny_gemma2_dir",
                                        "tiny_gemma3_dir"])
def test_freeing_window_blocks_keeps_outputs_and_poisoned_free_blocks_are_never_read(
        family_dir, request):
    """Blocks that leave a sequence's window go back to the pool (every layer slides, or
    the sliding layers' KV cache groups beside the global ones'). Between steps every
    free block and the null block are filled with NaN, so a read of a freed (or reused)
    block would poison the outputs; they must equal those of an engine that keeps every
    block and transformers', with fewer bytes held."""
    import jax.numpy as jnp

    directory = request.getfixturevalue(family_dir)
    loaded = load_model(directory)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, loaded[1].vocab_size, n).tolist() for n in (3, 14, 21)]
    expected = greedy_continuations(directory, prompts, MAX_TOKENS)

    def run(**kwargs):
        engine = _llm(loaded, enable_prefix_caching=False, **kwargs).engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, GREEDY)
        outputs, most_held = {}, 0
        while engine.has_unfinished_requests():
            # The null block too: released table entries point there.
            free = np.flatnonzero(engine.block_manager.state.device.refcounts == 0)
            engine.runner.kv_cache = tuple(layer.at[:, :, free].set(jnp.nan)
                                           for layer in engine.runner.kv_cache)
            for output in engine.step():
                outputs[output.request_id] = output.outputs[0].token_ids
            held = engine.block_manager.physical_blocks_used * engine.kv_cache_info.block_bytes
            most_held = max(most_held, held)
            engine.check_invariants()
        return [outputs[str(i)] for i in range(len(prompts))], most_held

    freeing, held_freeing = run()
    keeping, held_keeping = run(disable_hybrid_kv_cache_manager=True)
    assert freeing == keeping == expected
    assert held_freeing < held_keeping


def _hit_lengths(manager, prompt) -> tuple[int, int]:
    """(group 0's hit alone, the hit every group holds) in blocks for `prompt` now."""
    seq = Sequence(-1, list(prompt))
    group = SequenceGroup("probe", [seq])
    anchor = len(manager.managers[0].prefix_hits([seq], group)[0][0])
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
