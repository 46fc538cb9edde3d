"""Step runners: what turns a scheduler's plan into sampled tokens on the device.

One interface, two implementations:

    dispatch(plan, previous)  send the step to the device: block operations, the
                              proposer's drafts, inputs, the model, the sampler; the
                              sampled tokens stay there (`InFlight`)
    finish(step)              wait for them: the scheduler's `SampledTokens`, with
                              each draw's rows and proposals (`StepResult`)
    warmup_calls(feeds)       what compiles and runs every shape the runner uses

`SingleStepRunner` runs one model step per plan; `DecodeLoopRunner`
(jpaged.worker.decode_loop_runner) runs a plan of lone decodes as up to
num_decode_steps steps in one device loop. With async scheduling the engine core
dispatches step N + 1 before it finishes step N: `previous` is step N, whose tokens
the new step's inputs read on the device where the host holds placeholders.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jpaged.core.batch_builder import BlockTables, build_model_input
from jpaged.core.scheduler_output import SampledTokens, SchedulerOutput
from jpaged.core.step_shapes import StepShapes
from jpaged.model.sampler import SamplerOutput
from jpaged.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceGroup
from jpaged.structured_output.token_masks import TokenMasks
from jpaged.worker import warmup
from jpaged.worker.model_runner import ModelRunner
from jpaged.worker.sampling_rows import (
    SamplingRow,
    sample_indices,
    sampling_row,
    sampling_tensors,
)
from jpaged.worker.warmup import WarmupCalls

if TYPE_CHECKING:
    from jpaged.speculative.proposer import Proposer


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens a step's hidden states predict.

    entries: (group, position p, the logprob of prompt token p + 1, its rank, the top
    ids and their logprobs), each prompt position of a group once per computation.
    """

    entries: list[tuple[SequenceGroup, int, float, int, np.ndarray, np.ndarray]]


@dataclass
class StepResult:
    """What a finished step drew.

    tokens:    what the scheduler takes (`update_from_output`).
    sampled:   the sampler's numpy outputs; None if nothing drew.
    draw_rows: for each draw of plan.draws, in order, the rows of `sampled` holding the
               tokens it gave its sequence: one, a verifying sequence's accepted
               proposals and the token after them, or a decode loop's run.
    proposals: for each draw, (tokens proposed, tokens accepted).
    """

    tokens: SampledTokens
    sampled: SamplerOutput | None = None
    draw_rows: list[range] = field(default_factory=list)
    proposals: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class InFlight:
    """A dispatched step whose tokens the host has not read.

    sampled: the sampler's outputs on the device (None if nothing draws); draw_sizes:
    each draw's rows in them; sampler_rows: the row of each sequence's token, by id;
    finished: the result of a step that finished on the device already (a decode loop).
    """

    plan: SchedulerOutput
    prompt_logprobs: PromptLogprobs
    sampled: SamplerOutput | None = None
    draw_sizes: list[int] = field(default_factory=list)
    sampler_rows: dict[int, int] = field(default_factory=dict)
    finished: StepResult | None = None


class StepRunner(Protocol):
    model_runner: ModelRunner
    shapes: StepShapes

    def dispatch(self, plan: SchedulerOutput, previous: InFlight | None = None) -> InFlight: ...
    def finish(self, step: InFlight) -> StepResult: ...
    def warmup_calls(self, feeds_tokens: bool) -> WarmupCalls: ...
    def recover_kv_cache(self) -> bool: ...


