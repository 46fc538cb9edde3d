"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Continuous batching as in vLLM. Requests (sequence groups) move between three
FCFS queues: waiting (not yet admitted, or preempted by recompute), running
(hold device blocks) and swapped (preempted to host blocks). Every step has one
token budget, `max_num_batched_tokens`, shared by decodes (one token each) and
prefill chunks, and at most `max_num_seqs` sequences. A step schedules, in order:

1. running groups, oldest first. When one cannot get the blocks for its new
   tokens, the newest running group is preempted (all of its sequences at once)
   until it can, by recompute (free its blocks; all of its tokens are computed
   again later) or by swap (move its blocks to host memory).
2. swapped groups, oldest first, if nothing was preempted in this step.
3. waiting groups, if nothing was preempted and nothing is swapped, while their
   blocks fit (the block manager keeps a watermark free).

The sequences of one group sample in lockstep, so parallel samples and beams
always grow together: see `Scheduler._next_chunk`.

The caller runs the step, calls `update_after_step`, appends a sampled token to
each sequence of the groups it returns, forks samples or beams with `fork`, and
ends sequences with `finish_seq` / `remove_seq` or requests with `abort`.
Blocks of finished or aborted sequences are freed at once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from jpaged.config import SchedulerConfig
from jpaged.memory.allocator import BlockOps
from jpaged.memory.block_manager import AllocStatus
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

# Module-level aliases: an enum attribute lookup costs as much as the status check itself.
_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED


