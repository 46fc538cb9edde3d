"""What passes between the scheduler and the engine core in one step.

    plan = scheduler.schedule()                  SchedulerOutput: who runs, what is drawn
    ... the device runs the plan, the sampler draws ...
    stats = scheduler.update_from_output(plan, SampledTokens(...))

Host types only (numpy arrays at most): the simulator drives the scheduler with
them and no model at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from jpaged.memory.allocator import BlockOps
from jpaged.sequence import Sequence, SequenceGroup

# A group that draws tokens this step, and per draw the row of the step (an index
# into SchedulerOutput.scheduled) whose logits it draws from. A prompt that becomes
# n parallel samples draws n times from its one row; any other group draws once
# from the row of each of its running sequences, in the group's order.
GroupDraws = tuple[SequenceGroup, tuple[int, ...]]


class SchedulerStats(NamedTuple):
    """The queues as a step leaves them; num_preemptions counts since the start."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan.

    scheduled:  (sequence, number of new tokens) pairs, a group's sequences
                together; the new tokens are positions num_computed_tokens ..
                + n - 1 of the sequence.
    context_lens: each entry of `scheduled`'s tokens with KV once the step runs (those
                computed before it and its new ones): what its attention reads.
    groups:     the group of each entry of `scheduled`.
    draws:      the groups whose sequences all complete in this step, in the order
                of `scheduled`, with the rows their draws read (GroupDraws).
    num_draws:  the draws of all of them.
    block_ops:  block copies (copy-on-write) and swaps the device applies
                before the step.
    preempted:  groups preempted in this step (recompute or swap).
    ignored:    groups finished as FINISHED_IGNORED: they can never fit the pool.
    running:    the running groups once the step is planned (scheduled or not).
    stats:      the queues once the step is planned.
    adapter_loads: (slot, LoRA adapter) pairs the device loads before the step
                (jpaged.lora.slots).
    """

    scheduled: list[tuple[Sequence, int]]
    context_lens: list[int]
    groups: list[SequenceGroup]
    draws: list[GroupDraws]
    num_draws: int
    block_ops: BlockOps
    preempted: list[SequenceGroup]
    ignored: list[SequenceGroup]
    running: list[SequenceGroup]
    stats: SchedulerStats
    adapter_loads: list = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class BeamChoice:
    """The beams a beam-search group continues with, best first: beam i extends the
    group's running sequence parents[i] (an index in the group's order) by tokens[i].
    done: the search is over; the group's sequences finish as they are."""

    parents: list[int]
    tokens: list[int]
    done: bool = False


@dataclass(frozen=True)
class SampledTokens:
    """What the step drew, for `Scheduler.update_from_output`.

    tokens: int [D]   one token per draw, the draws of SchedulerOutput.draws in order.
    finite: bool [D]  whether the draw's logits were finite; a group with a
                      non-finite draw ends with FINISHED_ERROR.
    beams:  request id -> BeamChoice of each beam-search group that drew (its
            tokens are then unused).
    num_accepted: int [D]  proposals of the draw's sequence the verification accepted:
            the sequence takes them, then the draw's token (None: no proposals).
    runs:   for a step that decoded several tokens per sequence on the device (the
            decode loop), each draw's tokens in order; the step computed every one
            but the last, as it computes a step's input token, and `tokens` holds the
            last. A run with a non-finite draw stops before it (finite is then False).
    """

    tokens: np.ndarray
    finite: np.ndarray
    beams: dict[str, BeamChoice] = field(default_factory=dict)
    num_accepted: np.ndarray | None = None
    runs: list[list[int]] | None = None
