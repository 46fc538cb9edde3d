"""GrammarCompiler: a request's structured-output parameters -> its `Grammar`.

Each constraint becomes an llguidance grammar (JSON schemas through llguidance's JSON
compiler, regular expressions, choices and Lark grammars through its Lark front end),
which compiles against the engine's tokenizer into a matcher. Compiled matchers are kept
in a bounded cache keyed by the constraint (`StructuredOutputsParams.key`); a request
gets a copy of one. The tokenizer is built from the tokenizer's JSON on the first
request that needs it: an engine without structured outputs never pays for it.
"""

from __future__ import annotations

import copy
import json
import time
from collections import OrderedDict

import llguidance

from jpaged.errors import InvalidParameter
from jpaged.sampling_params import StructuredOutputsParams
from jpaged.structured_output.counts import StructuredOutputCounts
from jpaged.structured_output.grammar import Grammar

# Compiled grammars kept for requests to come (least recently used leave first).
CACHE_SIZE = 256


def grammar_definition(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: `GrammarCompiler` does)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(params)
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=_json_options(params))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted
    except ValueError as error:
        raise InvalidParameter("structured_outputs.grammar",
                               f"structured_outputs.grammar does not compile: {error}") from None


def _schema(params: StructuredOutputsParams) -> dict:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise InvalidParameter("structured_outputs.json",
                                   f"structured_outputs.json is not valid JSON: {error}"
                                   ) from None
    if not isinstance(schema, dict):
        raise InvalidParameter("structured_outputs.json", "structured_outputs.json must be "
                               f"a JSON schema object, got {type(schema).__name__}")
    if params.disable_additional_properties:
        schema = _without_additional_properties(copy.deepcopy(schema))
    return schema


def _without_additional_properties(schema):
    """Every object schema that lists properties and does not say otherwise allows no
    properties beyond them. One that lists none stays open: closed, it would allow only
    the empty object (and a wrapper of an anyOf of objects, none of theirs)."""
    if isinstance(schema, list):
        return [_without_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _without_additional_properties(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.whitespace_pattern is not None:
        return {"whitespace_pattern": params.whitespace_pattern}
    return {"whitespace_flexible": not params.disable_any_whitespace}


class GrammarCompiler:
    """Compiles constraints against one tokenizer, and keeps what it compiled.

    tokenizer: the engine's (jpaged.model.tokenizer.Tokenizer: its `backend` is the
    tokenizers library's, whose JSON llguidance reads); vocab_size: the model's (its
    logits' width, which the masks cover); stop_token_ids: the engine's EOS tokens, which
    end a complete output; counts: where requests, compiles and cache hits are counted.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 counts: StructuredOutputCounts):
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self.counts = counts

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._source.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=self.stop_token_ids)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar at its start; InvalidParameter naming the field and llguidance's
        message if the constraint does not compile."""
        key = params.key
        matcher = self._cache.get(key)
        if matcher is None:
            started = time.perf_counter()
            matcher = self._compile(params)
            self.counts.compile_seconds += time.perf_counter() - started
            self.counts.cache_misses += 1
            self._cache[key] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self.counts.cache_hits += 1
            self._cache.move_to_end(key)
        self.counts.requests += 1
        return Grammar(matcher.deep_copy())

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        field = f"structured_outputs.{params.kind}"
        definition = grammar_definition(params)
        error = llguidance.LLMatcher.validate_grammar(definition, self.tokenizer)
        if error:
            raise InvalidParameter(field, f"{field} does not compile: {error.strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, definition, log_level=0)
        if matcher.is_error():
            raise InvalidParameter(field, f"{field} does not compile: {matcher.get_error()}")
        return matcher
