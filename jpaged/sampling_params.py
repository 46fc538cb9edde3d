"""How a request picks its tokens, with vLLM's names and meanings.

`SamplingParams` drives sampling (n parallel samples, filters, penalties, stop
conditions, log-probabilities, output kind, structured outputs); `BeamSearchParams`
drives `LLM.beam_search`. All check every field when built and raise a ValueError
or TypeError that names the field and its limit.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Literal

from jpaged.errors import InvalidParameter, InvalidParameterType

# Below this temperature a request is greedy, as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (vLLM's names).

    CUMULATIVE: everything generated so far, every step.
    DELTA:      only what is new since the last output (tokens, text, logprobs).
    FINAL_ONLY: nothing until the request finishes, then everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _check_int(name: str, value, low: int | None = None, high: int | None = None,
               param: str | None = None) -> None:
    """param: the parameter `name` is part of (default: name itself)."""
    param = param or name
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterType(param, f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise InvalidParameter(param, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidParameter(param, f"{name} must be <= {high}, got {value}")


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParameterType(name, f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidParameter(name, f"{name} must be finite, got {value}")
    return float(value)


def _stop_strings(stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in strings:
        if not isinstance(s, str):
            raise InvalidParameterType(
                "stop", f"stop must be a string or a list of strings, got {type(s).__name__}")
        if not s:
            raise InvalidParameter("stop", "stop strings must not be empty")
    return strings


def _token_ids(name: str, ids) -> tuple[int, ...]:
    ids = tuple(ids or ())
    for t in ids:
        _check_int(f"every entry of {name}", t, low=0, param=name)
    return ids


def _logit_bias(bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise InvalidParameterType(
            "logit_bias", f"logit_bias must be a dict of token id -> bias, got "
                          f"{type(bias).__name__}")
    checked = {}
    for token_id, value in bias.items():
        _check_int("every token id of logit_bias", token_id, low=0, param="logit_bias")
        value = _check_float("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidParameter(
                "logit_bias", f"logit_bias of token {token_id} must be in "
                              f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
        checked[token_id] = value
    return checked


# The constraints of StructuredOutputsParams, in vLLM's order; exactly one is given.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint every output token keeps to, with vLLM's names: exactly one of

    json:        a JSON schema (a dict, or its JSON text) the output validates under;
    regex:       a regular expression the whole output matches (Rust regex syntax);
    choice:      a list of strings, one of which the output is;
    grammar:     a Lark grammar (llguidance's dialect; GBNF is converted);
    json_object: True: any JSON object.

    disable_any_whitespace: JSON without whitespace between its tokens (", " and ": "
        become "," and ":"); otherwise JSON may hold any whitespace there.
    disable_additional_properties: object schemas that list properties and do not say
        whether they allow others allow none.
    whitespace_pattern: a regular expression for JSON's whitespace (instead of both
        defaults above).

    `structural_tag` (vLLM's tagged tool calls) is not supported: a ValueError says so.
    The grammar compiles when the request is added (jpaged.structured_output).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        if self.structural_tag is not None:
            raise InvalidParameter(
                "structured_outputs.structural_tag",
                "structural_tag is not supported: constrain a tool call with json (its "
                "parameters' schema) or tool_choice")
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS
                 if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(
                "structured_outputs", "structured_outputs takes exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidParameterType(f"structured_outputs.{name}",
                                           f"{name} must be a string, got "
                                           f"{type(value).__name__}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise InvalidParameterType("structured_outputs.json",
                                       "json must be a JSON schema (a dict or its JSON "
                                       f"text), got {type(self.json).__name__}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise InvalidParameterType("structured_outputs.choice",
                                           "choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint it is: one of STRUCTURED_OUTPUT_KINDS."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS
                    if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: its kind, its text and the JSON options."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return (self.kind, value, self.disable_any_whitespace,
                self.disable_additional_properties, self.whitespace_pattern)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request.

    n:                   independent samples of the prompt; its KV is computed once
                         and shared by all samples (copy-on-write).
    temperature:         below 1e-5 the request is greedy (and ignores the filters).
    top_p, top_k, min_p: filters, applied after temperature in the order
                         min_p, top_k, top_p; top_p renormalises over what min_p
                         and top_k kept. top_k 0 or -1, top_p 1, min_p 0 disable them.
    repetition_penalty:  > 1 discourages tokens of the prompt and output (a
                         positive logit is divided by it, a negative one multiplied).
    presence_penalty, frequency_penalty:
                         subtracted from a token's logit once if it occurs in the
                         output, and once per occurrence; in [-2, 2].
    seed:                any 64-bit integer (vLLM's range); a seeded request samples
                         the same tokens whatever else runs beside it (per sample:
                         seed, sample index, position). -1 means unseeded, as in vLLM.
    stop:                strings that end a sample; the text that could still
                         become one is held back until it cannot.
    stop_token_ids:      tokens that end a sample (EOS does too unless ignore_eos).
    max_tokens:          output tokens per sample (None: up to max_model_len).
    min_tokens:          EOS and stop_token_ids are suppressed before this many.
    logit_bias:          token id -> a bias in [-100, 100] added to its logit before
                         penalties and sampling (the engine checks the ids against
                         its vocabulary); log-probabilities stay the model's.
    logprobs:            per output token, the sampled token's log-probability and
                         the top `logprobs` (None: none; 0: only the sampled one).
    prompt_logprobs:     the same for every prompt token after the first.
    output_kind:         cumulative outputs, deltas, or only the final output.
    structured_outputs:  a grammar every sample keeps to (StructuredOutputsParams): the
                         sampler draws only tokens it allows, and a sample ends once it
                         is complete (finish reason "stop").
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = field(default_factory=tuple)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        _check_int("n", self.n, low=1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {value}")
        if _check_float("repetition_penalty", self.repetition_penalty) <= 0.0:
            raise InvalidParameter("repetition_penalty",
                                   f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if _check_float("temperature", self.temperature) < 0.0:
            raise InvalidParameter("temperature",
                                   f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < _check_float("top_p", self.top_p) <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        if not 0.0 <= _check_float("min_p", self.min_p) <= 1.0:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=-2**63, high=2**63 - 1)
            if self.seed == -1:
                object.__setattr__(self, "seed", None)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidParameterType(
                "output_kind",
                f"output_kind must be a RequestOutputKind, got {type(self.output_kind).__name__}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise InvalidParameterType(
                "structured_outputs", "structured_outputs must be StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids",
                                                              self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


BeamScoring = Literal["vllm", "transformers"]


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search over `beam_width` beams that share their common prefix's KV blocks.

    scoring "vllm" (the default, vLLM's `LLM.beam_search`):
        score = cumulative logprob / length ** length_penalty, where length counts
        the prompt and the output (a final EOS excluded); every candidate that
        ends in EOS is kept as a finished hypothesis; the search runs max_tokens
        steps and returns the best beam_width of finished and live beams.
    scoring "transformers" (`generate(num_beams=beam_width)`):
        length counts generated tokens only; an EOS candidate is accepted only
        from within the best beam_width candidates of its step; the search ends
        by transformers' `early_stopping` rule (True, False or "never").
    temperature: 0 scores with the model's log-probabilities; above 0, with the
        log-softmax of logits / temperature.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    scoring: BeamScoring = "vllm"
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self):
        _check_int("beam_width", self.beam_width, low=1)
        _check_int("max_tokens", self.max_tokens, low=1)
        if _check_float("temperature", self.temperature) < 0.0:
            raise InvalidParameter("temperature",
                                   f"temperature must be >= 0, got {self.temperature}")
        _check_float("length_penalty", self.length_penalty)
        if self.scoring not in ("vllm", "transformers"):
            raise InvalidParameter(
                "scoring", f"scoring must be 'vllm' or 'transformers', got {self.scoring!r}")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParameter(
                "early_stopping",
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
