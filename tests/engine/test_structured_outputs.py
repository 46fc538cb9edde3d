"""Structured outputs: every output keeps to its request's grammar, token by token.

Oracles: the constraint's own validators (`jsonschema` for JSON schemas, `re.fullmatch`
for regular expressions, membership for choices, `lark` for Lark grammars), the text
each output's token ids decode to, and the same requests without a grammar or in another
step mode. The model here is a tiny random Llama with a 263-token byte-level tokenizer:
whatever it draws, the grammar must shape it. The default model's outputs under the
schemas of benchmarks.structured_outputs are checked in the full tier.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types

import jsonschema
import lark
import pytest

from jpaged import __main__ as cli
from jpaged.core.step_shapes import BucketSizes
from jpaged.engine.protocol import EngineState
from jpaged.entrypoints.llm import LLM
from jpaged.entrypoints.metrics import EngineCollector
from jpaged.errors import InvalidParameter, InvalidParameterType
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams

SMALL_BUCKETS = BucketSizes(min_num_tokens=16, min_num_seqs=4, min_blocks_per_seq=8)
PROMPTS = ["the answer:", "in the", "a", "there"]

# Schemas whose instances are short, so that a random model's outputs finish.
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "n": {"type": "integer", "minimum": -5, "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
     "maxItems": 3},
    {"type": "object", "properties": {"tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                      "v": {"anyOf": [{"type": "null"},
                                                      {"type": "integer", "minimum": 0,
                                                       "maximum": 9}]}},
     "required": ["tag"], "additionalProperties": False},
]
REGEX = r"(ab|c[0-9]){1,3}-[xyz]"
CHOICES = ["yes", "no", "maybe not"]
ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=4, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=96, buckets=SMALL_BUCKETS, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


@pytest.fixture(scope="module")
def llm(loaded):
    return _llm(loaded)


CONSTRAINT_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)}


def _params(**fields) -> SamplingParams:
    """Greedy SamplingParams of 40 tokens at most, but for `fields`, with the
    StructuredOutputsParams that the rest of `fields` make."""
    constraint = {k: v for k, v in fields.items() if k in CONSTRAINT_FIELDS}
    sampling = {k: v for k, v in fields.items() if k not in CONSTRAINT_FIELDS}
    return SamplingParams(**({"temperature": 0.0, "max_tokens": 40} | sampling),
                          structured_outputs=StructuredOutputsParams(**constraint))


def _completions(outputs):
    return [c for o in outputs for c in o.outputs]


def _check_text_is_its_tokens(llm, completion) -> None:
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids,
                                                         skip_special_tokens=True)


# ---- the parameters ---------------------------------------------------------------------


def test_exactly_one_constraint_is_given():
    with pytest.raises(InvalidParameter, match="exactly one of json, regex, choice"):
        StructuredOutputsParams()
    with pytest.raises(InvalidParameter, match=r"got \['regex', 'choice'\]"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidParameter, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag='{"structures": []}')
    with pytest.raises(InvalidParameterType, match="non-empty list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(InvalidParameterType, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize(("constraint", "field"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json"),
    ({"json": "{not json"}, "json"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_anything_changes(
        llm, constraint, field):
    engine = llm.engine
    with pytest.raises(InvalidParameter) as error:
        engine.add_request("bad", "x", _params(**constraint))
    assert error.value.param == f"structured_outputs.{field}"
    assert f"structured_outputs.{field}" in str(error.value)
    assert not engine.has_unfinished_requests()
    # The engine serves the next request as if nothing happened.
    assert _completions(llm.generate(["a"], _params(choice=CHOICES)))[0].text in CHOICES


# ---- outputs keep to their grammars -----------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "anyOf"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "n": 3, "seed": 5}],
                         ids=["greedy", "sampled"])
def test_json_outputs_validate_against_their_schema(llm, schema, sampling):
    params = _params(json=schema, disable_any_whitespace=True, **sampling)
    for completion in _completions(llm.generate(PROMPTS, params)):
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
        _check_text_is_its_tokens(llm, completion)


def test_a_json_object_is_any_object(llm):
    params = _params(json_object=True, max_tokens=64, temperature=1.0, seed=3, n=2,
                     disable_any_whitespace=True)
    finished = [c for c in _completions(llm.generate(PROMPTS, params))
                if c.finish_reason == "stop"]
    assert finished  # a random model wanders, but some objects close
    for completion in finished:
        assert isinstance(json.loads(completion.text), dict)


def test_regular_expressions_choices_and_lark_grammars(llm):
    parser = lark.Lark(ARITHMETIC)
    sampled = {"temperature": 1.0, "n": 4, "seed": 11}
    regex = _completions(llm.generate(PROMPTS, _params(regex=REGEX, **sampled)))
    choices = _completions(llm.generate(PROMPTS, _params(choice=CHOICES, **sampled)))
    arithmetic = _completions(llm.generate(PROMPTS, _params(grammar=ARITHMETIC, **sampled)))
    for completion in regex + choices:
        assert completion.finish_reason == "stop"
        _check_text_is_its_tokens(llm, completion)
    assert all(re.fullmatch(REGEX, c.text) for c in regex)
    assert {c.text for c in choices} <= set(CHOICES)
    assert len({c.text for c in choices}) > 1  # samples differ, and end at different steps
    for completion in arithmetic:
        if completion.finish_reason == "stop":
            parser.parse(completion.text)
        else:  # cut at max_tokens: a prefix of some expression
            assert completion.finish_reason == "length"
            assert re.fullmatch(r"[0-9+\-()]*", completion.text)


def test_a_batch_mixes_constrained_and_free_requests(llm):
    requests = [_params(choice=CHOICES), SamplingParams(temperature=0.0, max_tokens=8),
                _params(json=SCHEMAS[0], disable_any_whitespace=True),
                SamplingParams(temperature=0.9, seed=2, max_tokens=8), _params(regex=REGEX)]
    alone = [_completions(llm.generate([PROMPTS[0]], p))[0].token_ids for p in requests]
    together = llm.generate([PROMPTS[0]] * len(requests), requests)
    assert [c.token_ids for c in _completions(together)] == alone


def test_a_grammar_that_min_tokens_leaves_no_token_ends_its_request_in_error(llm):
    # After "yes" the grammar allows only EOS, which min_tokens holds back.
    stuck = _params(choice=["yes"], min_tokens=5)
    outputs = llm.generate(["a", "a"], [stuck, _params(choice=CHOICES)])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].finish_reason == "stop"
    assert outputs[1].outputs[0].text in CHOICES


def test_max_tokens_cuts_an_output_as_a_valid_prefix(llm):
    completion = _completions(llm.generate(["a"], _params(regex="[ab]{20}", max_tokens=5)))[0]
    assert completion.finish_reason == "length"
    assert re.fullmatch("[ab]{5}", completion.text)


# ---- the other step modes ---------------------------------------------------------------


def _constrained_batch(llm):
    requests = [_params(json=schema, disable_any_whitespace=True) for schema in SCHEMAS]
    requests += [_params(regex=REGEX, temperature=1.0, seed=4, n=2),
                 _params(choice=CHOICES, temperature=0.7, seed=9),
                 SamplingParams(temperature=0.0, max_tokens=10)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(requests))]
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, requests)]


@pytest.mark.parametrize("options", [
    {"async_scheduling": True},
    {"num_decode_steps": 4},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 2}},
], ids=["async", "decode-loop", "ngram"])
def test_other_step_modes_give_the_same_outputs(loaded, llm, options):
    other = _llm(loaded, **options)
    assert _constrained_batch(other) == _constrained_batch(llm)
    fallbacks = other.engine.stats.summary()["mode_fallbacks"]
    if "speculative_config" in options:
        assert other.engine.stats.spec_decode.num_draft_tokens > 0
    else:
        mode = "async_scheduling" if "async_scheduling" in options else "decode_loop"
        assert fallbacks.get(f"{mode}/structured_output", 0) > 0


# ---- statistics and compilation ---------------------------------------------------------


def test_statistics_count_grammars_compiles_and_fills(loaded):
    llm = _llm(loaded)
    params = _params(json=SCHEMAS[1], disable_any_whitespace=True)
    llm.generate(PROMPTS[:2], params)
    llm.generate(PROMPTS[:1], _params(choice=CHOICES))
    stats = llm.engine.stats.summary()["structured_outputs"]
    assert stats["requests"] == 3
    assert (stats["grammar_cache_hits"], stats["grammar_cache_misses"]) == (1, 2)
    assert stats["grammar_compile_s"] > 0
    assert stats["mask_fill_steps"] > 0 and stats["mask_fill_s"] > 0
    assert stats["mask_fill_rows"] >= stats["mask_fill_steps"]


def test_metrics_export_the_counters_of_every_replica(loaded):
    llm = _llm(loaded)
    llm.generate(PROMPTS[:2], _params(choice=CHOICES))
    state = EngineState.total([llm.engine.state(), llm.engine.state()])
    families = {f.name: f for f in EngineCollector(
        types.SimpleNamespace(state=state)).collect()}
    one = llm.engine.stats.structured_outputs

    def total(name):
        return next(s.value for s in families[f"jpaged:{name}"].samples
                    if s.name.endswith("_total"))

    assert total("structured_output_requests") == 2 * one.requests == 4
    assert total("grammar_cache_misses") == 2 * one.cache_misses == 2
    assert total("token_mask_fill_rows") == 2 * one.fill_rows > 0
    assert total("token_mask_fill_seconds") == pytest.approx(2 * one.fill_seconds)


# ---- the command line -------------------------------------------------------------------


def test_the_command_line_takes_structured_outputs_as_json(tiny_llama_dir, capsys,
                                                           jpaged_logger_restored):
    prompts = ["the theme", "in the air"]
    choices = json.dumps({"choice": CHOICES})
    status = cli.main(["generate", "--model", str(tiny_llama_dir), "--raw", "--max-tokens", "8",
                       "--structured-outputs", choices, *prompts])
    out, err = capsys.readouterr()
    assert status == 0, err
    answers = out.splitlines()[1::2]  # "### prompt" lines, then each answer
    assert len(answers) == 2 and set(answers) <= set(CHOICES)

    status = cli.main(["generate", "--model", str(tiny_llama_dir), "--raw",
                       "--structured-outputs", '{"choices": ["a"]}', "x"])
    assert status != 0
    assert "--structured-outputs has no field 'choices'" in capsys.readouterr().err
