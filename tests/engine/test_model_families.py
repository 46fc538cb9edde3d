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
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import greedy_continuations

FAMILIES = ["tiny_qwen3_dir", "tiny_mistral_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
            "tiny_phi3_dir"]
MAX_TOKENS = 12
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


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_without_prefix_caching_keeps_greedy_outputs(family, mode):
    loaded, prompts, expected = family
    # 9 usable blocks of 4 tokens, 8 for one 32-token sequence: six sequences of up to
    # 31 tokens cannot all stay, as long as every block is kept (freeing the window's
    # blocks, they all fit this pool).
    llm = _llm(loaded, num_blocks=10, max_model_len=32, preemption_mode=mode,
               num_host_blocks=64 if mode == "swap" else 0, enable_prefix_caching=False,
               disable_hybrid_kv_cache_manager=True)
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


def test_a_gemma_shaped_model_compiles_nothing_after_warmup(tiny_gemma3_dir):
    """Local and global layers, both RoPEs and the window in one scanned step: warm-up
    covers every shape and sampler variant the requests below reach."""
    import jax

    from jpaged.engine.stats import num_compilations

    loaded = load_model(tiny_gemma3_dir)
    llm = _llm(loaded, max_model_len=32)
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


@pytest.mark.parametrize("family_dir", ["tiny_mistral_dir", "tiny_phi3_dir"])
def test_freeing_window_blocks_keeps_outputs_and_poisoned_free_blocks_are_never_read(
        family_dir, request):
    """Every layer slides: blocks that leave a sequence's window go back to the pool.
    Between steps every free block and the null block are filled with NaN, so a read
    of a freed (or reused) block would poison the outputs; they must equal those of an engine that
    keeps every block and transformers', with fewer blocks held."""
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
            most_held = max(most_held, engine.block_manager.physical_blocks_used)
            engine.check_invariants()
        return [outputs[str(i)] for i in range(len(prompts))], most_held

    freeing, held_freeing = run()
    keeping, held_keeping = run(disable_hybrid_kv_cache_manager=True)
    assert freeing == keeping == expected
    assert held_freeing < held_keeping
