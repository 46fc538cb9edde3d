"""What proposes tokens for the target model to verify."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jpaged.sequence import Sequence

if TYPE_CHECKING:
    from jpaged.speculative.draft_model import Drafts, RowOf


class Proposer(Protocol):
    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens to follow seq (fewer, or none, where it has no guess),
        before the step is scheduled."""

    def draft(self, verifying: list[tuple[Sequence, RowOf]]) -> Drafts | None:
        """Once the step is scheduled, the proposals still to draw (a draft model's)
        and the distributions they were drawn from; None if propose gave them all."""
