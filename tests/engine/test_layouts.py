"""The engine's options on every KV cache layout kind, against transformers' `generate`.

Each option runs on the rows of the covering array in tests/plugins/layouts.py (no
window at block size 128; a window of 8 on every layer at block sizes 4 and 16; local
and global layers in KV cache groups at block size 1); prompts and generations run past
the window. Greedy tokens must equal transformers' in one batch with chunked prefill
splitting the long prompts across the window (and again from the prefix cache), each
prompt alone, after recompute and swap preemption, with a decode loop on the device,
with async scheduling and with n-gram speculation; a seeded n = 4 request samples the
same alone as in a batch; an int8 cache reads forked and cached blocks as it wrote them.
Beam search and log-probabilities run on the same rows in their own modules, tensor
parallelism in tests/multidevice.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.worker.decode_loop_runner import DecodeLoopRunner
from tests.plugins.hf_models import greedy_continuations
from tests.plugins.layouts import LAYOUTS, Layout, layout_params

MAX_TOKENS = 12
MAX_MODEL_LEN = 64
# EOS suppressed to the end, as the oracle's min_new_tokens does.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
BUCKETS = BucketSizes(min_num_tokens=16, min_num_seqs=8, min_blocks_per_seq=4)
# The windowed row that keeps every block under preemption (the others free what leaves
# the window): so recompute and swap each meet both a freeing and a keeping table.
KEEPS_EVERY_BLOCK = LAYOUTS[2]


@dataclass(frozen=True)
class Row:
    """A row's model loaded, its prompts and transformers' greedy continuations."""

    layout: Layout
    loaded: tuple
    prompts: list[list[int]]
    expected: list[list[int]]

    @property
    def groups(self) -> KVCacheGroups:
        return KVCacheGroups.of(self.loaded[1].layer_windows)

    def llm(self, **kwargs) -> LLM:
        """An engine of the row's block size whose pool holds 8 sequences of 64 tokens; a
        16-token budget splits the 19-token prompt over steps, across the window."""
        block_size = kwargs.get("block_size", self.layout.block_size)
        num_blocks = 2 + 8 * self.groups.seq_blocks(MAX_MODEL_LEN, block_size, chunk_tokens=16)
        config = dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=8,
                      max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN, buckets=BUCKETS,
                      persistent_compilation_cache=False)
        return LLM("tiny", loaded=self.loaded, **(config | kwargs))


def _prompts(vocab_size: int) -> list[list[int]]:
    """Lengths 1 to 19, two sharing a 12-token prefix, one repeating a phrase (n-grams
    recur at once): within 31 tokens with their outputs."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab_size, 12).tolist()
    phrase = rng.integers(0, vocab_size, 5).tolist()
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in (1, 5, 13, 19)]
    return prompts + [shared + [5, 6, 7], shared + [8, 9], phrase * 3 + [3, 4]]


@pytest.fixture(scope="module", params=layout_params())
def row(request) -> Row:
    layout = request.param
    directory = request.getfixturevalue(layout.model_dir)
    loaded = load_model(directory)
    prompts = _prompts(loaded[1].vocab_size)
    return Row(layout, loaded, prompts, greedy_continuations(directory, prompts, MAX_TOKENS))


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _all_blocks_free(llm: LLM) -> bool:
    manager = llm.engine.block_manager
    return manager.num_free_blocks == manager.num_device_blocks


def test_greedy_batch_matches_transformers_and_again_from_the_prefix_cache(row):
    llm = row.llm()
    assert _tokens(llm.generate(row.prompts, GREEDY)) == row.expected
    assert _tokens(llm.generate(row.prompts, GREEDY)) == row.expected
    hits = llm.engine.block_manager.prefix_cache_stats.hit_tokens
    # The 19-token prompt fills a block unless a block holds 128 tokens.
    assert (hits > 0) == (row.layout.block_size <= 19)
    assert _all_blocks_free(llm)


def test_each_prompt_alone_matches(row):
    llm = row.llm()
    for prompt, tokens in zip(row.prompts, row.expected, strict=True):
        assert _tokens(llm.generate([prompt], GREEDY)) == [tokens]


# The rows whose sequences grow into new blocks (at 128 tokens a block none does, so a
# pool admits what it can hold and never preempts; tests/engine/test_engine.py preempts
# a model without a window).
@pytest.mark.parametrize("row", layout_params(LAYOUTS[1:]), indirect=True)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_without_prefix_caching_keeps_greedy_outputs(row, mode):
    # A pool of one 32-token sequence and a block: seven sequences of up to 31 tokens
    # cannot all stay, whether a window's blocks are freed or kept.
    keep = row.layout == KEEPS_EVERY_BLOCK
    groups = KVCacheGroups.of(row.loaded[1].layer_windows, free_windows=not keep)
    block_size = row.layout.block_size
    llm = row.llm(num_blocks=2 + groups.seq_blocks(32, block_size, chunk_tokens=16),
                  max_model_len=32, preemption_mode=mode,
                  kv_offloading_size=0.01 if mode == "swap" else None,
                  enable_prefix_caching=False, disable_hybrid_kv_cache_manager=keep)
    assert _tokens(llm.generate(row.prompts, GREEDY)) == row.expected
    assert llm.engine.stats.num_preemptions > 0
    assert _all_blocks_free(llm)


