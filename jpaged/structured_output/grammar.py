"""Grammar: one sequence's place in its structured output's grammar."""

from __future__ import annotations

import llguidance


class Grammar:
    """An llguidance matcher that the sequence's tokens advance.

    Only the scheduler advances it (`accept`, with each token it appends); the step
    runner reads the tokens it allows next (jpaged.structured_output.token_masks).
    """

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fork(self) -> Grammar:
        """An independent copy in the same state (a new sample, a request's first sequence)."""
        return Grammar(self.matcher.deep_copy())

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (the matcher then
        stays in its error state, `error`)."""
        return self.matcher.consume_token(token)

    @property
    def is_complete(self) -> bool:
        """The output is complete: the grammar allows no token but a stop token after it."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
