"""Structured outputs: what a JSON schema costs a batch, where the token masks' time
goes, and what filling them while the model runs saves.

    python -m benchmarks.structured_outputs [--rounds N] [--max-tokens T] [--quick]
    python -m benchmarks.structured_outputs --plain-only [--rounds N]

SmolLM2-135M (float32, greedy, single steps) answers chat prompts that ask for a JSON
object, one of `SCHEMAS` per request (the schemas cycled over the batch).

1. throughput: the same requests with their schema (`disable_any_whitespace`) and
   without, at batch 1 (requests one after another) and batch 32 (all at once), on one
   warmed engine. A constrained request ends where its grammar is complete (or at
   max_tokens); its unconstrained twin runs ignore_eos to the token count the
   constrained one reached in the warm-up run, so both systems decode the same batch
   shapes step for step.
   Output tokens/s counts the tokens actually generated. The two systems alternate
   within each of --rounds rounds; reported: medians, each round's ratio and their
   range, the engine's fill time, and the share of constrained outputs that parse and
   validate against their schema.
2. fill: for each schema at each vocabulary (SmolLM2's 49,152 tokens and Gemma 3's
   262,144), llguidance's matcher walks a valid instance (compact JSON, the tokenizer's
   own tokens) one token at a time, `TokenMasks.fill` timed at every position: a first
   walk at 1 row (cold), then at 1 row and at 32 rows (independent copies, filled in one
   call, as a batch's are). Reported per row; at batch 32 also as a share of the
   SmolLM2 decode step measured in 3.
3. overlap: one decode step of 32 sequences (each with its own blocks, at --context
   tokens) composed from the step runner's parts: `ModelRunner.execute`, the 32
   grammars' masks (`TokenMasks.fill`, the schemas cycled over the rows, each advanced
   through its instance between steps), `sample_on_device` and `fetch`. Three orders,
   alternating: no grammar (the yardstick), masks filled in line before the model is
   dispatched, and filled after dispatch while the device runs the model (what
   `SingleStepRunner` does). Reported: median step times, the saving, and how long
   `execute` takes to return (JAX dispatch is asynchronous: it returns before the
   device is done).

--plain-only measures plain batch-32 requests (no grammar) alone, through APIs that
jpaged had before structured outputs, so that the same script can time a revision
without them. One JSON object last.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import time
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.report import new_report, progress, record_end_load
from jpaged import LLM, SamplingParams
from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.step_shapes import bucket
from jpaged.model.checkpoint import llama_config
from jpaged.model.config import LlamaConfig
from jpaged.model.default_model import default_model_directory, gemma3_gguf
from jpaged.model.gguf import read_gguf
from jpaged.model.llama import LlamaForCausalLM
from jpaged.model.loader import read_hf_config
from jpaged.model.tokenizer import Tokenizer
from jpaged.worker.sampling_rows import SamplingRow, sampling_tensors

# Structured outputs' own modules are imported where they are used: --plain-only runs on
# revisions of jpaged that lack them.

BATCHES = (1, 32)
TARGET_BATCH32_RATIO = 0.90  # constrained tokens/s over unconstrained, batch 32
MAX_MODEL_LEN = 512
# The quick check's model: a random Llama small enough to compile and run in seconds,
# with SmolLM2's vocabulary so that SmolLM2's tokenizer drives its grammars.
TINY_LLAMA = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


class SchemaCase(NamedTuple):
    """A JSON schema, what a prompt asks for, and a valid instance (its properties in
    the schema's order: llguidance emits them in that order)."""

    name: str
    request: str
    schema: dict
    instance: Any


def _object(properties: dict, required: list[str] | None = None) -> dict:
    """An object schema with no properties beyond its own (as strict structured outputs
    ask: otherwise a grammar lets a model add keys as long as it likes); every property
    required unless `required` says which."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


_STRING, _INTEGER, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_COUNTRIES = [
    "Argentina", "Australia", "Austria", "Belgium", "Brazil", "Canada", "Chile", "China",
    "Colombia", "Czechia", "Denmark", "Egypt", "Estonia", "Finland", "France", "Germany",
    "Ghana", "Greece", "Hungary", "Iceland", "India", "Indonesia", "Ireland", "Israel",
    "Italy", "Japan", "Kenya", "Latvia", "Lithuania", "Malaysia", "Mexico", "Morocco",
    "Nepal", "Netherlands", "New Zealand", "Nigeria", "Norway", "Pakistan", "Peru",
    "Philippines", "Poland", "Portugal", "Romania", "Senegal", "Singapore", "Slovakia",
    "South Africa", "South Korea", "Spain", "Sweden", "Switzerland", "Thailand", "Tunisia",
    "Turkey", "Uganda", "Ukraine", "United Kingdom", "United States", "Uruguay", "Vietnam"]
_CURRENCIES = [
    "ARS", "AUD", "BRL", "CAD", "CHF", "CLP", "CNY", "COP", "CZK", "DKK", "EGP", "EUR",
    "GBP", "GHS", "HUF", "IDR", "ILS", "INR", "ISK", "JPY", "KES", "KRW", "MAD", "MXN",
    "MYR", "NGN", "NOK", "NPR", "NZD", "PEN", "PHP", "PKR", "PLN", "RON", "SEK", "SGD",
    "THB", "TND", "TRY", "UAH", "UGX", "USD", "UYU", "VND", "XOF", "ZAR"]
_CIRCLE = _object({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}})
_RECTANGLE = _object({"kind": {"const": "rectangle"},
                      "width": {"type": "number", "minimum": 0},
                      "height": {"type": "number", "minimum": 0}})

SCHEMAS = [
    SchemaCase("flat_object", "a book with its title, author and year of publication",
               _object({"title": _STRING, "author": _STRING, "year": _INTEGER}),
               {"title": "The Hobbit", "author": "J. R. R. Tolkien", "year": 1937}),
    SchemaCase("nested_objects",
               "a customer with a name and a postal address (street, city, postcode, country)",
               _object({"name": _STRING, "address": _object(
                   {"street": _STRING, "city": _STRING, "postcode": _STRING,
                    "country": _STRING})}),
               {"name": "Ada Lovelace", "address": {"street": "12 St James's Square",
                                                    "city": "London", "postcode": "SW1Y 4JH",
                                                    "country": "United Kingdom"}}),
    SchemaCase("deep_nesting",
               "a company with one department, its team, and the team lead's name and email",
               _object({"company": _STRING, "department": _object({
                   "name": _STRING, "team": _object({"name": _STRING, "lead": _object({
                       "name": _STRING, "contact": _object({"email": _STRING})})})})}),
               {"company": "Acme", "department": {"name": "Research", "team": {
                   "name": "Robotics", "lead": {"name": "Grace Hopper",
                                                "contact": {"email": "grace@acme.com"}}}}}),
    SchemaCase("bounded_arrays", "a recipe with two to five ingredients and exactly three steps",
               _object({"name": _STRING,
                        "ingredients": {"type": "array", "items": _STRING,
                                        "minItems": 2, "maxItems": 5},
                        "steps": {"type": "array", "items": _STRING,
                                  "minItems": 3, "maxItems": 3}}),
               {"name": "Pancakes", "ingredients": ["flour", "milk", "eggs"],
                "steps": ["Whisk everything.", "Rest for ten minutes.", "Fry in butter."]}),
    SchemaCase("array_of_objects",
               "an order of one to four items, each with a product, a quantity and a unit price",
               _object({"order_id": _INTEGER, "items": {
                   "type": "array", "minItems": 1, "maxItems": 4, "items": _object({
                       "product": _STRING,
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                       "unit_price": {"type": "number", "minimum": 0}})}}),
               {"order_id": 1042, "items": [
                   {"product": "pencil", "quantity": 12, "unit_price": 0.35},
                   {"product": "notebook", "quantity": 3, "unit_price": 2.5}]}),
    SchemaCase("long_enums", "a country and its currency's ISO code",
               _object({"country": {"enum": _COUNTRIES}, "currency": {"enum": _CURRENCIES}}),
               {"country": "New Zealand", "currency": "NZD"}),
    SchemaCase("optional_fields",
               "a movie with its id and title and, where known, its year, rating, genre "
               "and whether it has a sequel",
               _object({"id": _INTEGER, "title": _STRING, "year": _INTEGER,
                        "rating": _NUMBER, "genre": _STRING,
                        "has_sequel": {"type": "boolean"}}, required=["id", "title"]),
               {"id": 7, "title": "Metropolis", "year": 1927, "genre": "science fiction"}),
    SchemaCase("string_patterns",
               "a product with a SKU like ABC-1234, a release date (YYYY-MM-DD) and a hex "
               "colour",
               _object({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "released": {"type": "string",
                                     "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "colour": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
               {"sku": "LMP-0042", "released": "2024-03-15", "colour": "#1e90ff"}),
    SchemaCase("bounded_numbers",
               "a weather reading: temperature in Celsius, humidity in percent, wind speed "
               "in km/h and pressure in hPa",
               _object({"temperature": {"type": "number", "minimum": -90, "maximum": 60},
                        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                        "wind_speed": {"type": "number", "minimum": 0, "maximum": 400},
                        "pressure": {"type": "number", "minimum": 870, "maximum": 1090}}),
               {"temperature": 21.5, "humidity": 64, "wind_speed": 12.0, "pressure": 1013.2}),
    SchemaCase("nested_any_of",
               "a drawing: a list of shapes, each a circle with a radius, a rectangle with a "
               "width and a height, or a group of circles and rectangles",
               _object({"title": _STRING, "shapes": {"type": "array", "items": {"anyOf": [
                   _CIRCLE, _RECTANGLE,
                   _object({"kind": {"const": "group"}, "children": {
                       "type": "array", "items": {"anyOf": [_CIRCLE, _RECTANGLE]}}})]}}}),
               {"title": "Sun", "shapes": [
                   {"kind": "circle", "radius": 5},
                   {"kind": "group", "children": [
                       {"kind": "rectangle", "width": 1, "height": 3},
                       {"kind": "circle", "radius": 0.5}]}]}),
    SchemaCase("nullable_and_const",
               "an API response: status ok, a null error, the page number and up to three "
               "results, each with an id and a score between 0 and 1",
               _object({"status": {"const": "ok"}, "error": {"type": ["string", "null"]},
                        "page": {"type": "integer", "minimum": 1},
                        "results": {"type": "array", "maxItems": 3, "items": _object(
                            {"id": _INTEGER,
                             "score": {"type": "number", "minimum": 0, "maximum": 1}})}}),
               {"status": "ok", "error": None, "page": 2,
                "results": [{"id": 31, "score": 0.92}, {"id": 8, "score": 0.4}]}),
    SchemaCase("string_lengths",
               "a user profile with a username of 3 to 16 characters, a bio of at most 80 "
               "characters and up to three short tags",
               _object({"username": {"type": "string", "minLength": 3, "maxLength": 16},
                        "bio": {"type": "string", "maxLength": 80},
                        "tags": {"type": "array", "maxItems": 3,
                                 "items": {"type": "string", "maxLength": 12}}}),
               {"username": "marie_c", "bio": "Physicist and chemist.",
                "tags": ["radium", "polonium"]}),
]


def compact_json(value: Any) -> str:
    """The JSON text a grammar without free whitespace produces."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}


# ---------------------------------------------------------------------------------------
# 1. Output tokens/s with and without schemas


def build_llm(model: str, max_num_seqs: int):
    """An engine of single steps (a grammar's step cannot loop on the device), warmed."""
    loaded = tiny_llama() if model == "tiny" else None
    llm = LLM(model, loaded=loaded, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
              num_decode_steps=1)
    progress(f"{model}: compiling every step shape")
    llm.engine.warmup()
    return llm


def tiny_llama():
    """(model, config, tokenizer): a random Llama with SmolLM2's tokenizer."""
    config = LlamaConfig.from_hf_config(TINY_LLAMA)
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return model, config, Tokenizer.from_directory(default_model_directory())


def chat_prompts(llm, cases: list[SchemaCase], count: int) -> list[list[int]]:
    """`count` prompts asking for JSON, the cases cycled."""
    engine = llm.engine
    return [engine.apply_chat_template([{"role": "user", "content": (
        f"Reply with a JSON object only, no prose: {case.request}.")}])
        for case in itertools.islice(itertools.cycle(cases), count)]


def generate(llm, prompts: list[list[int]], params: list, batch: int) -> dict:
    """Run the prompts `batch` at a time: output tokens/s of the tokens generated, and
    the outputs."""
    started = time.perf_counter()
    outputs = []
    for first in range(0, len(prompts), batch):
        outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[first:first + batch]],
                                params[first:first + batch], use_tqdm=False)
    elapsed = time.perf_counter() - started
    completions = [output.outputs[0] for output in outputs]
    counts = [len(c.token_ids) for c in completions]
    return {"output_tokens_per_s": sum(counts) / elapsed, "seconds": elapsed,
            "token_counts": counts, "completions": completions}