def test_seeded_samples_are_the_same_alone_and_in_a_batch(row):
    llm = row.llm()
    seeded = SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    alone = llm.generate([row.prompts[3]], seeded)[0]
    params = [GREEDY] * len(row.prompts)
    params[3] = seeded
    batch = llm.generate(row.prompts, params)[3]
    samples = [o.token_ids for o in alone.outputs]
    assert [o.token_ids for o in batch.outputs] == samples
    assert len({tuple(s) for s in samples}) > 1


def test_decode_loop_matches_transformers(row):
    # The loop grows one table per sequence: a model with KV cache groups keeps every
    # block in one (the conflict itself: tests/engine/test_step_modes.py).
    keep_every_block = row.groups.num_groups > 1
    llm = row.llm(num_decode_steps=4, disable_hybrid_kv_cache_manager=keep_every_block)
    assert isinstance(llm.engine.core.step_runner, DecodeLoopRunner)
    assert _tokens(llm.generate(row.prompts, GREEDY)) == row.expected
    assert _all_blocks_free(llm)


def test_async_scheduling_matches_transformers(row):
    llm = row.llm(async_scheduling=True)
    assert _tokens(llm.generate(row.prompts, GREEDY)) == row.expected
    assert _all_blocks_free(llm)


def test_ngram_speculation_matches_transformers(row):
    """Proposals reach past a block's end and into the window's edge; rejected ones are
    rolled back (min_tokens counts the proposals before a position)."""
    llm = row.llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert _tokens(llm.generate(row.prompts, GREEDY)) == row.expected
    assert llm.engine.stats.spec_decode.num_draft_tokens > 0
    assert _all_blocks_free(llm)


def _top_logprobs(completion) -> np.ndarray:
    """[steps, 2]: the two highest log-probabilities of each step, highest first."""
    return np.array([sorted((entry.logprob for entry in step.values()), reverse=True)
                     for step in completion.logprobs])


def test_an_int8_cache_reads_forked_and_cached_blocks_as_it_wrote_them(row):
    """Two samples fork off the 19-token prompt (copy-on-write of its last block, scales
    included), then the prompt runs again from the prefix cache: each reads the values
    and scales an unshared run wrote, within float32 tolerance."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    prompt = row.prompts[3]
    (unshared,) = row.llm(kv_cache_dtype="int8").generate([prompt], greedy)
    llm = row.llm(kv_cache_dtype="int8")
    (forked,) = llm.generate([prompt], SamplingParams(n=2, temperature=0.0,
                                                      max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      logprobs=2))
    (cached,) = llm.generate([prompt], greedy)
    expected = unshared.outputs[0]
    for completion in (*forked.outputs, cached.outputs[0]):
        assert completion.token_ids == expected.token_ids
        np.testing.assert_allclose(_top_logprobs(completion), _top_logprobs(expected),
                                   atol=1e-5, rtol=0)
    assert _all_blocks_free(llm)


@jax.jit
def _poisoned(kv_cache, free):
    """kv_cache with NaN in every block where free (bool [num_blocks]) is set."""
    return jax.tree.map(lambda pages: jnp.where(free[None, None, :, None, None], jnp.nan, pages),
                        kv_cache)


@pytest.mark.parametrize("row", layout_params(LAYOUTS[1:]), indirect=True)
def test_freeing_window_blocks_keeps_outputs_and_poisoned_free_blocks_are_never_read(row):
    """Blocks that leave a sequence's window go back to the pool (every layer slides, or
    the sliding layers' KV cache groups beside the global ones'). Between steps every
    free block and the null block are filled with NaN, so a read of a freed (or reused)
    block would poison the outputs; they must equal those of an engine that keeps every
    block and transformers', with fewer bytes held."""
    def run(**kwargs):
        engine = row.llm(enable_prefix_caching=False, **kwargs).engine
        for i, prompt in enumerate(row.prompts):
            engine.add_request(str(i), prompt, GREEDY)
        outputs, most_held = {}, 0
        while engine.has_unfinished_requests():
            # The null block too: released table entries point there.
            free = engine.block_manager.state.device.refcounts == 0
            engine.runner.kv_cache = _poisoned(engine.runner.kv_cache, free)
            for output in engine.step():
                outputs[output.request_id] = output.outputs[0].token_ids
            held = engine.block_manager.physical_blocks_used * engine.kv_cache_info.block_bytes
            most_held = max(most_held, held)
            engine.check_invariants()
        return [outputs[str(i)] for i in range(len(row.prompts))], most_held

    freeing, held_freeing = run()
    keeping, held_keeping = run(disable_hybrid_kv_cache_manager=True)
    assert freeing == keeping == row.expected
    assert held_freeing < held_keeping
