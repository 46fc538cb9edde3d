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
always grow together: see `StepPlan.next_chunk` (jpaged.core.step_plan).

One step is one round trip, as in vLLM v1:

    plan = scheduler.schedule()
    ... run plan.scheduled, draw a token for each of plan.draws ...
    scheduler.update_from_output(plan, sampled)

`update_from_output` is the only call back: it records the computed tokens,
appends the drawn ones (advancing their grammars), ends sequences at EOS, a stop token,
a complete grammar, max_tokens or max_model_len, forks a prompt's parallel samples,
applies the beams a beam search chose, and frees the blocks of whatever ended: every
drawn token is appended by `_append_one`, under the request's stop rule
(jpaged.core.stop_rule). With async scheduling it comes in two halves around the next
`schedule` (jpaged.core.async_scheduler). Between steps, callers end requests with `abort` and
sequences with `finish_seq` (a stop string the detokenized text revealed). Only the
scheduler, and the KV cache manager it calls, change sequences.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterable

from jpaged.config import SchedulerConfig
from jpaged.core.scheduler_output import (
    BeamChoice,
    SampledTokens,
    SchedulerOutput,
    SchedulerStats,
)
from jpaged.core.step_plan import Chunk, StepPlan
from jpaged.core.stop_rule import StopRule
from jpaged.errors import InvalidParameter
from jpaged.lora.slots import NoAdapters
from jpaged.memory.kv_cache_manager import AllocStatus, KVCacheManager
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

# Module-level aliases: an enum attribute lookup costs as much as the status check itself.
_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED
_STOPPED = SequenceStatus.FINISHED_STOPPED
_LENGTH = SequenceStatus.FINISHED_LENGTH
_ERROR = SequenceStatus.FINISHED_ERROR


