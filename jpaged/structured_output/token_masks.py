"""TokenMasks: the packed masks of the tokens each grammar row allows next.

A row that draws a sequence's token after its proposals `before` (speculative
decoding) allows what the sequence's grammar allows after `before`: llguidance
advances a scratch state through them and rolls it back, so the grammar itself only
ever advances with appended tokens. Rows after a proposal the grammar forbids allow
every token: verification rejects that proposal first, so their draws are discarded.
Masks are packed as jpaged.model.sampler describes (int32 [ceil(V / 32)] per row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

from jpaged.structured_output.grammar import Grammar


@dataclass
class FillStats:
    """steps: steps that filled masks; rows: masks filled; seconds: time spent filling."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0


class TokenMasks:
    """Fills masks of a batch's grammar rows, several rows at once (llguidance's threads)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()
        self.stats = FillStats()

    def fill(self, requests: list[tuple[Grammar, list[int]]]) -> np.ndarray:
        """int32 [R, ceil(V / 32)]: for each (grammar, proposals) request, the masks of
        its 1 + len(proposals) rows, one after another (R rows in all)."""
        started = time.perf_counter()
        num_rows = sum(1 + len(proposals) for _, proposals in requests)
        masks = llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)
        plain, drafted, copies = [], [], []
        first_row: dict[int, int] = {}
        row = 0
        for grammar, proposals in requests:
            span = 1 + len(proposals)
            # A matcher fills once per call: the rows of a prompt's n samples, which share
            # one until they fork, copy the first's.
            source = first_row.setdefault(id(grammar), row)
            if source != row:
                copies.append((source, row, span))
            elif proposals:
                drafted.append((grammar.matcher, row, list(proposals)))
            else:
                plain.append((grammar.matcher, row))
            row += span
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, masks)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, drafted, masks)
        for source, row, span in copies:
            masks[row: row + span] = masks[source: source + span]
        self.stats.steps += 1
        self.stats.rows += num_rows
        self.stats.seconds += time.perf_counter() - started
        return masks
