"""What proposes tokens for the target model to verify, behind one interface.

The engine core holds one proposer and calls it at three points of every step:

    propose(queues)       before scheduling: each sequence that decodes next gets its
                          proposals (seq.spec_token_ids), so the schedule reserves their
                          slots
    draft(verifying)      after the block operations: proposals that need their slots
                          to be drawn (a draft model's) are drawn now
    observe(ids, meta)    after the target model ran the step's inputs: a draft model
                          runs them too, so its cache holds what the target's does

and reads `runners`, the model runners of its own, which take every block operation,
are reallocated with the target's cache after a fault, and are warmed up with it. The
base class proposes nothing: it is the engine's proposer without speculative decoding.
`TokenProposer` holds the rule every real proposer shares (how many tokens a sequence
may have verified); its subclasses say which tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from jpaged.core.step_modes import Feature, ModeFallbacks
from jpaged.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    import jax

    from jpaged.core.attention_metadata import AttentionMetadata
    from jpaged.speculative.draft_model import Drafts
    from jpaged.worker.model_runner import ModelRunner
    from jpaged.worker.sampling_rows import SamplingRow

# The sampling row of a sequence's token after the given proposals.
RowOf = Callable[[list[int]], "SamplingRow"]


class Proposer:
    """Proposes nothing: no speculative decoding."""

    num_speculative_tokens = 0
    runners: tuple[ModelRunner, ...] = ()

    @property
    def speculates(self) -> bool:
        return self.num_speculative_tokens > 0

    def propose(self, queues: Iterable[Iterable[SequenceGroup]]) -> None:
        """Give each sequence of the groups in `queues` that decodes next its proposals."""

    def draft(self, verifying: list[tuple[Sequence, RowOf]]) -> Drafts | None:
        """Draw the proposals of `verifying` (each sequence with the maker of its sampling
        rows) that were reserved before their tokens were known. None: the proposals
        stand as proposed, each a certainty (a one-hot distribution)."""
        return None

    def observe(self, input_ids: jax.Array, metadata: AttentionMetadata, *,
                decode_only: bool) -> None:
        """The step's inputs, which the target model has just run."""


class TokenProposer(Proposer):
    """A proposer of up to num_speculative_tokens tokens per sequence and step.

    Beam searches get none (their beams are chosen on the host); the sequences of a
    group get as many as the fewest any of them has, so they grow together; a sequence
    gets none while its prompt is computed (where its last chunk ends depends on the
    batch), and no more than its stop rule leaves room for (`StopRule.max_proposals`).
    feature: the proposer's row of the step modes' table; fallbacks: where the beam
    searches that get no proposals are counted.
    """

    feature: Feature

    def __init__(self, num_speculative_tokens: int, fallbacks: ModeFallbacks | None = None):
        self.num_speculative_tokens = num_speculative_tokens
        self.fallbacks = fallbacks or ModeFallbacks()

    def propose(self, queues: Iterable[Iterable[SequenceGroup]]) -> None:
        for queue in queues:
            for group in queue:
                if group.is_beam_search:
                    self.fallbacks.note(self.feature, Feature.BEAM_SEARCH)
                    continue
                seqs = group.unfinished_seqs()
                proposals = [self._proposals(group, seq) for seq in seqs]
                num_proposals = min(map(len, proposals), default=0)
                for seq, proposed in zip(seqs, proposals, strict=True):
                    seq.spec_token_ids = proposed[:num_proposals]

    def _proposals(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return []
        limit = group.stop_rule.max_proposals(len(seq.output_token_ids),
                                              self.num_speculative_tokens)
        return self.propose_tokens(seq, limit) if limit > 0 else []

    def propose_tokens(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens to follow seq (fewer, or none, where it has no guess)."""
        raise NotImplementedError
