"""What proposes tokens for the target model to verify."""

from __future__ import annotations

from typing import Protocol

from jpaged.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens to follow seq (fewer, or none, where it has no guess),
        before the step is scheduled. A draft model's proposer draws them after
        scheduling (`DraftModelProposer.draft`)."""
