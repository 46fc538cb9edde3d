"""Async scheduling (each step scheduled while the one before it runs) against
transformers and against synchronous steps.

Oracles: transformers' greedy `generate`; the same engine without async scheduling for
what it does not define (seeded draws with filters and penalties, stops under
min_tokens, stop strings, parallel samples, log-probabilities); the block invariants
after every step; and every block free once the requests end (aborted ones too).
"""

from __future__ import annotations

import pytest

from jpaged.engine.config import EngineConfig
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from tests.engine.test_decode_loop import (
    GREEDY,
    MAX_TOKENS,
    _engine,
    _prompts,
    _run,
    _sampled_requests,
    _token_ids,
    eos_at,
)
from tests.plugins.hf_models import greedy_continuations


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts(loaded):
    return _prompts(loaded[1].vocab_size)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return greedy_continuations(tiny_llama_dir, prompts, MAX_TOKENS)


class PredictionWatch:
    """Counts the steps the scheduler planned before the previous step's tokens were known."""

    def __init__(self, engine):
        self.num_predicted = 0
        scheduler = engine.scheduler
        self._predict = scheduler.predict
        scheduler.predict = self

    def __call__(self, plan):
        self.num_predicted += 1
        return self._predict(plan)


def test_greedy_equals_transformers_on_qwen2(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir)
    prompts = _prompts(loaded[1].vocab_size, (3, 8, 21))
    engine = _engine(loaded, async_scheduling=True)
    finals = _run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))] == (
        greedy_continuations(tiny_qwen2_dir, prompts, MAX_TOKENS))


def test_sampling_and_stops_equal_synchronous_steps(loaded, prompts, expected):
    """Penalties and a fork into samples are finished before the next schedule; every
    other draw is predicted: stop tokens (under min_tokens), stop strings and max_tokens
    are found when its token arrives, and the step planned meanwhile goes to waste."""
    greedy = expected[3]
    stop_at = next(i for i in range(5, MAX_TOKENS) if greedy[i] not in greedy[:i])
    requests = _sampled_requests(prompts, greedy[stop_at])
    synchronous = _run(_engine(loaded), requests)
    engine = _engine(loaded, async_scheduling=True)
    watch = PredictionWatch(engine)
    overlapped = _run(engine, requests)
    assert _token_ids(overlapped) == _token_ids(synchronous)
    assert watch.num_predicted > 0
    assert overlapped["3"].outputs[0].token_ids == greedy[: stop_at + 1]
    for rid in requests:
        for got, want in zip(overlapped[rid].outputs, synchronous[rid].outputs, strict=True):
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-5)
    got, want = overlapped["0"].outputs[0].logprobs, synchronous["0"].outputs[0].logprobs
    assert [list(entry) for entry in got] == [list(entry) for entry in want]


def test_eos_found_when_its_token_arrives(loaded, prompts, expected):
    """The step planned before the EOS arrived goes to waste; the output stops at EOS."""
    with_eos, stop_at = eos_at(loaded, expected)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    finals = _run(_engine(with_eos, async_scheduling=True), {"eos": (prompts[3], params)})
    output = finals["eos"].outputs[0]
    assert output.token_ids == expected[3][: stop_at + 1]
    assert (output.finish_reason, output.stop_reason) == ("stop", None)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs(loaded, prompts, expected, mode):
    """A pool that binds: the schedule planned against predicted tokens preempts
    sequences whose placeholder is still to be replaced."""
    engine = _engine(loaded, async_scheduling=True, block_size=2, num_blocks=40,
                     max_model_len=64, preemption_mode=mode,
                     kv_offloading_size=0.01 if mode == "swap" else None)
    finals = _run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert engine.scheduler.num_preemptions > 0


def test_abort_while_a_step_runs(loaded, prompts, expected):
    engine = _engine(loaded, async_scheduling=True)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, long if i % 2 else GREEDY)
    finals = {}
    for _ in range(4):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    for i in range(1, len(prompts), 2):
        engine.abort(str(i))
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    assert sorted(finals) == [str(i) for i in range(0, len(prompts), 2)]
    assert [finals[str(i)].outputs[0].token_ids for i in range(0, len(prompts), 2)] == (
        expected[::2])
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_device_blocks


def test_the_option_is_checked(loaded):
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="num_decode_steps=4 conflicts with async_scheduling"):
        _engine(loaded, async_scheduling=True, num_decode_steps=4)
