"""The serving engine against transformers' `generate` (greedy) as the oracle.

Greedy tokens of a request must not depend on the block size, the batch it
shares, preemption (recompute or swap), prefix caching, chunked prefill or the
attention backend.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kernels_pallas
from jpaged.core.step_shapes import BucketSizes, default_buckets, step_shapes
from jpaged.engine.stats import num_compilations
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams
from tests.plugins.hf_models import greedy_continuations
from tests.plugins.kernels import kernel_interpret

MAX_TOKENS = 12
SMALL_BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)


def _prompts(vocab_size: int) -> list[list[int]]:
    """Token-id prompts of assorted lengths; two share a 20-token prefix."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab_size, 20).tolist()
    lengths = [1, 3, 9, 17, 33, 6]
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in lengths]
    return prompts + [shared + [5, 6, 7], shared + [8, 9]]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts(loaded):
    return _prompts(loaded[1].vocab_size)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    """transformers' greedy continuation of each prompt, one prompt at a time."""
    return greedy_continuations(tiny_llama_dir, prompts, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=8, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=128, buckets=SMALL_BUCKETS, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("block_size", [1, 8, 16, 128])
def test_greedy_batch_matches_transformers(loaded, prompts, expected, block_size):
    llm = _llm(loaded, block_size=block_size, num_blocks=2 + 8 * 128 // block_size)
    outputs = llm.generate(prompts, GREEDY)
    assert _tokens(outputs) == expected
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_each_prompt_alone_matches_the_batch(loaded, prompts, expected):
    llm = _llm(loaded)
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert _tokens(llm.generate([prompt], GREEDY)) == [tokens]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs(loaded, prompts, expected, mode):
    # 12 usable blocks of 4 tokens: the 33-token prompt alone needs 12 by its end.
    llm = _llm(loaded, block_size=4, num_blocks=13, max_model_len=48, preemption_mode=mode,
               kv_offloading_size=0.01 if mode == "swap" else None, enable_prefix_caching=False)
    outputs = llm.generate(prompts, GREEDY)
    assert _tokens(outputs) == expected
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_device_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(loaded, prompts, expected, prefix_caching):
    llm = _llm(loaded, enable_prefix_caching=prefix_caching)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected and _tokens(again) == expected
    hit_rate = llm.engine.block_manager.prefix_cache_stats.hit_rate
    assert (hit_rate > 0.3) if prefix_caching else hit_rate == 0.0


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_on_and_off(loaded, prompts, expected, chunked):
    # A 16-token budget splits the long prompts over several steps when chunking.
    budget = 16 if chunked else 128
    llm = _llm(loaded, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected


@pytest.mark.parametrize("backend", [kernels_pallas.pallas_implementation(False), "reference"])
def test_other_attention_backends(loaded, prompts, expected, backend):
    # The default on CPU is "xla"; there the Pallas kernels run in interpret mode.
    llm = _llm(loaded, attention_backend=backend,
               interpret=backend != "reference" and kernel_interpret(backend))
    picked = [0, 3, 6]
    outputs = llm.generate([prompts[i] for i in picked], GREEDY)
    assert _tokens(outputs) == [expected[i] for i in picked]


def test_default_buckets_pad_xla_tables_to_one_width(loaded, prompts, expected):
    # The XLA loop stops each tile at its own length: full-width tables cost nothing.
    llm = _llm(loaded, buckets=None, attention_backend="xla")
    shapes = step_shapes(llm.engine.shapes.buckets, 64, 8, 128 // 8)
    assert {width for _, _, width, _ in shapes} == {16}
    reference_buckets = default_buckets("reference", 16, 8)
    assert {width for _, _, width, _ in step_shapes(reference_buckets, 64, 8, 16)} == {8, 16}
    assert _tokens(llm.generate(prompts, GREEDY)) == expected


# The decode loop compiles per decode step shape: one table width keeps them few.
ONE_WIDTH = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=16)


@pytest.mark.full
@pytest.mark.parametrize(("options"), [{}, {"num_decode_steps": 4, "buckets": ONE_WIDTH},
                                       {"async_scheduling": True}])
def test_no_recompilation_after_warmup(loaded, options, no_compilation_cache):
    llm = _llm(loaded, block_size=4, num_blocks=96, max_model_len=64, **options)
    llm.engine.warmup()
    rng = np.random.default_rng(1)
    vocab = llm.engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(100)]
    # Greedy, drawing, penalised and biased rows, alone and mixed, with grammars too:
    # every sampler variant (a row asking for top log-probabilities among them).
    grammar = StructuredOutputsParams(regex="[a-z ]{1,80}")
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2),
             dict(temperature=0.0, repetition_penalty=1.2),
             dict(temperature=1.0, presence_penalty=0.5),
             dict(temperature=0.7, seed=-5, logit_bias={5: 3.0, 9: -100.0}),
             dict(temperature=0.0, logit_bias={int(rng.integers(vocab)): 50.0}),
             dict(temperature=0.0, structured_outputs=grammar),
             dict(temperature=0.9, seed=4, presence_penalty=0.5, structured_outputs=grammar)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 24)), ignore_eos=True,
                             **kinds[i % len(kinds)]) for i in range(len(prompts))]
    # A persistent cache would serve a missed shape without a compile event.
    assert jax.config.jax_compilation_cache_dir is None
    before = num_compilations()
    outputs = llm.generate(prompts, params)
    assert num_compilations() - before == 0
    free = [i for i, p in enumerate(params) if p.structured_outputs is None]
    lengths = [len(outputs[i].outputs[0].token_ids) for i in free]
    assert lengths == [min(params[i].max_tokens, 64 - len(prompts[i])) for i in free]