class KVCacheManager(Protocol):
    """What the scheduler needs from a KV memory manager.

    jpaged's paged `BlockManager` implements all of it. The contiguous baselines
    in experiments/ serve one sequence per request and have no host blocks, so
    they leave out `fork` (called only by `Scheduler.fork`) and the swap methods
    (called only in swap mode, which needs host blocks).
    """

    num_host_blocks: int

    def can_allocate(self, group: SequenceGroup) -> AllocStatus: ...
    def allocate(self, group: SequenceGroup) -> None: ...
    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool: ...
    def has_decode_slot(self, seq: Sequence) -> bool: ...
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None: ...
    def fork(self, parent: Sequence, child: Sequence) -> None: ...
    def free(self, seq: Sequence) -> None: ...  # a no-op for a sequence it does not know
    def can_swap_out(self, group: SequenceGroup) -> bool: ...
    def swap_out(self, group: SequenceGroup) -> None: ...
    def can_swap_in(self, group: SequenceGroup) -> AllocStatus: ...
    def swap_in(self, group: SequenceGroup) -> None: ...
    def cache_computed_blocks(self, seq: Sequence) -> None: ...
    def end_step(self) -> BlockOps: ...


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan.

    scheduled:  (sequence, number of new tokens) pairs, a group's sequences
                together; the new tokens are positions num_computed_tokens ..
                + n - 1 of the sequence.
    block_ops:  block copies (copy-on-write) and swaps the device applies
                before the step.
    preempted:  groups preempted in this step (recompute or swap).
    ignored:    groups finished as FINISHED_IGNORED: they can never fit the pool.
    """

    scheduled: list[tuple[Sequence, int]]
    block_ops: BlockOps
    preempted: list[SequenceGroup]
    ignored: list[SequenceGroup]

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class _Chunk:
    """Sequences of one group that advance in a step, each by num_new_tokens tokens.

    num_rows: sequence slots the chunk takes from the step's max_num_seqs: one
    per sequence, or the group's num_samples when it completes an unforked
    prompt (each sample draws its first token in this step).

    A slotted dataclass: the scheduler makes one per group per step, and a
    NamedTuple costs twice as much to build.
    """

    seqs: list[Sequence]
    num_new_tokens: int
    num_rows: int


@dataclass
class _StepPlan:
    """The budget left in the step being scheduled, and what it holds so far."""

    tokens_left: int
    seqs_left: int
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)


class Scheduler:
    """FCFS continuous-batching scheduler over a KV cache manager."""

    def __init__(self, config: SchedulerConfig, block_manager: KVCacheManager):
        if config.preemption_mode == "swap" and block_manager.num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs host blocks, but num_host_blocks is 0")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self._unfinished: dict[str, SequenceGroup] = {}
        self._group_of_seq: dict[int, SequenceGroup] = {}
        self.num_preemptions = 0

    # Requests in and out.

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a new request: one WAITING sequence holding the prompt."""
        if group.request_id in self._unfinished:
            raise ValueError(f"request id {group.request_id!r} is already in the scheduler")
        if len(group.seqs) != 1 or group.seqs[0].status is not _WAITING:
            raise ValueError(
                f"a new request must hold exactly one WAITING sequence, got "
                f"{[s.status.name for s in group.seqs]}"
            )
        num_prompt = group.seqs[0].num_prompt_tokens
        if not 1 <= num_prompt <= self.config.max_model_len:
            raise ValueError(
                f"prompt of request {group.request_id!r} has {num_prompt} tokens; "
                f"it must have 1 to max_model_len={self.config.max_model_len}"
            )
        if group.seqs[0].seq_id in self._group_of_seq:
            raise ValueError(f"sequence id {group.seqs[0].seq_id} is already in use")
        if self.block_manager.can_allocate(group) is AllocStatus.NEVER:
            raise ValueError(
                f"prompt of request {group.request_id!r} ({num_prompt} tokens) needs more "
                "KV blocks than the whole pool holds"
            )
        self.waiting.append(group)
        self._unfinished[group.request_id] = group
        self._group_of_seq[group.seqs[0].seq_id] = group

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks; unknown or finished ids are ignored."""
        self._end(request_id, SequenceStatus.FINISHED_ABORTED)

    def fail(self, request_id: str) -> None:
        """End a request that met an error (FINISHED_ERROR) and free its blocks."""
        self._end(request_id, SequenceStatus.FINISHED_ERROR)

    def recompute(self, groups: list[SequenceGroup]) -> None:
        """Send running or swapped groups back to the waiting queue's front, in their
        order, to compute their tokens again: their KV is lost or suspect."""
        for group in reversed(groups):
            for queue in (self.running, self.swapped):
                if group in queue:
                    queue.remove(group)
            for seq in group.unfinished_seqs():
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.status = _WAITING
            self.waiting.appendleft(group)

    def _end(self, request_id: str, status: SequenceStatus) -> None:
        group = self._unfinished.pop(request_id, None)
        if group is None:
            return
        for queue in (self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        for seq in group.unfinished_seqs():
            self._release(seq, status)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a running sequence with a finished `status` and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        if seq.status is not _RUNNING:
            raise ValueError(
                f"only running sequences finish; sequence {seq.seq_id} is {seq.status.name}"
            )
        self._release(seq, status)

    def remove_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Drop a running sequence from its group (a pruned beam) and free its blocks."""
        if seq.status is not _RUNNING or seq not in group.seqs:
            raise ValueError(
                f"sequence {seq.seq_id} is not a running sequence of {group.request_id!r}"
            )
        if len(group.unfinished_seqs()) == 1:
            raise ValueError(f"cannot remove the last unfinished sequence of {group.request_id!r}")
        self.block_manager.free(seq)
        group.seqs.remove(seq)
        del self._group_of_seq[seq.seq_id]

    def fork(self, group: SequenceGroup, parent: Sequence, child_seq_id: int) -> Sequence:
        """A new running sequence of `group` with the parent's tokens, sharing its blocks."""
        if parent.status is not _RUNNING or parent not in group.seqs:
            raise ValueError(
                f"sequence {parent.seq_id} is not a running sequence of {group.request_id!r}"
            )
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if len(group.unfinished_seqs()) + 1 > limit:
            raise ValueError(
                f"request {group.request_id!r} would have more sequences than "
                f"min(max_num_seqs, max_num_batched_tokens)={limit}"
            )
        if child_seq_id in self._group_of_seq:
            raise ValueError(f"sequence id {child_seq_id} is already in use")
        child = dataclasses.replace(
            parent, seq_id=child_seq_id, output_token_ids=list(parent.output_token_ids)
        )
        self.block_manager.fork(parent, child)
        group.seqs.append(child)
        self._group_of_seq[child_seq_id] = group
        return child

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_running(self) -> int:
        return sum(not group.is_finished for group in self.running)

    # One step.

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running first, then swapped, then waiting groups."""
        plan = _StepPlan(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_swapped(plan)
            if not self.swapped:
                self._schedule_waiting(plan)
        return SchedulerOutput(
            scheduled=plan.scheduled,
            block_ops=self.block_manager.end_step(),
            preempted=plan.preempted,
            ignored=plan.ignored,
        )

    def update_after_step(self, output: SchedulerOutput) -> list[SequenceGroup]:
        """Record that the step computed its tokens; returns the groups that sample now.

        Every running sequence of a returned group has all its tokens computed
        and needs one new token from the caller. (The lockstep rule makes a
        group's sequences complete in the same step.)
        """
        ready: list[SequenceGroup] = []
        cache_computed_blocks = self.block_manager.cache_computed_blocks
        for seq, num_new_tokens in output.scheduled:
            if seq.status is not _RUNNING:
                continue  # aborted since the step was scheduled
            seq.num_computed_tokens += num_new_tokens
            cache_computed_blocks(seq)
            if seq.num_computed_tokens == len(seq):
                group = self._group_of_seq[seq.seq_id]
                if not ready or ready[-1] is not group:
                    ready.append(group)
        return ready

    def _schedule_running(self, plan: _StepPlan) -> None:
        queue, self.running = self.running, deque()
        while queue:
            group = queue.popleft()
            if self._schedule_decode(group, plan):
                self.running.append(group)
                continue
            seqs = group.seqs_with(_RUNNING)
            if not seqs:
                continue  # finished since the last step
            chunk = self._next_chunk(group, seqs, plan)
            if chunk is None:
                self.running.append(group)
                self.running.extend(queue)
                return
            if self._make_room(group, seqs, chunk, queue, plan):
                self.running.append(group)
                self._schedule_chunk(chunk, plan)

    def _schedule_decode(self, group: SequenceGroup, plan: _StepPlan) -> bool:
        """The common case, cheaply: a lone running sequence decodes into a slot it
        already owns.

        False, with nothing planned, when the general path must decide.
        """
        if len(group.seqs) != 1 or group.num_samples != 1:
            return False
        seq = group.seqs[0]
        if (
            seq.status is not _RUNNING
            or len(seq) - seq.num_computed_tokens != 1
            or plan.seqs_left < 1
            or plan.tokens_left < 1
            or not self.block_manager.has_decode_slot(seq)
        ):
            return False
        plan.scheduled.append((seq, 1))
        plan.tokens_left -= 1
        plan.seqs_left -= 1
        return True

    def _make_room(
        self,
        group: SequenceGroup,
        seqs: list[Sequence],
        chunk: _Chunk,
        queue: deque[SequenceGroup],
        plan: _StepPlan,
    ) -> bool:
        """Preempt the newest groups until the chunk gets its slots; False if `group` went."""
        advancing = _advancing_part(group, seqs, chunk)
        while not self.block_manager.can_append_slots(advancing, chunk.num_new_tokens):
            victim = _pop_newest_unfinished(queue)
            if victim is not None:
                self._preempt(victim, plan)
            elif self.running:
                self._preempt(group, plan)
                return False
            else:
                # It holds every device block in use and still cannot grow.
                self._ignore(group, plan)
                return False
        return True

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.seqs_with(_SWAPPED)
            chunk = self._next_chunk(group, seqs, plan)
            if chunk is None:
                return
            status = self.block_manager.can_swap_in(group)
            if status is AllocStatus.NEVER:
                # Waiting groups queue behind swapped ones: one that can never return
                # would stall them all.
                logger.warning(
                    "request %r: its %d swapped sequences need more device blocks than the "
                    "pool holds beside the watermark; it finishes", group.request_id, len(seqs))
                self.swapped.popleft()
                self._ignore(group, plan)
                continue
            if status is AllocStatus.LATER:
                return
            self.swapped.popleft()
            self.block_manager.swap_in(group)
            _set_status(seqs, _RUNNING)
            self.running.append(group)
            advancing = _advancing_part(group, seqs, chunk)
            if not self.block_manager.can_append_slots(advancing, chunk.num_new_tokens):
                return
            self._schedule_chunk(chunk, plan)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting:
            group = self.waiting[0]
            seqs = group.seqs_with(_WAITING)
            if self._next_chunk(group, seqs, plan) is None:
                return
            status = self.block_manager.can_allocate(group)
            if status is AllocStatus.LATER:
                return
            self.waiting.popleft()
            if status is AllocStatus.NEVER:
                self._ignore(group, plan)
                continue
            self.block_manager.allocate(group)
            _set_status(seqs, _RUNNING)
            self.running.append(group)
            # Prefix-cache hits computed some tokens: the chunk may have shrunk.
            chunk = self._next_chunk(group, seqs, plan)
            if chunk is None:
                return
            self._schedule_chunk(chunk, plan)

    def _next_chunk(
        self, group: SequenceGroup, seqs: list[Sequence], plan: _StepPlan
    ) -> _Chunk | None:
        """Which of a group's sequences (`seqs`, all in one state) advance in this step,
        by how many tokens each.

        The sequences of a multi-sequence group sample in lockstep. Once each has
        only its last token uncomputed (decode) they take it together. Before
        that (a recomputed group), one lagging sequence at a time catches up and
        keeps its last token back, so the group still samples in one step.
        None if the plan has no room for the chunk.
        """
        if len(seqs) == 1:
            fanout = group.num_samples if len(group.seqs) == 1 else 1
            return self._fit(seqs, seqs[0].num_uncomputed_tokens, plan, fanout)
        lagging = next((seq for seq in seqs if seq.num_uncomputed_tokens > 1), None)
        if lagging is not None:
            return self._fit([lagging], lagging.num_uncomputed_tokens - 1, plan)
        if len(seqs) <= min(plan.seqs_left, plan.tokens_left):
            return _Chunk(seqs, 1, len(seqs))
        return None

    def _fit(
        self, seqs: list[Sequence], num_tokens: int, plan: _StepPlan, fanout: int = 1
    ) -> _Chunk | None:
        """`num_tokens` for one sequence, cut to the budget if prefills may be chunked.

        A chunk that completes the sequence takes `fanout` sequence slots.
        """
        if plan.seqs_left < 1 or plan.tokens_left < 1:
            return None
        if num_tokens <= plan.tokens_left:
            if fanout <= plan.seqs_left:
                return _Chunk(seqs, num_tokens, fanout)
            num_tokens -= 1  # all but the last token; it samples when the slots are free
            if num_tokens == 0 or not self.config.enable_chunked_prefill:
                return None
            return _Chunk(seqs, num_tokens, 1)
        if self.config.enable_chunked_prefill:
            return _Chunk(seqs, plan.tokens_left, 1)
        return None

    def _schedule_chunk(self, chunk: _Chunk, plan: _StepPlan) -> None:
        seqs, num_new_tokens = chunk.seqs, chunk.num_new_tokens
        for seq in seqs:
            self.block_manager.append_slots(seq, num_new_tokens)
            plan.scheduled.append((seq, num_new_tokens))
        plan.tokens_left -= num_new_tokens * len(seqs)
        plan.seqs_left -= chunk.num_rows

    def _preempt(self, group: SequenceGroup, plan: _StepPlan) -> None:
        seqs = group.unfinished_seqs()
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(group):
            self.block_manager.swap_out(group)
            _set_status(seqs, _SWAPPED)
            self.swapped.appendleft(group)
        else:
            for seq in seqs:
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.status = _WAITING
            self.waiting.appendleft(group)
        plan.preempted.append(group)
        self.num_preemptions += 1

    def _ignore(self, group: SequenceGroup, plan: _StepPlan) -> None:
        for seq in group.unfinished_seqs():
            self._release(seq, SequenceStatus.FINISHED_IGNORED)
        plan.ignored.append(group)

    def _release(self, seq: Sequence, status: SequenceStatus) -> None:
        """Free what `seq` holds (blocks, memoised hashes) and end it; drop its finished group."""
        self.block_manager.free(seq)
        seq.status = status
        group = self._group_of_seq.pop(seq.seq_id)
        if group.is_finished:
            self._unfinished.pop(group.request_id, None)


def _advancing_part(group: SequenceGroup, seqs: list[Sequence], chunk: _Chunk) -> SequenceGroup:
    """`group` itself, or a view of the one sequence that advances alone, to ask for slots."""
    if len(chunk.seqs) == len(seqs):
        return group
    return SequenceGroup(group.request_id, chunk.seqs, group.arrival_time, group.cache_salt)


def _set_status(seqs: list[Sequence], status: SequenceStatus) -> None:
    for seq in seqs:
        seq.status = status


def _pop_newest_unfinished(queue: deque[SequenceGroup]) -> SequenceGroup | None:
    while queue:
        group = queue.pop()
        if group.seqs_with(_RUNNING):
            return group
    return None