class Scheduler:
    """FCFS continuous-batching scheduler over a KV cache manager."""

    def __init__(self, config: SchedulerConfig, block_manager: KVCacheManager,
                 adapters: NoAdapters | None = None):
        if config.preemption_mode == "swap" and block_manager.num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a host pool, but it has no blocks: "
                             "give swap_space (GiB of host memory)")
        self.config = config
        self.block_manager = block_manager
        # LoRA's adapter slots: a group holds one from admission until it ends or goes
        # back to waiting (jpaged.lora.slots).
        self.adapters = adapters or NoAdapters()
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self._unfinished: dict[str, SequenceGroup] = {}
        # Requests the schedule passes over until a running step's tokens are known
        # (filled by the async scheduler: those whose predicted tokens reach their length).
        self.held_back: set[str] = set()
        self._next_seq_id = 0
        self.num_preemptions = 0

    # Requests in and out.

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a new request: one WAITING sequence holding the prompt, which gets its
        seq_id here. Raises ValueError, changing nothing, for a request already queued
        or one that can never run (`check_request`)."""
        if group.request_id in self._unfinished:
            raise ValueError(f"request id {group.request_id!r} is already in the scheduler")
        self.check_request(group)
        group.stop_rule = StopRule.of(group, self.config.max_model_len)
        group.seqs[0].seq_id = self._new_seq_id()
        self.waiting.append(group)
        self._unfinished[group.request_id] = group

    def check_request(self, group: SequenceGroup) -> None:
        """ValueError for a request that can never run: a prompt of no tokens or over
        max_model_len, a beam search with no room for output, or one the KV pool can
        never hold."""
        if len(group.seqs) != 1 or group.seqs[0].status is not _WAITING:
            raise ValueError(
                f"a new request must hold exactly one WAITING sequence, got "
                f"{[s.status.name for s in group.seqs]}"
            )
        self._check_prompt(group)
        self.block_manager.check_fits(group)

    def _check_prompt(self, group: SequenceGroup) -> None:
        num_prompt, limit = group.seqs[0].num_prompt_tokens, self.config.max_model_len
        if num_prompt == 0:
            raise InvalidParameter("prompt", f"the prompt of request {group.request_id!r} is "
                                             f"empty: it must have 1 to max_model_len={limit} "
                                             "tokens")
        if num_prompt > limit:
            raise InvalidParameter("prompt", f"the prompt of request {group.request_id!r} has "
                                             f"{num_prompt} tokens, more than "
                                             f"max_model_len={limit}")
        if group.is_beam_search and num_prompt == limit:
            raise InvalidParameter("prompt", f"the prompt of request {group.request_id!r} has "
                                             f"{num_prompt} tokens: beam search needs room "
                                             f"for output within max_model_len={limit}")

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks; unknown or finished ids are ignored."""
        self._end(request_id, SequenceStatus.FINISHED_ABORTED)

    def fail(self, request_id: str) -> None:
        """End a request that met an error (FINISHED_ERROR) and free its blocks."""
        self._end(request_id, SequenceStatus.FINISHED_ERROR)

    def finish_seq(self, group: SequenceGroup, seq: Sequence,
                   status: SequenceStatus = _STOPPED, num_output_tokens: int | None = None
                   ) -> None:
        """End a running sequence of `group` (by default as stopped: a stop string in its
        text) and free its blocks; with num_output_tokens, keep only that many of its
        output tokens (a stop string inside a step's accepted proposals ends it there,
        even if a later token of them ended it already)."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        ended = seq.is_finished and num_output_tokens is not None
        if not (seq.status is _RUNNING or ended) or seq not in group.seqs:
            raise ValueError(
                f"sequence {seq.seq_id} is not a running sequence of {group.request_id!r}"
            )
        if num_output_tokens is not None:
            del seq.output_token_ids[num_output_tokens:]
        if ended:
            return
        self._release(group, seq, status)
        if group.is_finished:
            self.running.remove(group)

    def recompute(self, groups: list[SequenceGroup]) -> None:
        """Send running or swapped groups back to the waiting queue's front, in their
        order, to compute their tokens again: their KV is lost or suspect."""
        for group in reversed(groups):
            self._dequeue(group)
            self._requeue(group)

    def _requeue(self, group: SequenceGroup) -> None:
        """Free the group's blocks and adapter slot and put it at the waiting queue's
        front, every unfinished sequence to be computed again."""
        for seq in group.unfinished_seqs():
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.spec_token_ids = []
            seq.status = _WAITING
        self.adapters.release(group)
        self.waiting.appendleft(group)

    def _end(self, request_id: str, status: SequenceStatus) -> None:
        group = self._unfinished.get(request_id)
        if group is None:
            return
        self._dequeue(group)
        for seq in group.unfinished_seqs():
            self._release(group, seq, status)

    def _dequeue(self, group: SequenceGroup) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)

    def _release(self, group: SequenceGroup, seq: Sequence, status: SequenceStatus) -> None:
        """Free what `seq` holds (blocks, memoised hashes) and end it; forget its group
        once the group is finished (the caller takes it off its queue)."""
        self.block_manager.free(seq)
        seq.status = status
        if group.is_finished:
            self.adapters.release(group)
            self._unfinished.pop(group.request_id, None)

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
        """Running groups; a group leaves the queue in the call that finishes it."""
        return len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), len(self.swapped),
                              self.num_preemptions)

    # One step.

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running first, then swapped, then waiting groups."""
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                        self.config.enable_chunked_prefill)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_swapped(plan)
            if not self.swapped:
                self._schedule_waiting(plan)
        return SchedulerOutput(
            scheduled=plan.scheduled,
            context_lens=[seq.num_computed_tokens + n for seq, n in plan.scheduled],
            groups=plan.groups,
            draws=plan.draws,
            num_draws=plan.num_draws,
            block_ops=self.block_manager.end_step(),
            adapter_loads=self.adapters.take_loads(),
            preempted=plan.preempted,
            ignored=plan.ignored,
            running=list(self.running),
            stats=self.stats(),
        )

    def update_from_output(self, plan: SchedulerOutput, sampled: SampledTokens
                           ) -> SchedulerStats:
        """Apply what the step computed and drew; the queues it leaves.

        Every scheduled sequence has its new tokens computed (its full blocks
        offered to the prefix cache, the blocks its window left given back). Each
        drawing group then takes its tokens (`SampledTokens`): a prompt with n > 1
        forks its samples first, which share its blocks; a beam search takes its
        `BeamChoice`; a group with a non-finite draw ends with FINISHED_ERROR. A
        sequence ends (its blocks freed at once) at a stop token or EOS once it has
        min_tokens, at max_tokens and at max_model_len.
        """
        scheduled = plan.scheduled
        mark_computed = self.block_manager.mark_computed
        for seq, num_new_tokens in scheduled:
            seq.num_computed_tokens += num_new_tokens
            if not seq.spec_token_ids:  # a speculating one once it knows what it keeps
                mark_computed(seq)
        runs = sampled.runs
        tokens = sampled.tokens.tolist()
        num_accepted = None if sampled.num_accepted is None else sampled.num_accepted.tolist()
        all_finite = bool(sampled.finite.all())
        first, ended = 0, False
        for group, rows in plan.draws:
            end = first + len(rows)
            if runs is not None:
                ended |= self._append_runs(group, [scheduled[row][0] for row in rows],
                                           runs[first:end], sampled.finite[first:end].tolist())
            elif not (all_finite or sampled.finite[first:end].all()):
                self._end_non_finite(group)
                ended = True
            elif group.is_beam_search:
                ended |= self._continue_beams(group, sampled.beams[group.request_id])
            elif end - first == 1 and num_accepted is None:  # the common case
                ended |= self._append_one(group, scheduled[rows[0]][0], tokens[first])
            else:
                accepted = [0] * (end - first) if num_accepted is None else num_accepted[first:end]
                ended |= self._append_samples(group, [scheduled[row][0] for row in rows],
                                              tokens[first:end], accepted)
            first = end
        if ended:
            self.running = deque(group for group in self.running if not group.is_finished)
        return self.stats()

    def _end_non_finite(self, group: SequenceGroup) -> None:
        """End every unfinished sequence of a group whose logits were not finite."""
        if any(seq.grammar is not None for seq in group.seqs):
            logger.error("request %r: its grammar allows no token that its other "
                         "constraints (min_tokens holding its stop tokens back) "
                         "allow, or its logits were NaN or infinite; it finishes with "
                         "finish_reason 'error'", group.request_id)
        else:
            logger.error("request %r: NaN or infinite logits; it finishes with finish_reason "
                         "'error'", group.request_id)
        for seq in group.unfinished_seqs():
            self._release(group, seq, _ERROR)

    def _append_runs(self, group: SequenceGroup, seqs: list[Sequence], runs: list[list[int]],
                     finite: list[bool]) -> bool:
        """A decode loop's runs of tokens, one per sequence: each token after a run's first
        follows one the loop computed; a run cut by non-finite logits ends the group with
        FINISHED_ERROR after its finite tokens. Whether any ended."""
        ended = False
        for seq, run, run_finite in zip(seqs, runs, finite, strict=True):
            if group.is_finished:
                break
            seq.num_computed_tokens += max(len(run) - 1, 0)
            if self._append(group, seq, run):
                ended = True
            else:
                self.block_manager.mark_computed(seq)
            if not run_finite and not group.is_finished:
                self._end_non_finite(group)
                ended = True
        return ended

    def _append_samples(self, group: SequenceGroup, seqs: list[Sequence],
                        tokens: list[int], num_accepted: list[int]) -> bool:
        """Give seqs[i] its first num_accepted[i] proposals and tokens[i]; a prompt
        drawing n tokens (from its one row, so `seqs` is its sequence n times) first
        forks into n samples. Whether any ended."""
        if len(group.seqs) == 1 and len(tokens) > 1:
            parent = group.seqs[0]
            group.seqs += [self._fork(parent) for _ in range(len(tokens) - 1)]
            seqs = group.seqs
        ended = False
        for seq, token, accepted in zip(seqs, tokens, num_accepted, strict=True):
            if seq.spec_token_ids:
                ended |= self._accept(group, seq, accepted, token)
            else:
                ended |= self._append(group, seq, (token,))
        return ended

    def _accept(self, group: SequenceGroup, seq: Sequence, num_accepted: int,
                token: int) -> bool:
        """Verification's result for a speculating sequence: its first `num_accepted`
        proposals, then `token`. The rejected proposals leave num_computed_tokens; their
        slots stay in the table for the next proposals, and only accepted tokens reach
        the prefix cache. Whether it ended."""
        proposals, seq.spec_token_ids = seq.spec_token_ids, []
        seq.num_computed_tokens -= len(proposals) - num_accepted
        if self._append(group, seq, (*proposals[:num_accepted], token)):
            return True
        self.block_manager.mark_computed(seq)
        return False

    def _append(self, group: SequenceGroup, seq: Sequence, tokens: Iterable[int]) -> bool:
        """Append `tokens` to `seq` one by one under the group's stop rule, dropping what
        follows a stop; whether it ended (its blocks freed)."""
        return any(self._append_one(group, seq, token) for token in tokens)

    def _append_one(self, group: SequenceGroup, seq: Sequence, token: int) -> bool:
        output = seq.output_token_ids
        output.append(token)
        if seq.grammar is None:
            status = group.stop_rule.finish_status(token, len(output))
        else:
            status = self._grammar_status(group, seq, token)
        if status is None:
            return False
        self._release(group, seq, status)
        return True

    @staticmethod
    def _grammar_status(group: SequenceGroup, seq: Sequence, token: int
                        ) -> SequenceStatus | None:
        """The stop rule's verdict on `token` once the sequence's grammar took it: a
        complete grammar ends the sequence as a stop token would. A token the grammar
        refuses (its mask allowed it, so never) ends it with FINISHED_ERROR."""
        grammar = seq.grammar
        if not grammar.accept(token):
            logger.error("request %r: token %d breaks its grammar (%s); it finishes with "
                         "finish_reason 'error'", group.request_id, token, grammar.error)
            return _ERROR
        return group.stop_rule.finish_status(token, len(seq.output_token_ids),
                                             grammar.is_complete)

    def _continue_beams(self, group: SequenceGroup, choice: BeamChoice) -> bool:
        """The group's sequences become the chosen beams, in the choice's order: a parent
        chosen once goes on itself, one chosen k times forks k - 1 children first, one
        not chosen is dropped; then each takes its token. Once the search is done the
        beams finish as they are; beams that reach max_tokens or max_model_len finish
        too (all together: they have one length). Whether the beams ended."""
        beams = group.seqs
        if choice.done:
            for beam in beams:
                self._release(group, beam, _LENGTH)
            return True
        chosen = set(choice.parents)
        # Drop first: with share_blocks=False their blocks pay for the forks' copies.
        for index, beam in enumerate(beams):
            if index not in chosen:
                self.block_manager.free(beam)
        continued, seen = [], set()
        # Every fork before any append: children start from their parent's tokens.
        for parent in choice.parents:
            continued.append(self._fork(beams[parent]) if parent in seen else beams[parent])
            seen.add(parent)
        for beam, token in zip(continued, choice.tokens, strict=True):
            beam.output_token_ids.append(token)  # the search's choice: no stop token check
        group.seqs = continued
        if not group.stop_rule.reaches_length(len(continued[0].output_token_ids)):
            return False
        for beam in continued:
            self._release(group, beam, _LENGTH)
        return True

    def _fork(self, parent: Sequence) -> Sequence:
        """A new running sequence with the parent's tokens, sharing its blocks."""
        child = dataclasses.replace(parent, seq_id=self._new_seq_id(),
                                    output_token_ids=list(parent.output_token_ids),
                                    spec_token_ids=[],
                                    grammar=parent.grammar and parent.grammar.fork())
        self.block_manager.fork(parent, child)
        return child

    def _schedule_running(self, plan: StepPlan) -> None:
        queue, self.running = self.running, deque()
        held_back = self.held_back
        while queue:
            group = queue.popleft()
            if held_back and group.request_id in held_back:
                self.running.append(group)
                continue
            if self._schedule_decode(group, plan):
                self.running.append(group)
                continue
            seqs = group.seqs_with(_RUNNING)
            chunk = plan.next_chunk(group, seqs)
            if chunk is None:
                self.running.append(group)
                self.running.extend(queue)
                return
            if self._make_room(group, seqs, chunk, queue, plan):
                self.running.append(group)
                self._schedule_chunk(group, chunk, plan)

    def _schedule_decode(self, group: SequenceGroup, plan: StepPlan) -> bool:
        """The common case, cheaply: a lone running sequence decodes into a slot it
        already owns.

        False, with nothing planned, when the general path must decide.
        """
        if len(group.seqs) != 1 or group.max_seqs != 1:
            return False
        seq = group.seqs[0]
        if (
            seq.status is not _RUNNING
            or len(seq) - seq.num_computed_tokens != 1
            or seq.spec_token_ids
            or plan.seqs_left < 1
            or plan.tokens_left < 1
            or not self.block_manager.has_decode_slot(seq)
        ):
            return False
        plan.add_decode(group, seq)
        return True

    def _make_room(
        self,
        group: SequenceGroup,
        seqs: list[Sequence],
        chunk: Chunk,
        queue: deque[SequenceGroup],
        plan: StepPlan,
    ) -> bool:
        """Preempt the newest groups until the chunk gets its slots; False if `group` went."""
        advancing = _advancing_part(group, seqs, chunk)
        while not self.block_manager.can_append_slots(advancing, chunk.num_new_tokens):
            if queue:
                self._preempt(queue.pop(), plan)
            elif self.running:
                self._preempt(group, plan)
                return False
            else:
                # It holds every device block in use and still cannot grow.
                self._ignore(group, plan)
                return False
        return True

    def _schedule_swapped(self, plan: StepPlan) -> None:
        while self.swapped:
            group = self.swapped[0]
            if group.request_id in self.held_back:
                return
            seqs = group.seqs_with(_SWAPPED)
            chunk = plan.next_chunk(group, seqs)
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
            self._schedule_chunk(group, chunk, plan)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting groups in order while the step and the pool have room. A group
        whose adapter finds no free slot is skipped, keeping its place at the queue's
        front, and the groups behind it are admitted meanwhile (as in vLLM)."""
        skipped: list[SequenceGroup] = []
        try:
            self._admit_waiting(plan, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, plan: StepPlan, skipped: list[SequenceGroup]) -> None:
        while self.waiting:
            group = self.waiting[0]
            seqs = group.seqs_with(_WAITING)
            if plan.next_chunk(group, seqs) is None:
                return
            status = self.block_manager.can_allocate(group)
            if status is AllocStatus.LATER:
                return
            self.waiting.popleft()
            if status is AllocStatus.NEVER:
                self._ignore(group, plan)
                continue
            if not self.adapters.acquire(group):
                skipped.append(group)
                continue
            self.block_manager.allocate(group)
            if group.num_cached_tokens is None:  # a recomputed group keeps its first
                group.num_cached_tokens = seqs[0].num_computed_tokens
            _set_status(seqs, _RUNNING)
            self.running.append(group)
            # Prefix-cache hits computed some tokens: the chunk may have shrunk.
            chunk = plan.next_chunk(group, seqs)
            if chunk is None:
                return
            self._schedule_chunk(group, chunk, plan)

    def _schedule_chunk(self, group: SequenceGroup, chunk: Chunk, plan: StepPlan) -> None:
        for seq in chunk.seqs:
            self.block_manager.append_slots(seq, chunk.num_new_tokens)
        plan.add_chunk(group, chunk)

    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        seqs = group.unfinished_seqs()
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(group):
            self.block_manager.swap_out(group)
            _set_status(seqs, _SWAPPED)
            self.swapped.appendleft(group)
        else:
            self._requeue(group)
        plan.preempted.append(group)
        self.num_preemptions += 1

    def _ignore(self, group: SequenceGroup, plan: StepPlan) -> None:
        for seq in group.unfinished_seqs():
            self._release(group, seq, SequenceStatus.FINISHED_IGNORED)
        plan.ignored.append(group)


def _advancing_part(group: SequenceGroup, seqs: list[Sequence], chunk: Chunk) -> SequenceGroup:
    """`group` itself, or a view of the one sequence that advances alone, to ask for slots."""
    if len(chunk.seqs) == len(seqs):
        return group
    return dataclasses.replace(group, seqs=chunk.seqs)


def _set_status(seqs: list[Sequence], status: SequenceStatus) -> None:
    for seq in seqs:
        seq.status = status