def test_bad_requests_are_rejected_and_others_keep_running(loaded, prompts, expected):
    llm = _llm(loaded)
    engine = llm.engine
    engine.add_request("good", prompts[2], GREEDY)
    bad = [
        ([], ValueError, "empty"),
        (list(range(129)), ValueError, "max_model_len"),
        ([engine.model_config.vocab_size], ValueError, "vocabulary"),
        (3.5, TypeError, "prompt"),
    ]
    for prompt, error, message in bad:
        with pytest.raises(error, match=message):
            engine.add_request(f"bad-{message}", prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["good"]
    assert finished["good"].outputs[0].token_ids == expected[2]


def test_generate_checks_every_prompt_before_running_any(loaded, prompts):
    llm = _llm(loaded)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([prompts[0], []], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_pool_too_small_for_one_sequence_is_rejected(loaded):
    with pytest.raises(ValueError, match="max_model_len=128 tokens needs 16"):
        _llm(loaded, block_size=8, num_blocks=10)


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="cannot load model"):
        LLM("no-such-model")


def test_abort_frees_every_block(loaded, prompts):
    engine = _llm(loaded).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    for i in range(len(prompts)):
        engine.abort(str(i))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_device_blocks


def test_stop_token_ends_the_request(loaded, prompts, expected):
    llm = _llm(loaded)
    stop = expected[1][4]
    first_stop = expected[1].index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(stop,),
                            ignore_eos=True)
    output = llm.generate([prompts[1]], params)[0].outputs[0]
    assert output.token_ids == expected[1][: first_stop + 1]
    assert output.finish_reason == "stop"


def test_seeded_sampling_is_independent_of_the_batch(loaded, prompts):
    llm = _llm(loaded)
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=MAX_TOKENS, seed=1234,
                            ignore_eos=True)
    alone = _tokens(llm.generate([prompts[2]], params))[0]
    in_batch = _tokens(llm.generate(prompts, params))[2]
    assert alone == in_batch


class CallRecorder:
    """Stands in for the scheduler and records the names of the methods called on it
    (attribute reads, properties included, pass through unrecorded)."""

    def __init__(self, target):
        self.target, self.calls = target, []

    def __getattr__(self, name):
        value = getattr(self.target, name)
        if not callable(value):
            return value

        def recorded(*args, **kwargs):
            self.calls.append(name)
            return value(*args, **kwargs)

        return recorded


def test_a_step_calls_the_scheduler_once_back(loaded, prompts, expected):
    """schedule, then update_from_output, and nothing else, in prefill and decode steps;
    a stop string found in the text adds one finish_seq call (and a reading of the
    queues) before the next step."""
    engine = _llm(loaded).engine
    recorder = engine.core.scheduler = CallRecorder(engine.core.scheduler)
    engine.add_request("plain", prompts[3], GREEDY)
    text = engine.tokenizer.decode(expected[4][:6], skip_special_tokens=True)
    stop = text.strip()[-3:]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            stop=[stop])
    engine.add_request("stopped", prompts[4], params)
    recorder.calls.clear()
    steps, outputs = [], {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        steps.append(recorder.calls[:])
        recorder.calls.clear()
    stopped = outputs["stopped"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert outputs["plain"].outputs[0].token_ids == expected[3]
    with_stop = [calls for calls in steps if "finish_seq" in calls]
    assert with_stop == [["schedule", "update_from_output", "finish_seq", "stats"]]
    assert len(stopped.token_ids) < MAX_TOKENS
    assert all(calls == ["schedule", "update_from_output"]
               for calls in steps if "finish_seq" not in calls)
    assert len(steps) > 2


def test_engines_of_one_model_and_pool_share_their_compiled_steps(loaded, prompts, expected,
                                                                   no_compilation_cache):
    """A second engine of the same model and pool runs on the first one's compiled steps;
    an engine of another pool size gets functions of its own (its shapes differ)."""
    first = _llm(loaded)
    assert _tokens(first.generate(prompts, GREEDY)) == expected
    compiled = num_compilations()
    second = _llm(loaded)
    assert _tokens(second.generate(prompts, GREEDY)) == expected
    assert num_compilations() == compiled
    other_pool = _llm(loaded, num_blocks=64)
    assert other_pool.engine.runner.functions is not first.engine.runner.functions
    assert second.engine.runner.functions is first.engine.runner.functions
