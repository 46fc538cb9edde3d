"""Decode steps on the device (`num_decode_steps` > 1) against transformers and single steps.

Oracles: transformers' greedy `generate`; the same engine with single steps for what
it does not define (seeded draws with every filter and penalty, stop tokens under
min_tokens, stop strings, parallel samples), those being checked against numpy and
transformers elsewhere; a recount of the blocks (`check_invariants`) after every
step; and, after every loop, the slots it wrote read against the pool it returned.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.engine.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import greedy_continuations

MAX_TOKENS = 20
SMALL_BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _prompts(vocab_size: int, lengths=(1, 4, 9, 16, 17, 30)) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts(loaded):
    return _prompts(loaded[1].vocab_size)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return greedy_continuations(tiny_llama_dir, prompts, MAX_TOKENS)


def _engine(loaded, **kwargs) -> LLMEngine:
    config = dict(block_size=4, num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=128, buckets=SMALL_BUCKETS, persistent_compilation_cache=False)
    return LLMEngine(EngineConfig(model="tiny", **(config | kwargs)), loaded=loaded)


@partial(jax.jit, static_argnames=("num_steps", "block_size"))
def _written_refcounts(tables, positions, num_drawn, refcounts, *, num_steps, block_size):
    """The refcount of the block of every slot a loop wrote (row b: positions p_b ..
    p_b + num_drawn_b - 1), and which entries it wrote: (int32 [B, S], bool [B, S])."""
    written = positions[:, None] + jnp.arange(num_steps)
    wrote = jnp.arange(num_steps) < num_drawn[:, None]
    blocks = jnp.take_along_axis(tables, jnp.where(wrote, written // block_size, 0), axis=1)
    return refcounts[blocks], wrote


class LoopWatch:
    """Wraps the runner's decode loop: after every loop, each slot the loop wrote lies in
    a block of refcount 1 in the pool it returned, and its tables extend the host's."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.num_loops, self.num_short_of_blocks = engine, 0, 0
        runner = engine.runner
        self._loop = runner.decode_loop
        runner.decode_loop = self

    def __call__(self, pool, inputs, **kwargs):
        output = self._loop(pool, inputs, **kwargs)
        self.num_loops += 1
        refcounts, wrote = _written_refcounts(
            output.block_tables, inputs.positions, output.num_drawn, output.pool.refcounts,
            num_steps=kwargs["num_steps"], block_size=self.engine.config.block_size)
        assert (np.asarray(refcounts)[np.asarray(wrote)] == 1).all()
        assert (output.num_drawn[~inputs.live] == 0).all()
        before = inputs.block_tables
        np.testing.assert_array_equal(output.block_tables[before != 0], before[before != 0])
        # Ended early with rows going on (those that drew the most) whose next blocks the
        # pool cannot give: the host preempts.
        drawn = output.num_drawn
        going_on = inputs.live & (drawn == drawn.max())
        next_positions = inputs.positions + drawn
        block_size = self.engine.config.block_size
        needed = np.count_nonzero(going_on & (next_positions % block_size == 0))
        if drawn.max() < kwargs["num_steps"] and needed > output.pool.num_free:
            self.num_short_of_blocks += 1
        return output


