"""What proposes tokens for the target model to verify."""

from __future__ import annotations

from typing import Protocol

from jpaged.sequence import Sequence
from jpaged.speculative.config import SpeculativeConfig
from jpaged.speculative.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens to follow seq (fewer, or none, where it has no guess)."""


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The proposer of `config`; None without speculative decoding."""
    if config is None:
        return None
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
