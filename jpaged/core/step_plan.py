"""One step's plan while the scheduler builds it: the budget left, and what it holds.

A step has one token budget (max_num_batched_tokens) and at most max_num_seqs
sequence rows. `StepPlan.next_chunk` says how far a group's sequences can
advance within what is left (chunking a prefill when allowed); `add_decode` and
`add_chunk` record what the scheduler planned, and which groups draw a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jpaged.core.scheduler_output import GroupDraws
from jpaged.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class Chunk:
    """Sequences of one group that advance in a step, each by num_new_tokens tokens.

    num_rows: sequence slots the chunk takes from the step's max_num_seqs: one
    per sequence, or the group's max_seqs when it completes an unforked prompt
    (the sequences it becomes run in the next steps).

    A slotted dataclass: the scheduler makes one per group per step, and a
    NamedTuple costs twice as much to build.
    """

    seqs: list[Sequence]
    num_new_tokens: int
    num_rows: int


@dataclass
class StepPlan:
    """The budget left in the step being planned, and what it holds so far (as
    SchedulerOutput names them)."""

    tokens_left: int
    seqs_left: int
    enable_chunked_prefill: bool
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    groups: list[SequenceGroup] = field(default_factory=list)
    draws: list[GroupDraws] = field(default_factory=list)
    num_draws: int = 0
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)

    def next_chunk(self, group: SequenceGroup, seqs: list[Sequence]) -> Chunk | None:
        """Which of a group's sequences (`seqs`, all in one state) advance in this step,
        by how many tokens each.

        The sequences of a multi-sequence group sample in lockstep. Once each has
        only its last token uncomputed (decode) they take it together. Before
        that (a recomputed group), one lagging sequence at a time catches up and
        keeps its last token back, so the group still samples in one step.
        A group whose sequences carry proposals (speculative decoding) verifies all of
        them, each sequence's last token and its proposals, or waits: how far a
        sequence speculates never depends on the rest of the batch.
        None if the plan has no room for the chunk.
        """
        num_proposed = _num_proposed(seqs)
        if num_proposed:
            return self._speculate(seqs, 1 + num_proposed)
        if len(seqs) == 1:
            fanout = group.max_seqs if len(group.seqs) == 1 else 1
            return self._fit(seqs, seqs[0].num_uncomputed_tokens, fanout)
        lagging = next((seq for seq in seqs if seq.num_uncomputed_tokens > 1), None)
        if lagging is not None:
            return self._fit([lagging], lagging.num_uncomputed_tokens - 1)
        if len(seqs) <= min(self.seqs_left, self.tokens_left):
            return Chunk(seqs, 1, len(seqs))
        return None

    def _speculate(self, seqs: list[Sequence], num_tokens: int) -> Chunk | None:
        """Each sequence's last token and its proposals, all or nothing."""
        if len(seqs) <= self.seqs_left and len(seqs) * num_tokens <= self.tokens_left:
            return Chunk(seqs, num_tokens, len(seqs))
        return None

    def _fit(self, seqs: list[Sequence], num_tokens: int, fanout: int = 1) -> Chunk | None:
        """`num_tokens` for one sequence, cut to the budget if prefills may be chunked.

        A chunk that completes the sequence takes `fanout` sequence slots.
        """
        if self.seqs_left < 1 or self.tokens_left < 1:
            return None
        if num_tokens <= self.tokens_left:
            if fanout <= self.seqs_left:
                return Chunk(seqs, num_tokens, fanout)
            num_tokens -= 1  # all but the last token; it samples when the slots are free
            if num_tokens == 0 or not self.enable_chunked_prefill:
                return None
            return Chunk(seqs, num_tokens, 1)
        if self.enable_chunked_prefill:
            return Chunk(seqs, self.tokens_left, 1)
        return None

    def add_decode(self, group: SequenceGroup, seq: Sequence) -> None:
        """A lone sequence's next token: it draws."""
        self.draws.append((group, (len(self.scheduled),)))
        self.num_draws += 1
        self.scheduled.append((seq, 1))
        self.groups.append(group)
        self.tokens_left -= 1
        self.seqs_left -= 1

    def add_chunk(self, group: SequenceGroup, chunk: Chunk) -> None:
        """The chunk's sequences advance; a chunk that completes them makes the group draw."""
        seqs, num_new_tokens = chunk.seqs, chunk.num_new_tokens
        first_row = len(self.scheduled)
        for seq in seqs:
            self.scheduled.append((seq, num_new_tokens))
            self.groups.append(group)
        self.tokens_left -= num_new_tokens * len(seqs)
        self.seqs_left -= chunk.num_rows
        # Past the end: the last token and the proposals after it.
        if seqs[0].num_computed_tokens + num_new_tokens >= len(seqs[0]):
            rows = _draw_rows(group, first_row, len(seqs))
            self.draws.append((group, rows))
            self.num_draws += len(rows)


def _num_proposed(seqs: list[Sequence]) -> int:
    """Proposals each of `seqs` verifies in its next step: those of the first (a group's
    sequences carry as many each), once all have only their last token to compute."""
    proposals = seqs[0].spec_token_ids
    if proposals and all(seq.num_uncomputed_tokens == 1 for seq in seqs):
        return len(proposals)
    return 0


def _draw_rows(group: SequenceGroup, first_row: int, num_seqs: int) -> tuple[int, ...]:
    """The rows a group completing in this step draws from: a prompt that becomes n
    samples draws n times from its row, any other group once per sequence."""
    if group.forks_at_next_draw:
        return (first_row,) * group.max_seqs
    return tuple(range(first_row, first_row + num_seqs))
