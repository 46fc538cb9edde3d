"""Prompt forms (vLLM's) and bad input: clear errors before any state changes, and the
engine keeps serving."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=64, persistent_compilation_cache=False,
                  buckets=BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2))
    return LLM("tiny", loaded=loaded, **(config | kwargs))


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def llm(loaded):
    return _llm(loaded)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_every_prompt_form_gives_the_same_tokens(llm):
    text = "the theme in the air"
    ids = llm.get_tokenizer().encode(text)
    expected = _tokens(llm.generate(text, GREEDY))
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids},
             {"prompt_token_ids": ids, "prompt": text, "cache_salt": "a"}]
    for form in forms:
        assert _tokens(llm.generate(form, GREEDY)) == expected, form
    batch = llm.generate(forms, GREEDY)
    assert _tokens(batch) == expected * len(forms)
    assert batch[2].prompt == text and batch[3].prompt is None and batch[4].prompt == text
    assert all(o.prompt_token_ids == ids for o in batch)
    # A list of token-id dicts is a batch, not a conversation.
    assert len(llm.generate([{"prompt_token_ids": ids}] * 3, GREEDY)) == 3


def test_cache_salt_isolates_prefix_cache_tenants(llm):
    stats = llm.engine.block_manager.prefix_cache_stats
    prompt = np.random.default_rng(1).integers(0, 200, 40).tolist()
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY)
    hits = stats.hit_blocks
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, GREEDY)
    assert stats.hit_blocks == hits
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY)
    assert stats.hit_blocks > hits


@pytest.mark.parametrize("prompt,match", [
    ([{"role": "user", "content": "hi"}], "LLM.chat"),
    ({"text": "hi"}, "unknown prompt keys"),
    ({"cache_salt": "a"}, "needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt_token_ids": "1 2"}, "list of ints"),
    ({"prompt": 3}, "'prompt' must be a str"),
    (3.5, "a prompt is a str"),
    ([1, "a"], "a prompt is a str"),
])
def test_malformed_prompts_name_the_accepted_forms(llm, prompt, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompt, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_chat_goes_through_the_template(llm):
    tokenizer = llm.get_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (output,) = llm.chat([{"role": "user", "content": "the theme"}], GREEDY)
    assert output.prompt_token_ids == tokenizer.encode("the theme\n", add_special_tokens=False)


@pytest.mark.parametrize("field,value,match", [
    ("n", 0, "n must be >= 1"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, "top_k must be >= -1"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
    ("temperature", -0.5, "temperature must be >= 0"),
    ("temperature", math.nan, "temperature must be finite"),
    ("temperature", math.inf, "temperature must be finite"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\]"),
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("min_tokens", 20, r"min_tokens \(20\) must be <= max_tokens"),
    ("logprobs", -1, "logprobs must be >= 0"),
    ("stop", ["ok", ""], "stop strings must not be empty"),
    ("seed", 2**63, "seed must be <= 9223372036854775807"),
    ("seed", -2**63 - 1, "seed must be >= -9223372036854775808"),
    ("logit_bias", {3: 100.5}, r"logit_bias of token 3 must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1.0}, "every token id of logit_bias must be >= 0"),
])
def test_bad_sampling_params_name_the_field_and_limit(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_seed_minus_one_means_unseeded_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2


def test_type_errors_name_the_field():
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=2.0)
    with pytest.raises(TypeError, match="stop must be a string"):
        SamplingParams(stop=[3])
    with pytest.raises(TypeError, match="output_kind"):
        SamplingParams(output_kind="delta")
    with pytest.raises(TypeError, match="logit_bias must be a dict"):
        SamplingParams(logit_bias=[(3, 1.0)])
    with pytest.raises(TypeError, match="every token id of logit_bias must be an int"):
        SamplingParams(logit_bias={"3": 1.0})


def test_tiny_temperature_is_greedy(llm):
    near_zero = SamplingParams(temperature=1e-6, max_tokens=6, ignore_eos=True, seed=3)
    assert _tokens(llm.generate("the theme", near_zero)) == _tokens(
        llm.generate("the theme", GREEDY))


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be >= 1"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be >= 1"),
    (dict(beam_width=2, max_tokens=4, scoring="hf"), "scoring must be"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping must be"),
    (dict(beam_width=2, max_tokens=4, temperature=math.nan), "temperature must be finite"),
])
def test_bad_beam_search_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_engine_limits_are_checked_before_anything_is_queued(llm):
    engine = llm.engine
    engine.add_request("good", "the theme", GREEDY)
    vocab_size = engine.model_config.vocab_size
    bad = [
        (SamplingParams(logprobs=21), "logprobs=21 is more than max_logprobs=20"),
        (SamplingParams(prompt_logprobs=30), "prompt_logprobs=30 is more than max_logprobs=20"),
        (SamplingParams(n=9), r"n=9 is more than min\(max_num_seqs"),
        (BeamSearchParams(beam_width=9, max_tokens=4), r"beam_width=9 is more than min"),
        (SamplingParams(logit_bias={vocab_size: 1.0}),
         rf"logit_bias has token ids \[{vocab_size}\] outside the vocabulary \[0, {vocab_size}\)"),
        (SamplingParams(stop_token_ids=[vocab_size + 1], min_tokens=2),
         rf"stop_token_ids has token ids \[{vocab_size + 1}\] outside the vocabulary"),
    ]
    for params, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", "the theme", params)
        with pytest.raises(ValueError, match=match):
            llm.generate(["the theme", "a"], params) if isinstance(
                params, SamplingParams) else llm.beam_search(["the theme"], params)
    assert engine.scheduler.num_waiting == 1
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == ["good"]
    assert _tokens([finished["good"]]) == _tokens(llm.generate("the theme", GREEDY))


def test_beam_candidates_must_fit_max_logprobs(loaded):
    llm = _llm(loaded, max_logprobs=5)
    with pytest.raises(ValueError, match="needs 6 candidates per beam, more than max_logprobs=5"):
        llm.beam_search(["the theme"], BeamSearchParams(beam_width=3, max_tokens=4))
    with pytest.raises(ValueError, match="max_logprobs must be >= 1"):
        _llm(loaded, max_logprobs=0)
    assert not llm.engine.has_unfinished_requests()