class SingleStepRunner:
    """One model step per plan, over the model runner and the proposer's runners.

    block_tables: the KV cache manager the plan's tables are read from; proposer: the
    engine's (jpaged.speculative.proposer; one that proposes nothing without speculative
    decoding); token_masks: what fills the masks of rows whose sequence has a grammar
    (structured outputs), once the model's step is dispatched, so the host fills them
    while the device runs it; max_logprobs: top tokens the sampler returns per row.
    """

    def __init__(self, model_runner: ModelRunner, block_tables: BlockTables,
                 shapes: StepShapes, proposer: Proposer, token_masks: TokenMasks, *,
                 vocab_size: int, max_logprobs: int):
        self.model_runner = model_runner
        self.block_tables = block_tables
        self.shapes = shapes
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.model_runners = (model_runner, *proposer.runners)
        self.token_masks = token_masks

    def dispatch(self, plan: SchedulerOutput, previous: InFlight | None = None) -> InFlight:
        for runner in self.model_runners:
            runner.apply_block_ops(plan.block_ops)
        # A draft model draws its proposals now that their slots exist; n-grams had theirs.
        drafts = self.proposer.draft(self._verifying(plan))
        self.model_runner.load_adapters(plan.adapter_loads)
        model_input = build_model_input(
            plan.scheduled, self.block_tables, self.shapes.buckets, plan.num_draws,
            self.shapes.num_speculative_tokens, _adapter_slot_of(plan))
        input_ids = model_input.input_ids
        if previous is not None:
            input_ids = self._fed_input_ids(plan, model_input, previous)
        metadata = self.model_runner.with_adapter_slots(model_input.metadata,
                                                        model_input.adapter_slots)
        decode_only = model_input.decode_only
        logits, hidden = self.model_runner.execute(input_ids, metadata, decode_only=decode_only,
                                                   num_rows=model_input.num_rows)
        self.proposer.observe(input_ids, metadata, decode_only=decode_only)
        step = InFlight(plan, self._prompt_logprobs(plan, metadata.query_start_loc, hidden))
        if plan.draws:
            step.sampled, step.draw_sizes, step.sampler_rows = self._sample(
                plan, logits, model_input.proposal_rows, drafts)
        return step

    def finish(self, step: InFlight) -> StepResult:
        if not step.plan.draws:
            return StepResult(SampledTokens(np.zeros(0, np.int32), np.ones(0, bool)))
        sampled = self.model_runner.fetch(step.sampled)
        tokens, draw_rows, proposals = verified(sampled, step.draw_sizes)
        return StepResult(tokens, sampled, draw_rows, proposals)

    def warmup_calls(self, feeds_tokens: bool) -> WarmupCalls:
        calls = WarmupCalls()
        for runner in self.model_runners:
            calls += warmup.step_calls(runner, self.shapes, self.vocab_size, self.max_logprobs)
        if feeds_tokens:
            calls += warmup.feed_calls(self.model_runner, self.shapes)
        return calls

    def recover_kv_cache(self) -> bool:
        """Whether a failed step consumed the KV cache (a donating call that raised): if
        so, every model runner's cache is allocated again, empty."""
        if not any(runner.kv_cache_lost() for runner in self.model_runners):
            return False
        for runner in self.model_runners:
            runner.reset_kv_cache()
        return True

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
        return self.model_runner.feed_tokens(model_input.input_ids, previous.sampled.tokens,
                                             sources)

    def _verifying(self, plan: SchedulerOutput) -> list[tuple[Sequence, functools.partial]]:
        """The sequences this step verifies proposals of, each with the maker of its
        sampling rows."""
        return [(plan.scheduled[row][0],
                 functools.partial(sampling_row, group, plan.scheduled[row][0], index))
                for group, rows in plan.draws
                for index, row in sample_indices(group, plan, rows)
                if plan.scheduled[row][0].spec_token_ids]

    def _sample(self, plan: SchedulerOutput, logits, proposal_rows: np.ndarray, drafts
                ) -> tuple[SamplerOutput, list[int], dict[int, int]]:
        """The sampler's outputs, still on the device; each draw's rows in them (a
        verifying sequence's draw has a row per proposal, the logits before it, and one
        after them); and the row of each sequence's token (keyed by id)."""
        logit_rows, rows_to_draw, draw_sizes, draft_steps = [], [], [], []
        grammar_draws = []  # (its first row, grammar, proposals) of each draw with a grammar
        seq_rows: dict[int, int] = {}
        for group, rows in plan.draws:
            for index, row in sample_indices(group, plan, rows):
                seq = plan.scheduled[row][0]
                proposals = seq.spec_token_ids if proposal_rows[row] >= 0 else []
                if seq.grammar is not None:
                    grammar_draws.append((len(rows_to_draw), seq.grammar, proposals))
                for j, proposal in enumerate(proposals):
                    logit_rows.append(proposal_rows[row] + j)
                    rows_to_draw.append(sampling_row(group, seq, index, proposals[:j], proposal))
                    if drafts is not None:
                        draft_steps.append((len(rows_to_draw) - 1, j, drafts.rows[id(seq)]))
                logit_rows.append(row)
                seq_rows[id(seq)] = len(rows_to_draw)
                rows_to_draw.append(sampling_row(group, seq, index, proposals))
                draw_sizes.append(len(proposals) + 1)
        if grammar_draws:
            self._allow_grammar_tokens(rows_to_draw, grammar_draws)
        num_rows = self.shapes.sampler_rows(len(rows_to_draw))
        row_array = np.zeros(num_rows, np.int32)
        row_array[: len(logit_rows)] = logit_rows
        tensors = sampling_tensors(rows_to_draw, num_rows, self.vocab_size)
        if drafts is not None:
            tensors = dataclasses.replace(tensors, draft_probs=drafts.row_probs(draft_steps,
                                                                                num_rows))
        sampled = self.model_runner.sample_on_device(logits, row_array, tensors,
                                                     self.max_logprobs)
        return sampled, draw_sizes, seq_rows

    def _allow_grammar_tokens(self, rows: list[SamplingRow], grammar_draws) -> None:
        """Give each row of a draw with a grammar the mask of what its grammar allows
        there (after the proposals before it)."""
        masks = self.token_masks.fill([(grammar, proposals)
                                       for _, grammar, proposals in grammar_draws])
        mask_rows = iter(masks)
        for first, _, proposals in grammar_draws:
            for row in range(first, first + 1 + len(proposals)):
                rows[row] = dataclasses.replace(rows[row], allowed_tokens=next(mask_rows))

    def _prompt_logprobs(self, plan: SchedulerOutput, query_start_loc: np.ndarray,
                         hidden) -> PromptLogprobs:
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
        logprobs, ranks, top_ids, top_logprobs = self.model_runner.token_logprobs(
            hidden, targets, self.max_logprobs)
        return PromptLogprobs([
            (group, position, float(logprobs[row]), int(ranks[row]), top_ids[row],
             top_logprobs[row]) for group, position, row in wanted])


def verified(sampled: SamplerOutput, draw_sizes: list[int]
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


def _adapter_slot_of(plan: SchedulerOutput):
    """Each scheduled sequence's adapter slot, by its group's (None: no group of the step
    has an adapter)."""
    slots = {id(seq): group.adapter_slot
             for (seq, _), group in zip(plan.scheduled, plan.groups, strict=True)
             if group.adapter_slot}
    return (lambda seq: slots.get(id(seq))) if slots else None


def _computes_prompt_logprobs(group: SequenceGroup, seq: Sequence) -> bool:
    """Whether `seq` asked for prompt log-probabilities and has prompt tokens to compute."""
    return (not group.is_beam_search and group.params.prompt_logprobs is not None
            and seq.num_computed_tokens < seq.num_prompt_tokens - 1)
