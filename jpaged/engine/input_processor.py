"""InputProcessor: a request as the user gives it -> an `EngineRequest` the core can run.

It parses vLLM's prompt forms (jpaged.inputs), tokenizes each prompt once and
checks every parameter against the engine's limits, raising before anything is
queued an error that names the parameter (jpaged.errors). What only the
scheduler knows, a prompt's length against max_model_len and whether the KV
pool can ever hold it, the scheduler checks when the request is added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jpaged.engine.beam_search import BeamSearch
from jpaged.errors import InvalidParameter, InvalidParameterType
from jpaged.inputs import PromptType, parse_prompt
from jpaged.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A parsed, tokenized and checked request.

    prompt: the prompt's text, if it came as text (reported back in RequestOutput).
    arrival_time: time.perf_counter() when it was processed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None
    arrival_time: float


@dataclass(frozen=True)
class RequestLimits:
    """What the engine's configuration allows a request.

    max_seqs:     sequences one request may have (n, beam_width): what one step runs.
    max_logprobs: top tokens per position (logprobs, prompt_logprobs, beam candidates).
    """

    vocab_size: int
    max_seqs: int
    max_logprobs: int


class InputProcessor:
    """Prompts to token ids, checked against the limits."""

    def __init__(self, tokenizer, limits: RequestLimits, eos_token_ids: tuple[int, ...]):
        """eos_token_ids: the model's, which decide beam search's candidates per beam."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = eos_token_ids

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams | BeamSearchParams | None = None,
                cache_salt: str | None = None) -> EngineRequest:
        """An EngineRequest; ValueError/TypeError naming the bad parameter, and a "cache_salt"
        in a prompt dict counts as the cache_salt argument."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise InvalidParameterType(
                "params", "params must be SamplingParams or BeamSearchParams, got "
                f"{type(params).__name__}")
        parsed = parse_prompt(prompt)
        token_ids = self._token_ids(parsed.text, parsed.token_ids)
        self._check(params)
        salt = cache_salt if cache_salt is not None else parsed.cache_salt
        return EngineRequest(request_id, parsed.text, token_ids, params, salt,
                             time.perf_counter())

    def tokenize(self, prompt: PromptType) -> list[int]:
        """A prompt (text, token ids or a prompt dict) as token ids in the vocabulary."""
        parsed = parse_prompt(prompt)
        return self._token_ids(parsed.text, parsed.token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages through the model's chat template, as token ids."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidParameterType(
                "messages",
                "a conversation must be a list of message dicts ({'role', 'content'})")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _token_ids(self, text: str | None, token_ids: list[int] | None) -> list[int]:
        if token_ids is None:
            return self.tokenizer.encode(text)
        vocab_size = self.limits.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameter(
                "prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        return token_ids

    def _check_vocabulary(self, name: str, token_ids) -> None:
        vocab_size = self.limits.vocab_size
        bad = [t for t in token_ids if t >= vocab_size]
        if bad:
            raise InvalidParameter(
                name, f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")

    def _check(self, params: SamplingParams | BeamSearchParams) -> None:
        limits = self.limits
        name, width = (("n", params.n) if isinstance(params, SamplingParams)
                       else ("beam_width", params.beam_width))
        if width > limits.max_seqs:
            raise InvalidParameter(
                name, f"{name}={width} is more than min(max_num_seqs, max_num_batched_tokens)"
                      f"={limits.max_seqs}")
        if isinstance(params, SamplingParams):
            self._check_vocabulary("logit_bias", params.logit_bias or ())
            self._check_vocabulary("stop_token_ids", params.stop_token_ids)
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > limits.max_logprobs:
                    raise InvalidParameter(
                        name, f"{name}={value} is more than max_logprobs={limits.max_logprobs}")
            return
        candidates = BeamSearch(params, 1, self.eos_token_ids, 1).num_candidates
        if candidates > limits.max_logprobs:
            raise InvalidParameter(
                "beam_width", f"beam_width={params.beam_width} with {params.scoring!r} scoring "
                              f"needs {candidates} candidates per beam, more than "
                              f"max_logprobs={limits.max_logprobs}")
