"""Incremental detokenization and stop strings, on the host, with vLLM's meanings.

`IncrementalDetokenizer` turns one sequence's output tokens into text as they
arrive. Each step decodes only a short window of recent tokens (vLLM's prefix
and read offsets): the window's tokens before the read offset were shown
already, so the new text is the window's text minus theirs. A byte-level BPE
token may hold part of a UTF-8 character, which decodes to U+FFFD; trailing
U+FFFD characters are held back until the character completes (or `finish`
releases them when the sequence ends), so no partial character is ever shown.

Stop strings, in the engine's loop for each new token:

    delta = detok.append(token)              # "" while a character is incomplete
    match = find_stop_string(detok.text, len(delta), params.stop,
                             params.include_stop_str_in_output)
    if match:                                # finished: output is text[:match.cut]
        text = detok.text[:match.cut]
    else:                                    # unfinished: hide what could become a stop
        text = detok.text[:len(detok.text) - held_back_length(detok.text, params.stop)]

`find_stop_string` only searches where the new characters could complete a
stop string, so the per-step cost does not grow with the output. When the
sequence ends for another reason (EOS, length), `finish()` releases the held-back
replacement characters, and the whole text is shown: nothing is held back for a
stop string that can no longer complete.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens that open the decoding window, as in vLLM: the first output token's text
# can depend on the tokens before it (a SentencePiece leading space is dropped at the start
# of a decode, a byte-level piece may continue a character).
INITIAL_CONTEXT_TOKENS = 5


class Decodes(Protocol):
    """What the detokenizer needs of a tokenizer: `decode`, as jpaged's `Tokenizer` and
    Hugging Face's tokenizers have it."""

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text as they arrive.

    Each `append` decodes a window of a few recent tokens, never the whole output,
    so N appends decode O(N) tokens (only a run of tokens whose text keeps ending in
    U+FFFD widens the window, until the character completes).

    `text` after k appends is the decode of the first k output tokens (in the
    context of the prompt's last tokens) without its trailing U+FFFD characters;
    after `finish` it is the whole decode. Decoding never cleans up tokenization
    spaces (" ." -> "."), since that rewrites text across window boundaries.
    """

    def __init__(self, tokenizer: Decodes, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window runs from vLLM's prefix offset to the newest token; its tokens before
        # _read are already shown, and _prefix_text (their decode) is cut off its text.
        start = max(len(prompt_token_ids) - INITIAL_CONTEXT_TOKENS, 0)
        self._window = [int(t) for t in prompt_token_ids[start:]]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        # Characters past _prefix_text already shown while an unfinished one is held back.
        self._shown = 0
        self._text = ""

    @property
    def text(self) -> str:
        """All output text made final so far."""
        return self._text

    def append(self, token_id: int) -> str:
        """Add one output token; returns the newly final text ("" while a character is
        incomplete, and for a skipped special token)."""
        self._window.append(int(token_id))
        window_text = self._decode(self._window)
        final = window_text.rstrip(REPLACEMENT_CHAR)
        delta = final[len(self._prefix_text) + self._shown:]
        # Move the offsets only once the window's text is complete and has grown: a skipped
        # special token adds no text, and dropping the tokens before it would lose context.
        if len(final) == len(window_text) and len(final) > len(self._prefix_text):
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._prefix_text = self._decode(self._window)
            self._shown = 0
        else:
            self._shown += len(delta)
        self._text += delta
        return delta

    def finish(self) -> str:
        """Release the held-back U+FFFD characters of bytes that never completed a
        character, as a full decode shows them. Call once, after the last `append`;
        returns the released text."""
        delta = self._decode(self._window)[len(self._prefix_text) + self._shown:]
        self._shown += len(delta)
        self._text += delta
        return delta

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy for a forked sample or beam (copies a few-token window)."""
        twin = copy.copy(self)
        twin._window = list(self._window)
        return twin

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopMatch(NamedTuple):
    """A stop string found in the output: the output text becomes text[:cut]."""

    cut: int
    stop: str


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> StopMatch | None:
    """The stop string that the last `num_new_chars` characters of `text` complete, if any.

    Only occurrences that end in the new characters are searched for (a stop string s
    from len(s) - 1 characters before them on), as earlier ones were checked before.
    When several complete, the earliest one wins, as if the text had arrived one
    character at a time: the one that ends first, and of those the one that starts
    first. The cut drops the stop string and everything after it, or with
    include_stop_str_in_output keeps the stop string and drops only what follows.
    """
    matches = []
    for s in stop:
        index = text.find(s, max(len(text) - num_new_chars - len(s) + 1, 0))
        if index >= 0:
            matches.append((index + len(s), index, s))
    if not matches:
        return None
    end, index, s = min(matches)
    return StopMatch(end if include_stop_str_in_output else index, s)


def held_back_length(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of unfinished output to hold back: the longest suffix
    of `text` that is a proper prefix of some stop string (it could still become one).
    Once the following characters rule that out the suffix shrinks and is released."""
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest
