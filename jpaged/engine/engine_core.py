"""EngineCore: one step of the serving loop, in one direction.

    proposer.propose(...)                    host: speculative decoding's proposals, if on
    plan = scheduler.schedule()              host: who runs, how many tokens each, who draws;
                                             block tables grown (copy-on-write, swaps)
    runner.apply_block_ops(plan.block_ops)   device: block copies and swaps
    build_model_input(plan.scheduled, ...)   host: padded int32 gather indices
    runner.execute(...)                      device: the jit-compiled model step
    runner.sample_on_device(...)             device: a token and log-probabilities per draw
                                             (and per proposal, accepted or replaced)
    runner.fetch(sampled)                    host waits for the tokens
    beam searches choose their beams         host (jpaged.engine.beam_search)
    scheduler.update_from_output(plan, ...)  host: the one call back: tokens appended,
                                             stops, forks, beams, blocks freed

`_dispatch` runs the step up to the sampler, `_finish` from the fetch on. Two
variations keep the host off the device's path (jpaged.engine.decode_loop, and
`_step_async`): with num_decode_steps > 1 a batch of decodes runs up to that many
steps in one device loop, and with async scheduling the next step is scheduled and
dispatched before this one's tokens are fetched, against a prediction of them
(`Scheduler.predict`, then `Scheduler.reconcile`).

The core knows token ids only; text is the output processor's. If a step
raises, its requests end with finish_reason "error" and the core recovers (a
lost KV cache is allocated again) so that every other request goes on. Two errors
are fatal (`is_fatal`): an interrupt, and a block id outside the KV pool
(`BlockIdOutOfRange`), whose tables or allocator state are corrupt; `LLMEngine.step`
raises them once the core has ended the step's requests.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import jax
import numpy as np

from jpaged.core.batch_builder import build_model_input
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import BeamChoice, SampledTokens, SchedulerOutput, SchedulerStats
from jpaged.core.step_shapes import StepShapes, bucket, padded_sizes
from jpaged.engine.beam_search import BeamSearch, Hypothesis
from jpaged.engine.decode_loop import LoopInput
from jpaged.engine.kv_managers import KVManager
from jpaged.engine.lockstep import Lockstep
from jpaged.engine.runner import ModelRunner
from jpaged.engine.stats import KVBlockCounts
from jpaged.memory.block_ids import BlockIdOutOfRange
from jpaged.model.sampler import (
    NEUTRAL_PENALTIES,
    SamplerOutput,
    SamplingRow,
    sampling_tensors,
)
from jpaged.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from jpaged.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceGroup, SequenceStatus
from jpaged.speculative.draft_model import DraftModelProposer, Drafts, RowOf, draft_rows
from jpaged.speculative.proposer import Proposer

logger = logging.getLogger("jpaged")

@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens a step's hidden states predict.

    entries: (group, position p, the logprob of prompt token p + 1, its rank, the top
    ids and their logprobs), each prompt position of a group once per computation.
    """

    entries: list[tuple[SequenceGroup, int, float, int, np.ndarray, np.ndarray]]


@dataclass
class CoreOutput:
    """What one step did, for the output processor.

    plan:     the step's SchedulerOutput.
    stats:    the scheduler's queues once the step is over.
    kv_blocks: the pool's blocks as the step runs (after scheduling, before sampling).
    block_usage: (request id, logical, physical) blocks of each running request as
              the step runs: its tables' total length, and the distinct blocks in them.
    sampled:  the sampler's numpy outputs; None if nothing drew.
    draw_rows: for each draw of plan.draws, in order, the rows of `sampled` holding the
              tokens it gave its sequence: one, or a verifying sequence's accepted
              proposals and the token after them.
    proposals: for each draw, (tokens proposed, tokens accepted); (0, 0) without
              speculative decoding.
    failed:   groups whose step failed (they finished with FINISHED_ERROR).
    beam_results: request id -> best hypotheses, for beam searches that ended.
    error:    the exception of a failed step.
    """

    plan: SchedulerOutput
    stats: SchedulerStats
    kv_blocks: KVBlockCounts
    block_usage: list[tuple[str, int, int]] = field(default_factory=list)
    sampled: SamplerOutput | None = None
    draw_rows: list[range] = field(default_factory=list)
    proposals: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs = field(default_factory=lambda: PromptLogprobs([]))
    failed: list[SequenceGroup] = field(default_factory=list)
    beam_results: dict[str, list[Hypothesis]] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class InFlight:
    """A step on the device whose tokens the host has not read.

    predictable: the next schedule may take its tokens as drawn (Scheduler.predict).
    sampled: the sampler's outputs on the device (None if nothing draws); draw_sizes:
    each draw's rows in them; sampler_rows: the row of each sequence's token, by id.
    """

    plan: SchedulerOutput
    output: CoreOutput
    predictable: bool
    sampled: SamplerOutput | None = None
    draw_sizes: list[int] = field(default_factory=list)
    sampler_rows: dict[int, int] = field(default_factory=dict)


def is_fatal(error: BaseException) -> bool:
    """Whether the engine must not go on after a step raised `error`: an interrupt, or a
    block id outside the KV pool (an invariant broken: going on would serve requests
    from corrupt block tables)."""
    return not isinstance(error, Exception) or isinstance(error, BlockIdOutOfRange)


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty, params.presence_penalty,
            params.frequency_penalty) != NEUTRAL_PENALTIES


