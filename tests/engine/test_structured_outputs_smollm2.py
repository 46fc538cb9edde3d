"""Structured outputs on the default model (SmolLM2-135M-Instruct), against the
constraints' own validators: `jsonschema` for the schemas of
benchmarks.structured_outputs, `re.fullmatch`, membership of the choices and `lark`.
Greedy and sampled outputs must finish (finish reason "stop") and validate; a permissive
regular expression must leave greedy outputs as they are; n-gram speculation and async
scheduling must not change them.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from benchmarks.structured_outputs import SCHEMAS
from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.full

ENGINE = dict(max_model_len=1024, max_num_seqs=16, persistent_compilation_cache=False)
SAMPLED = dict(temperature=0.6, top_p=0.9, n=4, seed=17, repetition_penalty=1.15)
# Room for the longest of the schemas' instances (compact JSON), and more.
MAX_TOKENS = 256
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SENTIMENTS = ["positive", "negative", "neutral"]
ARITHMETIC = """
start: expr
expr: term (("+" | "-" | "*") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM("smollm2", loaded=smollm2, **ENGINE)


def _ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _schema_question(case) -> list[dict[str, str]]:
    return _ask(f"Reply with a JSON object only, no prose: {case.request}.")


def _json(schema: dict, max_tokens: int, **sampling) -> SamplingParams:
    # A 135M model greedily repeats itself inside unbounded strings ("Aeropex_Aeropex_...")
    # until max_tokens; a mild repetition penalty lets it close them.
    return SamplingParams(**({"temperature": 0.0, "max_tokens": max_tokens,
                              "repetition_penalty": 1.1} | sampling),
                          structured_outputs=StructuredOutputsParams(
                              json=schema, disable_any_whitespace=True))


def _finished(outputs) -> list[str]:
    completions = [c for o in outputs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in completions), [
        (c.text, c.finish_reason) for c in completions]
    return [c.text for c in completions]


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_outputs_validate_against_every_schema(llm, sampling):
    outputs = llm.chat([_schema_question(case) for case in SCHEMAS],
                       [_json(case.schema, MAX_TOKENS, **sampling) for case in SCHEMAS])
    for case, output in zip(SCHEMAS, outputs, strict=True):
        for text in _finished([output]):
            jsonschema.validate(json.loads(text), case.schema)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_regular_expressions_choices_and_grammars(llm, sampling):
    def params(**constraint):
        return SamplingParams(**({"temperature": 0.0, "max_tokens": 48} | sampling),
                              structured_outputs=StructuredOutputsParams(**constraint))

    questions = [_ask("When did the Second World War end? Answer with a date."),
                 _ask("What is the sentiment of 'I loved this film'?"),
                 _ask("Write an arithmetic expression whose value is 12.")]
    dates, sentiments, expressions = (_finished([o]) for o in llm.chat(questions, [
        params(regex=DATE), params(choice=SENTIMENTS), params(grammar=ARITHMETIC)]))
    assert all(re.fullmatch(DATE, text) for text in dates)
    assert set(sentiments) <= set(SENTIMENTS)
    parser = lark.Lark(ARITHMETIC)
    for text in expressions:
        parser.parse(text)


def test_a_permissive_regex_leaves_greedy_outputs_unchanged(llm):
    questions = [_ask(q) for q in ("Name three colours.", "What is the capital of France?",
                                   "Count from one to ten in words.",
                                   "Tell me about the moon.")]
    free = [o.outputs[0] for o in llm.chat(questions, SamplingParams(temperature=0.0,
                                                                     max_tokens=24))]
    # Outputs without a special token: no EOS inside the 24 tokens.
    text = [i for i, c in enumerate(free) if c.finish_reason == "length"]
    assert len(text) >= 2
    permissive = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=
                                StructuredOutputsParams(regex=r"(?s:.*)"))
    constrained = llm.chat([questions[i] for i in text], permissive)
    assert [o.outputs[0].token_ids for o in constrained] == [free[i].token_ids for i in text]


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    {"async_scheduling": True},
], ids=["ngram", "async"])
def test_other_step_modes_leave_outputs_unchanged(llm, smollm2, options):
    chosen = SCHEMAS[:4]
    questions = [_schema_question(case) for case in chosen]
    params = [_json(case.schema, MAX_TOKENS) for case in chosen]
    expected = [o.outputs[0].token_ids for o in llm.chat(questions, params)]
    other = LLM("smollm2", loaded=smollm2, **(ENGINE | options))
    assert [o.outputs[0].token_ids for o in other.chat(questions, params)] == expected
    if "speculative_config" in options:
        assert other.engine.stats.spec_decode.num_draft_tokens > 0
