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

import llguidance
import llguidance.numpy
import numpy as np

from jpaged.structured_output.counts import StructuredOutputCounts
from jpaged.structured_output.grammar import Grammar


class TokenMasks:
    """Fills masks of a batch's grammar rows, several rows at once (llguidance's threads);
    counts: where the steps, rows and time of the fills are counted."""

    def __init__(self, vocab_size: int, counts: StructuredOutputCounts):
        self.vocab_size = vocab_size
        self.counts = counts
        self._executor = llguidance.LLExecutor()

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
        self.counts.fill_steps += 1
        self.counts.fill_rows += num_rows
        self.counts.fill_seconds += time.perf_counter() - started
        return masks