class EngineCore:
    """The scheduler, its KV cache manager and the runner, stepped one way.

    max_logprobs: top tokens the sampler returns per row (logprobs, prompt
    logprobs and beam candidates read them); vocab_size: the model's.
    proposer: speculative decoding's, proposing up to shapes.num_speculative_tokens
    tokens per sequence and step (None: no speculative decoding).
    draft_runner: a draft model's runner (its proposer's): it runs every step's input
    after the target, so its cache holds what the target's does under the same blocks.
    lockstep: where the runner's mesh spans processes, the check that all of them
    planned the same step, made before it is dispatched (jpaged.engine.lockstep).
    """

    def __init__(self, scheduler: Scheduler, kv_manager: KVManager, runner: ModelRunner,
                 shapes: StepShapes, *, vocab_size: int, max_logprobs: int,
                 proposer: Proposer | DraftModelProposer | None = None,
                 draft_runner: ModelRunner | None = None, num_decode_steps: int = 1,
                 async_scheduling: bool = False, lockstep: Lockstep | None = None):
        self.scheduler = scheduler
        self.lockstep = lockstep
        self.num_decode_steps = num_decode_steps
        self.async_scheduling = async_scheduling
        self._in_flight: InFlight | None = None
        self.kv_manager = kv_manager
        self.runner = runner
        self.shapes = shapes
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.proposer = proposer
        self.draft_runner = draft_runner
        self.runners = [runner] if draft_runner is None else [runner, draft_runner]
        self.beam_searches: dict[str, BeamSearch] = {}

    def add_request(self, group: SequenceGroup, beam_search: BeamSearch | None) -> None:
        """Queue `group` (raises ValueError, changing nothing, if it can never run)."""
        self.scheduler.add_request(group)
        if beam_search is not None:
            self.beam_searches[group.request_id] = beam_search

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.beam_searches.pop(request_id, None)

    def step(self) -> list[CoreOutput]:
        """Schedule, run, sample and update once: the step's output. A step that raises
        (an interrupt too) ends its requests and returns its error, with the core
        consistent again. With async scheduling, the outputs of the steps whose results
        arrived during this call (`_step_async`)."""
        if self.async_scheduling:
            return self._step_async()
        if self.proposer is not None:
            self._propose()
        plan = self._schedule()
        output = CoreOutput(plan, plan.stats, self._kv_blocks())
        if plan.is_empty:
            return [output]
        output.block_usage = self._block_usage(plan)
        try:
            if self._loops(plan):
                self._run_loop(plan, output)
            else:
                self._finish(self._dispatch(plan, output), predicted=False)
        except BaseException as error:
            self._fail(plan, error, output)
        return [output]

    def _step_async(self) -> list[CoreOutput]:
        """One step of async scheduling: schedule step N + 1 while step N runs.

            predict N           its tokens taken as drawn (placeholders), if predictable
            schedule N + 1      against that prediction
            dispatch N + 1      on the device, fed N's tokens there, not through the host
            finish N            wait for N's tokens; placeholders replaced, stops checked

        A step whose tokens the next schedule must know (a fork into samples, beams,
        penalties, proposals) is finished before anything else is scheduled. -> the
        outputs of the steps finished (none on the first call), then this call's plan's
        if it is empty and reports something (requests it ignored) or nothing ran."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not previous.predictable:
            return [self._finished(previous, predicted=False)]
        if previous is not None:
            self.scheduler.predict(previous.plan)
        elif self.proposer is not None:
            self._propose()
        plan = self._schedule()
        output = CoreOutput(plan, plan.stats, self._kv_blocks())
        outputs = []
        if not plan.is_empty:
            output.block_usage = self._block_usage(plan)
            try:
                self._in_flight = self._dispatch(plan, output, previous)
            except BaseException as error:
                self._fail(plan, error, output)
                outputs.append(output)
        if previous is not None:
            outputs.insert(0, self._finished(previous, predicted=True))
        if plan.is_empty and (previous is None or plan.ignored):
            outputs.append(output)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        if self.lockstep is not None:
            self.lockstep.check(plan, self.kv_manager.block_tables)
        return plan

    def _predictable(self, plan: SchedulerOutput) -> bool:
        """Whether the next schedule may take `plan`'s tokens as drawn before they are
        known: every draw one sample's token, without penalties (the next draw's would
        count it), a fork into samples, a beam choice or proposals."""
        return self.proposer is None and all(
            not group.is_beam_search and not group.forks_at_next_draw
            and not _has_penalties(group.params) for group, _ in plan.draws)

    def _kv_blocks(self) -> KVBlockCounts:
        manager = self.kv_manager
        return KVBlockCounts(manager.num_device_blocks, manager.physical_blocks_used,
                             manager.logical_blocks_used, manager.group_blocks_used)

    def _block_usage(self, plan: SchedulerOutput) -> list[tuple[str, int, int]]:
        """(request id, logical blocks, distinct blocks) of each running request; entries
        released from a sliding window (the null block) count in neither."""
        block_tables, usage = self.kv_manager.block_tables, []
        for group in plan.running:
            tables = [table.array for seq in group.seqs
                      if seq.status is SequenceStatus.RUNNING for table in block_tables(seq)]
            logical = sum(int(np.count_nonzero(t)) for t in tables)
            physical = (logical if len(tables) == 1
                        else int(np.count_nonzero(np.unique(np.concatenate(tables)))))
            usage.append((group.request_id, logical, physical))
        return usage

    def _dispatch(self, plan: SchedulerOutput, output: CoreOutput,
                  previous: InFlight | None = None) -> InFlight:
        """Send the step to the device: block ops, inputs, the model and the sampler; the
        sampled tokens stay there. Tokens of `previous` (in flight) that the step's
        inputs hold as placeholders are read from its sampled tokens on the device."""
        for runner in self.runners:
            runner.apply_block_ops(plan.block_ops)
        # A draft model draws its proposals now that their slots exist; n-grams had theirs.
        drafts = None if self.draft_runner is None else self.proposer.draft(
            self._verifying(plan))
        model_input = build_model_input(plan.scheduled, self.kv_manager, self.shapes.buckets,
                                        plan.num_draws, self.shapes.num_speculative_tokens)
        input_ids = model_input.input_ids
        if previous is not None:
            input_ids = self._fed_input_ids(plan, model_input, previous)
        logits, hidden = self.runner.execute(input_ids, model_input.metadata,
                                             decode_only=model_input.decode_only,
                                             num_rows=model_input.num_rows)
        if self.draft_runner is not None:
            self.draft_runner.advance(input_ids, model_input.metadata,
                                      decode_only=model_input.decode_only)
        output.prompt_logprobs = self._prompt_logprobs(
            plan, model_input.metadata.query_start_loc, hidden)
        step = InFlight(plan, output, predictable=self._predictable(plan))
        if plan.draws:
            step.sampled, step.draw_sizes, step.sampler_rows = self._sample(
                plan, logits, model_input.proposal_rows, drafts)
        return step

    def _fed_input_ids(self, plan: SchedulerOutput, model_input, previous: InFlight):
        """The step's input ids with each placeholder (a decode's last token, drawn by
        `previous`) taken from previous's sampled tokens, on the device."""
        sources = np.full(len(model_input.input_ids), -1, np.int32)
        ends = model_input.metadata.query_start_loc[1: len(plan.scheduled) + 1] - 1
        for (seq, _), end in zip(plan.scheduled, ends.tolist(), strict=True):
            output = seq.output_token_ids
            if output and output[-1] == PLACEHOLDER_TOKEN:
                sources[end] = previous.sampler_rows[id(seq)]
        if (sources < 0).all():
            return model_input.input_ids
        return self.runner.feed_tokens(model_input.input_ids, previous.sampled.tokens, sources)

    def _finish(self, step: InFlight, predicted: bool) -> CoreOutput:
        """Read the step's tokens and hand them to the scheduler: `reconcile` for a
        predicted step, else `update_from_output` (beams chosen first)."""
        plan, output = step.plan, step.output
        tokens = SampledTokens(np.zeros(0, np.int32), np.ones(0, bool))
        if plan.draws:
            sampled = self.runner.fetch(step.sampled)
            tokens, output.draw_rows, output.proposals = _verified(sampled, step.draw_sizes)
            if not predicted:
                beams, output.beam_results = self._choose_beams(plan, sampled, output.draw_rows)
                tokens = dataclasses.replace(tokens, beams=beams)
            output.sampled = sampled
        if predicted:
            output.stats = self.scheduler.reconcile(plan, tokens)
        else:
            output.stats = self.scheduler.update_from_output(plan, tokens)
        return output

    def _finished(self, step: InFlight, predicted: bool) -> CoreOutput:
        """`_finish`, or `_fail` if reading the step's results raises."""
        try:
            return self._finish(step, predicted)
        except BaseException as error:
            self._fail(step.plan, error, step.output)
            return step.output

    # Decode steps on the device.

    @property
    def runs_decode_loops(self) -> bool:
        """num_decode_steps > 1 with one paged KV cache group and no speculative decoding
        (a sliding window's released blocks, Orca's reservations and proposals are the
        host's business every step)."""
        return (self.num_decode_steps > 1 and self.proposer is None
                and self.kv_manager.adopts_device_blocks)

    def _loops(self, plan: SchedulerOutput) -> bool:
        """Whether the step runs as a decode loop: the core runs them, and every
        scheduled sequence decodes its next token alone (no prompt chunk, no fork, no
        beam search: beams are chosen on the host each step)."""
        return (self.runs_decode_loops and plan.num_draws == len(plan.scheduled)
                and all(num_new_tokens == 1 and seq.num_uncomputed_tokens == 1
                        and not group.is_beam_search and not group.forks_at_next_draw
                        for (seq, num_new_tokens), group in zip(plan.scheduled, plan.groups,
                                                                strict=True)))

    def _run_loop(self, plan: SchedulerOutput, output: CoreOutput) -> None:
        self.runner.apply_block_ops(plan.block_ops)
        seqs = [seq for seq, _ in plan.scheduled]
        inputs = self._loop_input(plan)
        result = self.runner.decode_loop(self.kv_manager.state.device, inputs,
                                         num_steps=self.num_decode_steps,
                                         num_top=self.max_logprobs)
        # Writable copies: the host's transitions store into the pool in place.
        pool = jax.tree.map(np.array, result.pool)
        self.kv_manager.adopt_device_blocks(pool, seqs, result.block_tables)
        sampled, steps = result.sampled, self.num_decode_steps
        runs, finite, output.draw_rows = [], [], []
        for row, num_drawn in enumerate(result.num_drawn[: len(seqs)].tolist()):
            rows = range(row * steps, row * steps + num_drawn)
            row_finite = sampled.finite[rows.start:rows.stop]
            num_taken = int(np.argmin(row_finite)) if not row_finite.all() else num_drawn
            runs.append(sampled.tokens[rows.start:rows.start + num_taken].tolist())
            finite.append(num_taken == num_drawn)
            output.draw_rows.append(rows)
        output.sampled = sampled
        output.proposals = [(0, 0)] * len(seqs)
        tokens = SampledTokens(np.array([run[-1] if run else 0 for run in runs], np.int32),
                               np.array(finite), runs=runs)
        output.stats = self.scheduler.update_from_output(plan, tokens)

    def _loop_input(self, plan: SchedulerOutput) -> LoopInput:
        """The scheduled sequences as the loop's rows (padded as a decode step's)."""
        seqs = [seq for seq, _ in plan.scheduled]
        shapes, steps = self.shapes, self.num_decode_steps
        block_size = self.kv_manager.block_size
        num_rows = padded_sizes(len(seqs), len(seqs), shapes.buckets, decode_only=True)[1]
        reach = -(-(max(len(seq) for seq in seqs) + steps - 1) // block_size)
        num_blocks = bucket(min(reach, shapes.max_blocks_per_seq),
                            shapes.buckets.min_blocks_per_seq)
        tables = np.zeros((num_rows, num_blocks), np.int32)
        stop_mask = np.zeros((num_rows, self.vocab_size), bool)
        columns = np.zeros((6, num_rows), np.int32)  # the int32 [B] columns below
        max_model_len = self.scheduler.config.max_model_len
        sampling_rows = []
        for group, rows in plan.draws:
            for index, row in _sample_indices(group, plan, rows):
                seq = plan.scheduled[row][0]
                table = self.kv_manager.block_table(seq).array
                tables[row, : len(table)] = table
                num_output = len(seq.output_token_ids)
                max_output = max_model_len - seq.num_prompt_tokens
                if group.max_tokens is not None:
                    max_output = min(max_output, group.max_tokens)
                columns[:, row] = (seq.token_id(len(seq) - 1), len(seq) - 1, 1, num_output,
                                   max_output, group.min_tokens)
                stop_mask[row, list(group.stop_token_ids)] = True
                sampling_rows.append((row, dataclasses.replace(
                    self._sampling_row(group, seq, index), suppressed_token_ids=())))
        sampling_rows = [r for _, r in sorted(sampling_rows, key=lambda item: item[0])]
        input_ids, positions, live, num_output, max_output, min_tokens = columns
        return LoopInput(
            input_ids=input_ids, positions=positions, block_tables=tables,
            live=live.astype(bool), num_output=num_output, max_output=max_output,
            min_tokens=min_tokens, stop_mask=stop_mask,
            sampling=sampling_tensors(sampling_rows, num_rows, self.vocab_size, dense=True),
            yield_on_finish=np.bool_(bool(self.scheduler.waiting or self.scheduler.swapped)))

    # Speculative decoding's proposals.

    def _propose(self) -> None:
        """Proposals for every sequence that decodes next (running or swapped): as many
        for each sequence of a group (the fewest any of them has), none for beams."""
        k = self.shapes.num_speculative_tokens
        for queue in (self.scheduler.running, self.scheduler.swapped):
            for group in queue:
                seqs = group.unfinished_seqs()
                if group.is_beam_search:
                    continue
                proposals = [self._proposals(group, seq, k) for seq in seqs]
                num_proposals = min(map(len, proposals), default=0)
                for seq, proposed in zip(seqs, proposals, strict=True):
                    seq.spec_token_ids = proposed[:num_proposals]

    def _proposals(self, group: SequenceGroup, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to follow seq if it decodes next, within max_model_len and
        leaving its last max_tokens token to the target model. A prompt's first token is
        drawn without proposals: where its last chunk ends depends on the batch."""
        if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return []
        limit = min(k, self.scheduler.config.max_model_len - len(seq))
        if group.max_tokens is not None:
            limit = min(limit, group.max_tokens - len(seq.output_token_ids) - 1)
        return self.proposer.propose(seq, limit) if limit > 0 else []

    def _verifying(self, plan: SchedulerOutput) -> list[tuple[Sequence, RowOf]]:
        """The sequences this step verifies proposals of, each with the maker of its
        sampling rows."""
        return [(plan.scheduled[row][0],
                 functools.partial(self._sampling_row, group, plan.scheduled[row][0], index))
                for group, rows in plan.draws
                for index, row in _sample_indices(group, plan, rows)
                if plan.scheduled[row][0].spec_token_ids]

    # Sampling.

    def _sample(self, plan: SchedulerOutput, logits: jax.Array, proposal_rows: np.ndarray,
                drafts: Drafts | None) -> tuple[SamplerOutput, list[int], dict[int, int]]:
        """The sampler's outputs, still on the device; each draw's rows in them (a
        verifying sequence's draw has a row per proposal, the logits before it, and one
        after them); and the row of each sequence's token (keyed by id)."""
        logit_rows, sampling_rows, draw_sizes, draft_steps = [], [], [], []
        seq_rows: dict[int, int] = {}
        for group, rows in plan.draws:
            for index, row in _sample_indices(group, plan, rows):
                seq = plan.scheduled[row][0]
                proposals = seq.spec_token_ids if proposal_rows[row] >= 0 else []
                for j, proposal in enumerate(proposals):
                    logit_rows.append(proposal_rows[row] + j)
                    sampling_rows.append(
                        self._sampling_row(group, seq, index, proposals[:j], proposal))
                    if drafts is not None:
                        draft_steps.append((len(sampling_rows) - 1, j, drafts.rows[id(seq)]))
                logit_rows.append(row)
                seq_rows[id(seq)] = len(sampling_rows)
                sampling_rows.append(self._sampling_row(group, seq, index, proposals))
                draw_sizes.append(len(proposals) + 1)
        num_rows = self.shapes.sampler_rows(len(sampling_rows))
        row_array = np.zeros(num_rows, np.int32)
        row_array[: len(logit_rows)] = logit_rows
        tensors = sampling_tensors(sampling_rows, num_rows, self.vocab_size)
        if drafts is not None:
            tensors = dataclasses.replace(tensors, draft_probs=_draft_probs(
                drafts, draft_steps, num_rows))
        sampled = self.runner.sample_on_device(logits, row_array, tensors, self.max_logprobs)
        return sampled, draw_sizes, seq_rows

    @staticmethod
    def _sampling_row(group: SequenceGroup, seq: Sequence, sample_index: int,
                      before: list[int] = (), proposal: int = -1) -> SamplingRow:
        """The row that draws seq's token after its proposals `before` (penalties and
        min_tokens count them as output), checking `proposal` if one is given."""
        params = group.params
        position = len(seq) + len(before)
        if group.is_beam_search:
            # Beams are chosen on the host from the candidates' log-probabilities.
            temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE else 1.0
            return SamplingRow.greedy(position=position, logprob_temperature=temperature)
        output = seq.output_token_ids
        if before:
            output = [*output, *before]
        suppressed = ()
        if len(output) < params.min_tokens:
            suppressed = tuple(group.stop_token_ids)
        return SamplingRow.of(
            params, seed=group.seed, sample_index=sample_index, position=position,
            prompt_token_ids=seq.prompt_token_ids, output_token_ids=output,
            suppressed_token_ids=suppressed, proposal=proposal,
        )

    def _choose_beams(self, plan: SchedulerOutput, sampled: SamplerOutput,
                      draw_rows: list[range]
                      ) -> tuple[dict[str, BeamChoice], dict[str, list[Hypothesis]]]:
        """Each drawing beam search's next beams; the results of those that ended."""
        choices, results, first = {}, {}, 0
        for group, rows in plan.draws:
            # A beam's draw is one row: the group's rows follow each other.
            draws = slice(draw_rows[first].start, draw_rows[first + len(rows) - 1].stop)
            first += len(rows)
            if not group.is_beam_search:
                continue
            search = self.beam_searches[group.request_id]
            if not sampled.finite[draws].all():
                search.fail()  # the scheduler ends the group with FINISHED_ERROR
            else:
                k = search.num_candidates
                step = search.step(sampled.top_ids[draws, :k], sampled.top_logprobs[draws, :k])
                choices[group.request_id] = BeamChoice(
                    [e.parent for e in step.extensions], [e.token for e in step.extensions],
                    step.done)
            if search.results is not None:
                results[group.request_id] = search.results
                del self.beam_searches[group.request_id]
        return choices, results

    def _prompt_logprobs(self, plan: SchedulerOutput, query_start_loc: np.ndarray,
                         hidden: jax.Array) -> PromptLogprobs:
        """Log-probabilities of the prompt tokens this step's hidden states predict, for
        the requests that asked (a group's positions once per computation)."""
        targets = np.zeros(hidden.shape[0], np.int32)
        wanted: list[tuple[SequenceGroup, int, int]] = []  # (group, position, token row)
        seen: set[int] = set()
        for i, ((seq, num_new_tokens), group) in enumerate(zip(plan.scheduled, plan.groups,
                                                               strict=True)):
            if not _computes_prompt_logprobs(group, seq) or id(group) in seen:
                continue
            seen.add(id(group))
            start = seq.num_computed_tokens
            # Position p predicts prompt token p + 1.
            for position in range(start, min(start + num_new_tokens, seq.num_prompt_tokens - 1)):
                row = int(query_start_loc[i]) + position - start
                targets[row] = seq.prompt_token_ids[position + 1]
                wanted.append((group, position, row))
        if not wanted:
            return PromptLogprobs([])
        logprobs, ranks, top_ids, top_logprobs = self.runner.token_logprobs(
            hidden, targets, self.max_logprobs)
        return PromptLogprobs([
            (group, position, float(logprobs[row]), int(ranks[row]), top_ids[row],
             top_logprobs[row]) for group, position, row in wanted])

    # Faults.

    def _fail(self, plan: SchedulerOutput, error: BaseException, output: CoreOutput) -> None:
        """Make the core consistent after `plan`'s step raised.

        The step's requests end with FINISHED_ERROR (their state may be half
        updated). Groups the step swapped out may hold garbage on the host: they
        recompute. If the device call consumed the donated KV cache, every
        device block is lost: the cache is allocated again, the prefix cache
        forgets its blocks and every running group recomputes.
        """
        failed = output.failed = _scheduled_groups(plan)
        output.error = error
        logger.error("a step failed (%s: %s); its %d requests finish with finish_reason "
                     "'error'%s", type(error).__name__, error, len(failed),
                     "; the error is fatal" if is_fatal(error) else "")
        for group in failed:
            search = self.beam_searches.pop(group.request_id, None)
            if search is not None:
                search.fail()
                output.beam_results[group.request_id] = search.results
            self.scheduler.fail(group.request_id)
        self.scheduler.recompute([g for g in plan.preempted
                                  if g.seqs_with(SequenceStatus.SWAPPED)])
        if any(runner.kv_cache_lost() for runner in self.runners):
            logger.error("the KV cache was lost with the step: reallocating it; running "
                         "requests recompute their tokens")
            for runner in self.runners:
                runner.reset_kv_cache()
            self.scheduler.recompute(list(self.scheduler.running))
            self.kv_manager.reset_prefix_cache()
        output.stats = self.scheduler.stats()

    def check_invariants(self) -> None:
        """The KV blocks against the live sequences (RuntimeError on a violation)."""
        scheduler = self.scheduler
        running = [s for g in scheduler.running for s in g.seqs_with(SequenceStatus.RUNNING)]
        swapped = [s for g in scheduler.swapped for s in g.seqs_with(SequenceStatus.SWAPPED)]
        self.kv_manager.check_invariants(running, swapped)


def _draft_probs(drafts: Drafts, draft_steps: list[tuple[int, int, int]], num_rows: int
                 ) -> jax.Array:
    """f32 [num_rows, V]: the draft's distribution of each sampling row's proposal
    (draft_steps: (sampling row, draft step, draft row)); zeros elsewhere."""
    steps, rows = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
    for sampling_row, step, row in draft_steps:
        steps[sampling_row], rows[sampling_row] = step, row
    return draft_rows(drafts.probs, steps, rows)


def _verified(sampled: SamplerOutput, draw_sizes: list[int]
              ) -> tuple[SampledTokens, list[range], list[tuple[int, int]]]:
    """Each draw's outcome from its rows: the proposals accepted before the first
    rejection, and the token of the row after them (a replacement, or the target's next
    token once all were accepted). -> (what the scheduler takes, each draw's rows of the
    tokens it gave, each draw's (proposed, accepted))."""
    num_draws = len(draw_sizes)
    if len(sampled.tokens) >= num_draws and all(size == 1 for size in draw_sizes):
        return (SampledTokens(sampled.tokens[:num_draws], sampled.finite[:num_draws]),
                [range(i, i + 1) for i in range(num_draws)], [(0, 0)] * num_draws)
    ends = np.cumsum(draw_sizes)
    starts = ends - draw_sizes
    accepted = sampled.accepted.tolist()
    num_accepted = []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        count = 0
        while start + count < end - 1 and accepted[start + count]:
            count += 1
        num_accepted.append(count)
    taken = starts + np.array(num_accepted, np.int64)
    finite = np.logical_and.reduceat(sampled.finite[: ends[-1]], starts)
    tokens = SampledTokens(sampled.tokens[taken], finite,
                           num_accepted=np.array(num_accepted, np.int32))
    rows = [range(start, start + count + 1)
            for start, count in zip(starts.tolist(), num_accepted, strict=True)]
    proposals = [(size - 1, count) for size, count in zip(draw_sizes, num_accepted, strict=True)]
    return tokens, rows, proposals


def _sample_indices(group: SequenceGroup, plan: SchedulerOutput, rows: tuple[int, ...]
                    ) -> list[tuple[int, int]]:
    """(sample index, row) of each draw of `group`: a prompt becoming n samples draws
    sample j from its one row; otherwise a sequence's index is its place in the group."""
    if len(group.seqs) == 1:
        return list(enumerate(rows))
    index_of = {id(seq): i for i, seq in enumerate(group.seqs)}
    return [(index_of[id(plan.scheduled[row][0])], row) for row in rows]


def _computes_prompt_logprobs(group: SequenceGroup, seq: Sequence) -> bool:
    """Whether `seq` asked for prompt log-probabilities and has prompt tokens to compute."""
    return (not group.is_beam_search and group.params.prompt_logprobs is not None
            and seq.num_computed_tokens < seq.num_prompt_tokens - 1)


def _scheduled_groups(plan: SchedulerOutput) -> list[SequenceGroup]:
    return list({id(group): group for group in plan.groups}.values())
