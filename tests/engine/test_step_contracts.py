"""Every step runner, every proposer and every KV group-table type through the same checks.

The engine's seams (jpaged.worker's step runners, jpaged.speculative's proposers, the
KV cache manager's group tables) are chosen once when an engine starts. Whatever was
chosen, a step must: give transformers' greedy tokens (the oracle), keep the block
invariants after every step (`check_invariants`), leave every block free once the
requests end, and do what its mode is for (a loop ran, a step was predicted, a proposal
was accepted). Each case also checks that the engine built the parts it names.
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.async_scheduler import AsyncScheduler
from jpaged.core.scheduler import Scheduler
from jpaged.core.step_shapes import BucketSizes
from jpaged.engine.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.speculative.draft_model import DraftModelProposer
from jpaged.speculative.ngram import NgramProposer
from jpaged.speculative.proposer import Proposer
from jpaged.worker.decode_loop_runner import DecodeLoopRunner
from jpaged.worker.step_runner import SingleStepRunner
from tests.engine.test_async_scheduling import PredictionWatch
from tests.engine.test_decode_loop import LoopWatch
from tests.plugins.hf_models import greedy_continuations

MAX_TOKENS = 20
K = 3
# EOS suppressed to the end, as transformers' min_new_tokens does.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)


def _mode(name: str, model_dir) -> tuple[dict, type, type, type]:
    """(config, step runner, proposer, scheduler) of a mode."""
    return {
        "one step": ({}, SingleStepRunner, Proposer, Scheduler),
        "async scheduling": ({"async_scheduling": True}, SingleStepRunner, Proposer,
                             AsyncScheduler),
        "decode loop": ({"num_decode_steps": 8}, DecodeLoopRunner, Proposer, Scheduler),
        "n-gram proposer": ({"speculative_config": {
            "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}},
            SingleStepRunner, NgramProposer, Scheduler),
        # The target drafting for itself: every proposal is accepted.
        "draft model proposer": ({"speculative_config": {
            "method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}},
            SingleStepRunner, DraftModelProposer, Scheduler),
    }[name]


MODES = ("one step", "async scheduling", "decode loop", "n-gram proposer",
         "draft model proposer")
# model -> (block size, prefix caching, KV cache groups): full-attention tables (block
# size 1: every token crosses a block, inside a decode loop too), one sliding window over
# every layer (a block twice the window), and global and sliding groups over one pool.
MODELS = {"tiny_llama_dir": (1, True, 1), "tiny_mistral_dir": (16, False, 1),
          "tiny_gemma2_dir": (4, True, 2)}


def _prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-grams recur at once) and prompts that do not."""
    rng = np.random.default_rng(3)
    phrases = [rng.integers(0, vocab_size, n).tolist() for n in (5, 4)]
    repeated = [phrase * 3 + rng.integers(0, vocab_size, 2).tolist() for phrase in phrases]
    return repeated + [rng.integers(0, vocab_size, n).tolist() for n in (1, 11, 17)]


@pytest.fixture(scope="module")
def model(request):
    model_dir = request.getfixturevalue(request.param)
    loaded = load_model(model_dir)
    prompts = _prompts(loaded[1].vocab_size)
    return (model_dir, loaded, *MODELS[request.param], prompts,
            greedy_continuations(model_dir, prompts, MAX_TOKENS))


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list:
    """Every prompt to the end, the block invariants checked after each step and every
    block free at the end. -> the final outputs, in prompt order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_device_blocks, "a block leaked"
    return [finals[str(i)] for i in range(len(prompts))]


# The fast tier runs every mode on full-attention tables and one step on the others.
CASES = [pytest.param(name, mode, marks=() if name == "tiny_llama_dir" or mode == "one step"
                      else pytest.mark.full, id=f"{name}-{mode}")
         for name in MODELS for mode in MODES]


@pytest.mark.parametrize(("model", "mode"), CASES, indirect=["model"])
def test_a_mode_gives_transformers_tokens_and_keeps_the_blocks(model, mode):
    model_dir, loaded, block_size, caching, num_groups, prompts, expected = model
    config, step_runner, proposer, scheduler = _mode(mode, model_dir)
    config = EngineConfig(
        model="tiny", block_size=block_size, num_blocks=2 + 8 * 128 // block_size,
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, buckets=BUCKETS,
        enable_prefix_caching=caching, persistent_compilation_cache=False, **config)
    if mode == "decode loop" and num_groups > 1:  # a conflict of the step modes' table
        with pytest.raises(ValueError, match="num_decode_steps=8 conflicts with the model's "
                                             "local and global layers in KV cache groups"):
            LLMEngine(config, loaded=loaded)
        return
    engine = LLMEngine(config, loaded=loaded)
    assert engine.block_manager.num_groups == num_groups
    assert type(engine.core.step_runner) is step_runner
    assert type(engine.core.proposer) is proposer
    assert type(engine.scheduler) is scheduler
    # Each loop's written slots against the pool it returned; the predictions made.
    loops = LoopWatch(engine) if step_runner is DecodeLoopRunner else None
    predictions = PredictionWatch(engine) if scheduler is AsyncScheduler else None
    outputs = _run(engine, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if loops is not None:
        assert loops.num_loops > 0
        assert engine.stats.num_steps < len(prompts) + MAX_TOKENS  # fewer round trips
    if predictions is not None:
        assert predictions.num_predicted >= MAX_TOKENS  # every draw after the first step
    if proposer is not Proposer:
        counts = engine.stats.spec_decode
        assert 0 < counts.num_accepted_tokens <= counts.num_draft_tokens
        assert sum(o.metrics.num_accepted_tokens for o in outputs) == counts.num_accepted_tokens
        assert sum(o.metrics.num_draft_tokens for o in outputs) == counts.num_draft_tokens
        assert sum(counts.num_accepted_tokens_per_pos) == counts.num_accepted_tokens
    if proposer is DraftModelProposer:  # the target drafting for itself
        assert counts.num_accepted_tokens == counts.num_draft_tokens
