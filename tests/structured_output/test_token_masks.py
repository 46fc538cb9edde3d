"""Token masks against a brute-force oracle: a token is allowed after an output iff the
output and the token's text stay a prefix of some string of the language, and EOS iff
the output is one. The language here is (ab|cd)+, whose prefixes are the strings that
fully match ((ab|cd)*(a|c)?); tokens are the tiny byte-level tokenizer's."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jpaged.model.tokenizer import Tokenizer
from jpaged.sampling_params import StructuredOutputsParams
from jpaged.structured_output.compiler import GrammarCompiler
from jpaged.structured_output.counts import StructuredOutputCounts
from jpaged.structured_output.token_masks import TokenMasks

LANGUAGE = "(ab|cd)+"
PREFIXES = "(ab|cd)*(a|c)?"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer.from_directory(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,),
                           StructuredOutputCounts())


def allowed_after(tokenizer, output: str) -> np.ndarray:
    """bool [V]: the oracle's allowed tokens after `output`."""
    eos = tokenizer.eos_token_id
    allowed = np.zeros(len(tokenizer), bool)
    for token in range(len(tokenizer)):
        if token == eos:
            allowed[token] = bool(re.fullmatch(LANGUAGE, output))
        else:
            allowed[token] = bool(re.fullmatch(PREFIXES, output + tokenizer.decode([token])))
    return allowed


def unpack(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [R, ceil(V / 32)] -> bool [R, V], bit v % 32 of word v // 32 (little-endian)."""
    bits = np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def token(tokenizer, text: str) -> int:
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def test_each_row_allows_what_the_language_allows_after_its_proposals(tokenizer, compiler):
    grammar = compiler.compile(StructuredOutputsParams(regex=LANGUAGE))
    grammar.accept(token(tokenizer, "a"))
    counts = StructuredOutputCounts()
    masks = TokenMasks(len(tokenizer), counts)
    proposals = [token(tokenizer, t) for t in ("b", "c", "x", "d")]
    rows = unpack(masks.fill([(grammar, proposals)]), len(tokenizer))
    assert rows.shape == (5, len(tokenizer))
    for j, before in enumerate(["a", "ab", "abc"]):
        np.testing.assert_array_equal(rows[j], allowed_after(tokenizer, before), err_msg=before)
    # "x" leaves the language: the rows after it are never drawn from; they allow all.
    assert rows[3:].all()
    # Filling moved nothing: the grammar still stands after "a".
    again = unpack(masks.fill([(grammar, [])]), len(tokenizer))
    np.testing.assert_array_equal(again[0], allowed_after(tokenizer, "a"))
    assert (counts.fill_steps, counts.fill_rows) == (2, 6)


def test_rows_of_one_grammar_and_of_forks_fill_alike(tokenizer, compiler):
    """A prompt's n samples share their grammar until they fork: their rows copy one."""
    grammar = compiler.compile(StructuredOutputsParams(regex=LANGUAGE))
    fork = grammar.fork()
    fork.accept(token(tokenizer, "c"))
    masks = TokenMasks(len(tokenizer), StructuredOutputCounts())
    rows = unpack(masks.fill([(grammar, []), (fork, []), (grammar, [])]), len(tokenizer))
    np.testing.assert_array_equal(rows[0], allowed_after(tokenizer, ""))
    np.testing.assert_array_equal(rows[1], allowed_after(tokenizer, "c"))
    np.testing.assert_array_equal(rows[2], rows[0])


def test_a_complete_output_allows_only_eos_and_ends(tokenizer, compiler):
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab"]))
    assert not grammar.is_complete
    assert grammar.accept(token(tokenizer, "a")) and grammar.accept(token(tokenizer, "b"))
    assert grammar.is_complete
    row = unpack(TokenMasks(len(tokenizer), StructuredOutputCounts()).fill([(grammar, [])]),
                 len(tokenizer))[0]
    assert np.flatnonzero(row).tolist() == [tokenizer.eos_token_id]
    assert not grammar.fork().accept(token(tokenizer, "a"))


def test_compiled_grammars_are_cached_by_constraint(tokenizer):
    counts = StructuredOutputCounts()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), counts)
    first = compiler.compile(StructuredOutputsParams(json={"type": "boolean"}))
    second = compiler.compile(StructuredOutputsParams(json='{"type": "boolean"}'))
    compiler.compile(StructuredOutputsParams(json={"type": "boolean"},
                                             disable_any_whitespace=True))
    assert (counts.requests, counts.cache_hits, counts.cache_misses) == (3, 1, 2)
    # Each request gets its own state.
    assert first.accept(token(tokenizer, "t"))
    assert second.accept(token(tokenizer, "f"))


def test_disable_additional_properties_closes_objects_that_list_properties(tokenizer,
                                                                           compiler):
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(schema: dict, text: str, **options) -> bool:
        grammar = compiler.compile(StructuredOutputsParams(
            json=schema, disable_any_whitespace=True, **options))
        return all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts(closed, '{"a":1,"b":2}')  # JSON schema's default: open
    assert accepts(closed, '{"a":1}', disable_additional_properties=True)
    assert not accepts(closed, '{"a":1,"b":2}', disable_additional_properties=True)
    # An object schema listing no properties of its own stays open: a wrapper of objects.
    wrapper = {"type": "object", "anyOf": [closed]}
    assert accepts(wrapper, '{"a":1}', disable_additional_properties=True)
    assert not accepts(wrapper, '{"a":1,"b":2}', disable_additional_properties=True)