def constrained_params(cases: list[SchemaCase], count: int, max_tokens: int) -> list:

    from jpaged.sampling_params import StructuredOutputsParams

    return [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(
                               json=case.schema, disable_any_whitespace=True))
            for case in itertools.islice(itertools.cycle(cases), count)]


def plain_params(token_counts: list[int]) -> list:
    """Each request's unconstrained twin: the same number of tokens, whatever they are."""
    return [SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
            for count in token_counts]


def valid_outputs(completions, cases: list[SchemaCase]) -> int:
    """How many completions parse as JSON and validate against their case's schema."""
    import jsonschema  # the test extra's

    valid = 0
    for completion, case in zip(completions, itertools.cycle(cases)):
        try:
            jsonschema.validate(json.loads(completion.text), case.schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid


class Counters:
    """The engine's grammar work over a run: steps, mask fill seconds."""

    def __init__(self, llm):
        self.engine = llm.engine
        self.before = self._now()

    def _now(self) -> tuple[int, float]:
        stats = self.engine.stats
        return stats.num_steps, stats.structured_outputs.fill_seconds

    def delta(self) -> dict:
        (steps, fill), (steps0, fill0) = self._now(), self.before
        return {"steps": steps - steps0, "fill_seconds": fill - fill0}


def throughput(llm, cases: list[SchemaCase], batches: tuple[int, ...], rounds: int,
               max_tokens: int, batch1_requests: int) -> dict:
    """For each batch: both systems' tokens/s over the rounds, alternating."""
    results = {}
    for batch in batches:
        count = batch1_requests if batch == 1 else batch
        prompts = chat_prompts(llm, cases, count)
        schema = constrained_params(cases, count, max_tokens)
        progress(f"batch {batch}: warm-up runs")
        warm = generate(llm, prompts, schema, batch)  # compiles the grammars
        plain = plain_params(warm["token_counts"])
        generate(llm, prompts, plain, batch)
        systems = {"schema": schema, "plain": plain}
        runs = {name: [] for name in systems}
        for round_ in range(rounds):
            for name in systems if round_ % 2 == 0 else list(systems)[::-1]:
                progress(f"batch {batch}, round {round_ + 1}: {name}")
                counters = Counters(llm)
                run = generate(llm, prompts, systems[name], batch)
                runs[name].append(run | counters.delta())
        results[f"batch_{batch}"] = summarize_throughput(runs, cases)
    return results


def summarize_throughput(runs: dict[str, list[dict]], cases: list[SchemaCase]) -> dict:
    schema, plain = runs["schema"], runs["plain"]
    ratios = [s["output_tokens_per_s"] / p["output_tokens_per_s"]
              for s, p in zip(schema, plain, strict=True)]
    fill = [r["fill_seconds"] for r in schema]
    last = schema[-1]
    return {
        "schema_tokens_per_s": median_range([r["output_tokens_per_s"] for r in schema]),
        "plain_tokens_per_s": median_range([r["output_tokens_per_s"] for r in plain]),
        "schema_over_plain": median_range(ratios),
        "requests": len(last["token_counts"]),
        "mean_output_tokens": statistics.mean(last["token_counts"]),
        "same_token_counts": all(s["token_counts"] == p["token_counts"]
                                 for s, p in zip(schema, plain, strict=True)),
        "schema_finish_reasons": dict(sorted(collections.Counter(
            c.finish_reason for c in last["completions"]).items())),
        "schema_outputs_valid": valid_outputs(last["completions"], cases),
        "fill_ms_per_step": statistics.median(
            1e3 * r["fill_seconds"] / r["steps"] for r in schema),
        "fill_share_of_run": statistics.median(
            f / r["seconds"] for f, r in zip(fill, schema, strict=True)),
    }


# ---------------------------------------------------------------------------------------
# 2. Mask fill time per row, at two vocabularies


def grammar_compiler(vocabulary: str):
    """A GrammarCompiler over the named model's tokenizer (no weights read), and that
    tokenizer."""
    from jpaged.structured_output.compiler import GrammarCompiler
    from jpaged.structured_output.counts import StructuredOutputCounts

    if vocabulary == "gemma3":
        path = gemma3_gguf()
        hf_config, _, tokenizer = read_gguf(path)
        config = llama_config(path, hf_config)
    else:
        directory = default_model_directory()
        config, tokenizer = read_hf_config(directory), Tokenizer.from_directory(directory)
    compiler = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids,
                               StructuredOutputCounts())
    return compiler, tokenizer


