"""InputProcessor: a request as the user gives it -> an `EngineRequest` the core can run.

It parses vLLM's prompt forms (jpaged.inputs), tokenizes each prompt once,
checks every parameter against the engine's limits and compiles a structured output's
grammar (jpaged.structured_output), raising before anything is queued an error that
names the parameter (jpaged.errors). What only the
scheduler knows, a prompt's length against max_model_len and whether the KV
pool can ever hold it, the scheduler checks when the request is added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jpaged.engine.beam_search import BeamSearch
from jpaged.errors import InvalidParameter, InvalidParameterType
from jpaged.inputs import PromptType, parse_prompt
from jpaged.model.tokenizer import NO_CHAT_TEMPLATE
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.structured_output.compiler import GrammarCompiler
from jpaged.structured_output.grammar import Grammar

# Template variables a request's chat_template_kwargs may not set.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "chat_template", "tokenize",
                                         "add_generation_prompt", "continue_final_message"})


def _check_encodable(param: str, text: str) -> None:
    """ValueError naming `param` for text that UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidParameter(
            param, f"{param} cannot be encoded as UTF-8: {error.reason} "
                   f"{text[error.start]!r} at character {error.start}") from None


@dataclass(frozen=True)
class EngineRequest:
    """A parsed, tokenized and checked request.

    prompt: the prompt's text, if it came as text (reported back in RequestOutput).
    arrival_time: time.perf_counter() when it was processed.
    grammar: its structured output's grammar, compiled, at its start (each sequence of
    the request forks its own); None without one.
    adapter: its LoRA adapter (jpaged.lora.peft.LoRAAdapter), read and checked; None: the
    base model.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None
    arrival_time: float
    grammar: Grammar | None = None
    adapter: Any = None


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

    def __init__(self, tokenizer, limits: RequestLimits, eos_token_ids: tuple[int, ...],
                 grammars: GrammarCompiler):
        """eos_token_ids: the model's, which decide beam search's candidates per beam;
        grammars: what compiles structured outputs' grammars (over the same tokenizer)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

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
        grammar = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        return EngineRequest(request_id, parsed.text, token_ids, params, salt,
                             time.perf_counter(), grammar)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        """A prompt (text, token ids or a prompt dict) as token ids in the vocabulary;
        add_special_tokens: a text gets the BOS/EOS its model asks for."""
        parsed = parse_prompt(prompt)
        return self._token_ids(parsed.text, parsed.token_ids, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            add_special_tokens: bool = False,
                            chat_template: str | None = None) -> list[int]:
        """Chat messages through the model's chat template, as token ids.

        add_generation_prompt opens the assistant's turn after the messages;
        continue_final_message instead ends the prompt inside the last message, which
        must be the assistant's, for the model to continue; chat_template_kwargs are
        more template variables (not these two, nor the template itself);
        add_special_tokens: BOS/EOS as for a text prompt, besides what the template writes;
        chat_template: jinja2 source used instead of the model's (ValueError naming the
        remedies when neither exists).
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidParameterType(
                "messages",
                "a conversation must be a list of message dicts ({'role', 'content'})")
        self._check_continuation(messages, add_generation_prompt, continue_final_message)
        kwargs = dict(chat_template_kwargs or {})
        refused = sorted(set(kwargs) & RESERVED_TEMPLATE_VARIABLES)
        if refused:
            raise InvalidParameter(
                "chat_template_kwargs", f"chat_template_kwargs may not set {refused}: the "
                                        "request's own fields set them")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidParameter("messages", NO_CHAT_TEMPLATE)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            **kwargs)
        _check_encodable("messages", text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @staticmethod
    def _check_continuation(messages: list[dict[str, str]], add_generation_prompt: bool,
                            continue_final_message: bool) -> None:
        if not continue_final_message:
            return
        if add_generation_prompt:
            raise InvalidParameter(
                "continue_final_message", "continue_final_message and add_generation_prompt "
                                          "cannot both be true")
        role = messages[-1].get("role") if messages else None
        if role != "assistant":
            raise InvalidParameter(
                "continue_final_message", "continue_final_message continues the last "
                                          f"message, which must be the assistant's, not {role!r}")

    def _token_ids(self, text: str | None, token_ids: list[int] | None,
                   add_special_tokens: bool = True) -> list[int]:
        if token_ids is None:
            _check_encodable("prompt", text)
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self._check_vocabulary("prompt", token_ids)
        return token_ids

    def _check_vocabulary(self, name: str, token_ids) -> None:
        vocab_size = self.limits.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
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