def _run(engine: LLMEngine, requests: dict) -> dict:
    """Step `requests` (id -> (prompt, params)) to the end with the block invariants
    checked after every step and every block free at the end. -> id -> final output."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_device_blocks
    return finals


def _token_ids(finals: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in finals.items()}


def test_greedy_equals_transformers_on_qwen2(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir)
    prompts = _prompts(loaded[1].vocab_size, (3, 8, 21))
    engine = _engine(loaded, num_decode_steps=16)
    finals = _run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))] == (
        greedy_continuations(tiny_qwen2_dir, prompts, MAX_TOKENS))


def _sampled_requests(prompts: list[list[int]], stop_token: int) -> dict:
    """Seeded draws with every filter and penalty, logprobs, n = 4, a stop token with and
    without min_tokens, max_tokens reached inside a loop, a stop string."""
    draws = [
        SamplingParams(temperature=0.9, top_p=0.8, top_k=30, min_p=0.02, seed=1,
                       repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                       max_tokens=17, logprobs=3),
        SamplingParams(temperature=1.2, seed=2, logit_bias={7: 4.0, 11: -100.0}, max_tokens=13),
        SamplingParams(n=4, temperature=1.0, top_k=50, seed=3, max_tokens=15),
        SamplingParams(temperature=0.0, stop_token_ids=[stop_token], max_tokens=30),
        SamplingParams(temperature=0.0, stop_token_ids=[stop_token], min_tokens=12,
                       max_tokens=30),
        SamplingParams(temperature=0.0, stop=["e"], max_tokens=30),
    ]
    return {str(i): (prompts[i % len(prompts)], params) for i, params in enumerate(draws)}


def test_sampling_and_stops_equal_single_steps(loaded, prompts, expected):
    # Greedy request 3 (prompt 3) stops at a token first drawn in its 6th place or later.
    greedy = expected[3]
    stop_at = next(i for i in range(5, MAX_TOKENS) if greedy[i] not in greedy[:i])
    stop_token = greedy[stop_at]
    requests = _sampled_requests(prompts, stop_token)
    single = _run(_engine(loaded), requests)
    engine = _engine(loaded, num_decode_steps=8)
    watch = LoopWatch(engine)
    looped = _run(engine, requests)
    assert _token_ids(looped) == _token_ids(single)
    assert watch.num_loops > 0
    assert looped["3"].outputs[0].token_ids == greedy[: stop_at + 1]
    assert len(looped["4"].outputs[0].token_ids) >= 12
    for rid in requests:
        for got, want in zip(looped[rid].outputs, single[rid].outputs, strict=True):
            assert got.text == want.text and got.finish_reason == want.finish_reason
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-5)
    got, want = looped["0"].outputs[0].logprobs, single["0"].outputs[0].logprobs
    assert [list(entry) for entry in got] == [list(entry) for entry in want]


def eos_at(loaded, expected, index: int = 3) -> tuple[tuple, int]:
    """The model with its EOS moved to a token that prompt `index`'s greedy continuation
    first draws in its 6th place or later, and that place."""
    greedy = expected[index]
    stop_at = next(i for i in range(5, MAX_TOKENS) if greedy[i] not in greedy[:i])
    model, config, tokenizer = loaded
    return (model, dataclasses.replace(config, eos_token_ids=(greedy[stop_at],)),
            tokenizer), stop_at


def test_eos_inside_the_loop(loaded, prompts, expected):
    with_eos, stop_at = eos_at(loaded, expected)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    finals = _run(_engine(with_eos, num_decode_steps=16), {"eos": (prompts[3], params)})
    output = finals["eos"].outputs[0]
    assert output.token_ids == expected[3][: stop_at + 1]
    assert (output.finish_reason, output.stop_reason) == ("stop", None)


def test_parallel_samples_share_blocks_as_without_sharing(loaded, prompts):
    """n = 4 forked from one prompt: shared blocks copied on write give the tokens of
    private copies."""
    params = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    requests = {"n4": (prompts[3], params)}
    shared = _run(_engine(loaded, num_decode_steps=16, block_size=8), requests)
    private = _run(_engine(loaded, num_decode_steps=16, block_size=8, share_blocks=False),
                   requests)
    assert _token_ids(shared) == _token_ids(private)
    assert len({tuple(tokens) for tokens in _token_ids(shared)["n4"]}) > 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pool_that_runs_out_inside_the_loop_preempts_after_it(loaded, prompts, expected,
                                                                 mode):
    engine = _engine(loaded, num_decode_steps=16, block_size=2, num_blocks=40, max_model_len=64,
                     preemption_mode=mode, kv_offloading_size=0.01 if mode == "swap" else None)
    watch = LoopWatch(engine)
    finals = _run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert engine.scheduler.num_preemptions > 0
    assert watch.num_short_of_blocks > 0


def test_abort_between_loops_frees_every_block(loaded, prompts):
    engine = _engine(loaded, num_decode_steps=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=60))
    for _ in range(3):
        engine.step()
        engine.check_invariants()
    for i in range(len(prompts)):
        engine.abort(str(i))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_device_blocks


def test_the_loop_option_is_checked(loaded):
    with pytest.raises(ValueError, match="num_decode_steps must be >= 1, got 0"):
        EngineConfig(num_decode_steps=0)
    with pytest.raises(TypeError, match="num_decode_steps must be an int"):
        EngineConfig(num_decode_steps=2.5)

