"""The prompt forms `LLM.generate` and `LLMEngine.add_request` accept, as in vLLM.

A prompt is text, token ids, or a dict: `{"prompt": text}` (a TextPrompt) or
`{"prompt_token_ids": [...]}` (a TokensPrompt), either with an optional
"cache_salt" that isolates the request's prefix-cache entries. Chat messages
are not prompts: `LLM.chat` turns them into token ids through the model's chat
template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import numpy as np


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text, if known: reported back in RequestOutput.prompt
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt

ACCEPTED = (
    "a prompt is a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [ints]} "
    "(either dict may add 'cache_salt'), or a list of those; chat messages go through LLM.chat"
)


@dataclass(frozen=True)
class ParsedPrompt:
    """One prompt, unpacked: text and/or token ids (at least one), and its cache salt."""

    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int | np.integer) and not isinstance(t, bool) for t in value
    )


def _parse_dict(prompt: dict) -> ParsedPrompt:
    if "role" in prompt:
        raise TypeError(f"got a chat message, not a prompt: {ACCEPTED}")
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown:
        raise TypeError(f"unknown prompt keys {sorted(unknown)}: {ACCEPTED}")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a str, got {type(salt).__name__}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"'prompt' must be a str, got {type(text).__name__}: {ACCEPTED}")
    if "prompt_token_ids" in prompt:
        token_ids = prompt["prompt_token_ids"]
        if not _is_token_ids(token_ids):
            raise TypeError(f"'prompt_token_ids' must be a list of ints: {ACCEPTED}")
        return ParsedPrompt(text, [int(t) for t in token_ids], salt)
    if text is None:
        raise TypeError(f"a prompt dict needs 'prompt' or 'prompt_token_ids': {ACCEPTED}")
    return ParsedPrompt(text, None, salt)


def parse_prompt(prompt: PromptType) -> ParsedPrompt:
    """Unpack one prompt; TypeError naming the accepted forms for anything else."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None, None)
    if isinstance(prompt, dict):
        return _parse_dict(prompt)
    if _is_token_ids(prompt):
        return ParsedPrompt(None, [int(t) for t in prompt], None)
    raise TypeError(f"{ACCEPTED}; got {type(prompt).__name__}")


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or a list of prompts -> a list of prompts.

    A list of ints is one prompt (token ids); any other list is a batch. Lists of
    chat messages are refused with a pointer to LLM.chat.
    """
    if isinstance(prompts, str | dict) or _is_token_ids(prompts) and prompts:
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"{ACCEPTED}; got {type(prompts).__name__}")
    for prompt in prompts:
        if isinstance(prompt, dict) and "role" in prompt:
            raise TypeError(f"got chat messages, not prompts: {ACCEPTED}")
    return list(prompts)