def schema_grammar(compiler, case: SchemaCase):
    from jpaged.sampling_params import StructuredOutputsParams

    return compiler.compile(StructuredOutputsParams(json=case.schema,
                                                    disable_any_whitespace=True))


def instance_tokens(tokenizer, case: SchemaCase) -> list[int]:
    return tokenizer.encode(compact_json(case.instance), add_special_tokens=False)


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether a packed mask (int32 words, bit v % 32 of word v // 32) allows token."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def walk(compiler, tokenizer, case: SchemaCase, rows: int) -> dict:
    """Fill `rows` copies of the case's grammar at every position of its instance, one
    call per position: seconds per row at each position."""
    from jpaged.structured_output.counts import StructuredOutputCounts
    from jpaged.structured_output.token_masks import TokenMasks

    first = schema_grammar(compiler, case)
    grammars = [first] + [first.fork() for _ in range(rows - 1)]
    masks = TokenMasks(compiler.vocab_size, StructuredOutputCounts())
    seconds, allowed = [], True
    for token in instance_tokens(tokenizer, case):
        started = time.perf_counter()
        filled = masks.fill([(grammar, []) for grammar in grammars])
        seconds.append((time.perf_counter() - started) / rows)
        allowed &= allows(filled[0], token)
        for grammar in grammars:
            allowed &= grammar.accept(token)
    return {"seconds_per_row": seconds, "instance_allowed": allowed,
            "complete": first.matcher.is_accepting()}


def fill_times(vocabularies: list[str], cases: list[SchemaCase], batches: tuple[int, ...]
               ) -> dict:
    """Per vocabulary and schema: compile time, and fill microseconds per row (median,
    mean and max over the instance's positions) of a first walk at 1 row ("cold": it
    meets the grammar's lexer states first, and llguidance builds them as they are
    reached, for every copy of the compiled grammar), then of a walk at each batch."""
    results = {}
    for vocabulary in vocabularies:
        progress(f"fill: the {vocabulary} tokenizer")
        compiler, tokenizer = grammar_compiler(vocabulary)
        compiler.tokenizer  # built once, outside the timings  # noqa: B018
        walks = [("batch_1_cold", 1)] + [(f"batch_{batch}", batch) for batch in batches]
        rows = {}
        for case in cases:
            seconds = compiler.counts.compile_seconds
            schema_grammar(compiler, case)
            row = {"compile_ms": 1e3 * (compiler.counts.compile_seconds - seconds),
                   "instance_tokens": len(instance_tokens(tokenizer, case)),
                   "instance_walks": True}
            for label, batch in walks:
                walked = walk(compiler, tokenizer, case, batch)
                per_row = [1e6 * s for s in walked["seconds_per_row"]]
                row[f"{label}_us_per_row"] = {"median": statistics.median(per_row),
                                              "mean": statistics.mean(per_row),
                                              "max": max(per_row)}
                row["instance_walks"] &= walked["instance_allowed"] and walked["complete"]
            rows[case.name] = row
        results[vocabulary] = {"vocab_size": compiler.vocab_size, "schemas": rows}
    return results


# ---------------------------------------------------------------------------------------
# 3. Filling after dispatch against filling in line


def decode_inputs(runner, shapes, batch: int, context: int):
    """(input ids, AttentionMetadata) of a decode step of `batch` sequences, each at
    `context` tokens with blocks of its own."""
    block_size = runner.block_size
    per_seq = -(-context // block_size)
    width = bucket(per_seq, shapes.buckets.min_blocks_per_seq)
    tables = np.zeros((runner.groups.num_groups, batch, width), np.int32)
    tables[:, :, :per_seq] = 1 + np.arange(batch * per_seq).reshape(batch, per_seq)
    positions = np.full(batch, context - 1, np.int32)
    last_blocks = tables[:, np.arange(batch), positions // block_size]
    return np.zeros(batch, np.int32), AttentionMetadata(
        slot_mapping=(last_blocks * block_size + positions % block_size).astype(np.int32),
        positions=positions, block_tables=tables,
        context_lens=np.full(batch, context, np.int32),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        logits_indices=np.arange(batch, dtype=np.int32))


class GrammarRows:
    """One grammar per row, the cases cycled, each advanced through its instance one
    token per step and started afresh at its end."""

    def __init__(self, llm, cases: list[SchemaCase], batch: int):
        compiler = llm.engine.input_processor.grammars
        tokenizer = llm.get_tokenizer()
        self.cases = list(itertools.islice(itertools.cycle(cases), batch))
        self.starts = [schema_grammar(compiler, case) for case in self.cases]
        self.tokens = [instance_tokens(tokenizer, case) for case in self.cases]
        # Rows start at different places, as a batch's sequences are.
        self.places = [row % len(tokens) for row, tokens in enumerate(self.tokens)]
        self.grammars = [self._at(row, place) for row, place in enumerate(self.places)]

    def _at(self, row: int, place: int):
        grammar = self.starts[row].fork()
        for token in self.tokens[row][:place]:
            grammar.accept(token)
        return grammar

    def requests(self) -> list:
        return [(grammar, []) for grammar in self.grammars]

    def advance(self) -> None:
        for row, grammar in enumerate(self.grammars):
            self.places[row] += 1
            if self.places[row] == len(self.tokens[row]):
                self.places[row] = 0
                self.grammars[row] = self.starts[row].fork()
            else:
                grammar.accept(self.tokens[row][self.places[row] - 1])


class ComposedStep:
    """A decode step of the single-step runner, from its parts, in three orders."""

    def __init__(self, llm, cases: list[SchemaCase], batch: int, context: int):
        step_runner = llm.engine.core.step_runner
        self.runner, self.shapes = step_runner.model_runner, step_runner.shapes
        self.vocab_size, self.num_top = step_runner.vocab_size, step_runner.max_logprobs
        self.batch, self.context = batch, context
        self.inputs = decode_inputs(self.runner, self.shapes, batch, context)
        self.rows = GrammarRows(llm, cases, batch)
        self.token_masks = step_runner.token_masks
        self.last: dict[str, float] = {}

    def _execute(self):
        started = time.perf_counter()
        logits, _ = self.runner.execute(*self.inputs, decode_only=True, num_rows=self.batch)
        self.last["dispatch_ms"] = 1e3 * (time.perf_counter() - started)
        return logits

    def _fill(self):
        started = time.perf_counter()
        masks = self.token_masks.fill(self.rows.requests())
        self.last["fill_ms"] = 1e3 * (time.perf_counter() - started)
        return masks

    def _sample(self, logits, masks):
        rows = [SamplingRow.greedy(position=self.context - 1,
                                   allowed_tokens=None if masks is None else masks[i])
                for i in range(self.batch)]
        num_rows = self.shapes.sampler_rows(self.batch)
        tensors = sampling_tensors(rows, num_rows, self.vocab_size)
        row_array = np.zeros(num_rows, np.int32)
        row_array[: self.batch] = np.arange(self.batch)
        sampled = self.runner.sample_on_device(logits, row_array, tensors, self.num_top)
        return self.runner.fetch(sampled)

    def plain(self):
        return self._sample(self._execute(), None)

    def in_line(self):
        masks = self._fill()
        return self._sample(self._execute(), masks)

    def overlapped(self):
        logits = self._execute()
        return self._sample(logits, self._fill())


def overlap(llm, cases: list[SchemaCase], batch: int, context: int, steps: int) -> dict:
    """Median milliseconds (wall, and this process's CPU time: every thread's, XLA's
    included) of the three orders of a decode step, alternating, the grammars at the
    same places for both orders that fill, then advanced."""
    step = ComposedStep(llm, cases, batch, context)
    orders = {"plain": step.plain, "in_line": step.in_line, "overlapped": step.overlapped}
    for call in orders.values():  # compiles every variant
        call()
    wall = {name: [] for name in orders}
    cpu = {name: [] for name in orders}
    parts = {"fill_ms_in_line": [], "fill_ms_overlapped": [], "dispatch_ms_plain": []}
    for i in range(steps):
        for name in list(orders) if i % 2 == 0 else list(orders)[::-1]:
            started, cpu_started = time.perf_counter(), time.process_time()
            orders[name]()
            wall[name].append(1e3 * (time.perf_counter() - started))
            cpu[name].append(1e3 * (time.process_time() - cpu_started))
            if name == "plain":
                parts["dispatch_ms_plain"].append(step.last["dispatch_ms"])
            else:
                parts[f"fill_ms_{name}"].append(step.last["fill_ms"])
        step.rows.advance()
    medians = {f"{name}_step_ms": statistics.median(t) for name, t in wall.items()}
    saving = [a - b for a, b in zip(wall["in_line"], wall["overlapped"], strict=True)]
    return {
        "batch": batch, "grammar_rows": batch, "context": context, "steps": steps,
        **medians,
        **{f"{name}_step_cpu_ms": statistics.median(t) for name, t in cpu.items()},
        **{name: statistics.median(values) for name, values in parts.items()},
        "saving_ms": statistics.median(saving),
        "saving_ms_quartiles": statistics.quantiles(saving, n=4),
        "saving_share_of_in_line_step": statistics.median(saving) / medians["in_line_step_ms"],
        "overlapped_over_plain": medians["overlapped_step_ms"] / medians["plain_step_ms"],
    }


def fill_share(fill: dict, step_ms: float, batch: int) -> dict:
    """Each schema's fill time of a batch's rows over the decode step's time."""
    shares = {}
    for vocabulary, figures in fill.items():
        shares[vocabulary] = {
            name: row[f"batch_{batch}_us_per_row"]["mean"] * batch / 1e3 / step_ms
            for name, row in figures["schemas"].items()}
    return shares


# ---------------------------------------------------------------------------------------
# Plain batches alone (also for a revision without structured outputs)


def plain_only(model: str, batch: int, rounds: int, max_tokens: int) -> dict:
    llm = build_llm(model, batch)
    prompts = [{"prompt_token_ids": p} for p in chat_prompts(llm, SCHEMAS, batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params)
    rates = []
    for round_ in range(rounds):
        progress(f"plain batch {batch}, round {round_ + 1}")
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return {"batch": batch, "max_tokens": max_tokens,
            "output_tokens_per_s": median_range(rates)}


# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch1-requests", type=int, default=4,
                        help="requests run one after another at batch 1")
    parser.add_argument("--vocabularies", nargs="+", default=["smollm2", "gemma3"],
                        choices=["smollm2", "gemma3"])
    parser.add_argument("--overlap-steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=128,
                        help="tokens per sequence in the composed decode step")
    parser.add_argument("--plain-only", action="store_true",
                        help="plain batch-32 tokens/s alone (no grammar)")
    parser.add_argument("--quick", action="store_true",
                        help="every code path at tiny sizes on a random model (not a "
                        "measurement)")
    args = parser.parse_args(argv)
    args.batches, args.cases = BATCHES, SCHEMAS
    if args.quick:
        args.model, args.rounds, args.max_tokens, args.batch1_requests = "tiny", 1, 12, 1
        args.vocabularies, args.overlap_steps, args.context = ["smollm2"], 2, 32
        args.batches, args.cases = (1, 4), SCHEMAS[:3]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = new_report("benchmarks.structured_outputs", argv, peers=("llguidance",))
    batch = max(args.batches)
    settings = {"model": args.model, "dtype": "float32", "greedy": True, "rounds": args.rounds,
                "max_tokens": args.max_tokens, "batches": list(args.batches),
                "max_model_len": MAX_MODEL_LEN, "num_decode_steps": 1}
    if args.plain_only:
        report["settings"] = settings
        report["plain"] = plain_only(args.model, batch, args.rounds, args.max_tokens)
    else:
        report["settings"] = settings | {
            "batch1_requests": args.batch1_requests, "disable_any_whitespace": True,
            "schemas": [case.name for case in args.cases], "vocabularies": args.vocabularies,
            "overlap_steps": args.overlap_steps, "overlap_context": args.context}
        llm = build_llm(args.model, batch)
        report["throughput"] = throughput(llm, args.cases, args.batches, args.rounds,
                                          args.max_tokens, args.batch1_requests)
        progress("overlap: composed decode steps")
        report["overlap"] = overlap(llm, args.cases, batch, args.context, args.overlap_steps)
        report["fill"] = fill_times(args.vocabularies, args.cases, (1, batch))
        report["fill_share_of_step"] = fill_share(report["fill"],
                                                  report["overlap"]["plain_step_ms"], batch)
        ratio = report["throughput"][f"batch_{batch}"]["schema_over_plain"]["median"]
        report["targets"] = {f"batch{batch}_schema_over_plain_at_least_{TARGET_BATCH32_RATIO}": {
            "target": TARGET_BATCH32_RATIO, "measured": ratio,
            "met": ratio >= TARGET_BATCH32_RATIO}}
    record_end_load(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
