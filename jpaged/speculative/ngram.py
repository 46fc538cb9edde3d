"""N-gram proposals (prompt lookup): what followed the sequence's last n tokens before.

For n from prompt_lookup_max down to prompt_lookup_min, the proposer looks for an
earlier occurrence of the sequence's last n tokens in its own prompt and output;
the first n for which one exists gives the proposal: the k tokens that followed
its latest occurrence with k tokens after it (the one most like what the sequence
does now: the passage being copied, the last round of a loop), or, if none has
that many, the fewer that followed its earliest.
Everything runs in numpy on the host: a comparison of every window per n.
"""

from __future__ import annotations

import numpy as np

from jpaged.core.step_modes import Feature, ModeFallbacks
from jpaged.sequence import Sequence
from jpaged.speculative.proposer import TokenProposer


def propose_ngram(token_ids: np.ndarray, num_tokens: int, lookup_min: int,
                  lookup_max: int) -> list[int]:
    """Up to num_tokens proposals after token_ids (int [L]); [] when no n-gram matches.

    Matches end before the last token, so every match has a continuation.
    """
    length = len(token_ids)
    if num_tokens < 1:
        return []
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = token_ids[length - n:]
        # Windows starting at 0 .. length - n - 1: all but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[:length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            whole = starts[starts + n + num_tokens <= length]
            follow = (whole[-1] if len(whole) else starts[0]) + n
            return token_ids[follow:follow + num_tokens].tolist()
    return []


class NgramProposer(TokenProposer):
    """Proposals from a sequence's own tokens (`propose_ngram`)."""

    feature = Feature.NGRAM

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int, *,
                 fallbacks: ModeFallbacks | None = None):
        super().__init__(num_speculative_tokens, fallbacks)
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose_tokens(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens to follow seq; [] when none of its n-grams recurs."""
        return propose_ngram(np.asarray(seq.token_ids, np.int32), num_tokens,
                             self.lookup_min, self.lookup_max)
