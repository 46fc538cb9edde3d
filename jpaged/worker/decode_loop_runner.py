"""DecodeLoopRunner: a plan of lone decodes runs as a decode loop on the device
(jpaged.worker.decode_loop); any other plan runs one step.

A plan loops when every scheduled sequence decodes its next token alone: no prompt
chunk, no fork into samples, no beam search (beams are chosen on the host each step),
no grammar (its masks are filled on the host each step).
The loop allocates from the KV manager's device pool and the manager adopts the blocks
it took afterwards, so the runner is built only over a manager that declares it can
(`adopts_device_blocks`: one group of paged blocks); with speculative
decoding, proposals are the host's every step, and the engine runs single steps.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np

from jpaged.core.scheduler_output import SampledTokens, SchedulerOutput
from jpaged.core.step_modes import Feature, ModeFallbacks, StepMode
from jpaged.core.step_shapes import bucket, padded_sizes
from jpaged.worker.decode_loop import LoopInput, padding_input
from jpaged.worker.sampling_rows import sample_indices, sampling_row, sampling_tensors
from jpaged.worker.step_runner import InFlight, PromptLogprobs, SingleStepRunner, StepResult
from jpaged.worker.warmup import WarmupCalls


class DecodeLoopRunner:
    """Up to num_decode_steps decode steps per plan of lone decodes, one step otherwise.

    single: the runner of every other plan (its model runner runs the loop);
    kv_manager: a manager that adopts the blocks a loop took on the device;
    fallbacks: where the plans that run one step are counted, by what they hold.
    """

    def __init__(self, single: SingleStepRunner, kv_manager, num_decode_steps: int,
                 fallbacks: ModeFallbacks):
        if not kv_manager.adopts_device_blocks:
            raise ValueError("a decode loop needs a KV cache manager that adopts the blocks "
                             "it takes on the device: one group of paged blocks")
        self.single = single
        self.model_runner, self.shapes = single.model_runner, single.shapes
        self.kv_manager = kv_manager
        self.num_decode_steps = num_decode_steps
        self.fallbacks = fallbacks

    def dispatch(self, plan: SchedulerOutput, previous: InFlight | None = None) -> InFlight:
        features = single_step_features(plan)
        if features:
            for feature in features:
                self.fallbacks.note(StepMode.DECODE_LOOP, feature)
            return self.single.dispatch(plan, previous)
        return InFlight(plan, PromptLogprobs([]), finished=self._run_loop(plan))

    def finish(self, step: InFlight) -> StepResult:
        return step.finished if step.finished is not None else self.single.finish(step)

    def warmup_calls(self, feeds_tokens: bool) -> WarmupCalls:
        """The single step's calls, and a loop of each decode step shape, greedy and
        drawing."""
        runner, pool = self.model_runner, self.kv_manager.state.device
        loops = [(pool, padding_input(rows, blocks, self.single.vocab_size, draws))
                 for _, rows, blocks, decode_only in self.shapes.warmup_shapes() if decode_only
                 for draws in (False, True)]
        knobs = dict(num_steps=self.num_decode_steps, num_top=self.single.max_logprobs)
        return self.single.warmup_calls(feeds_tokens) + WarmupCalls(
            [partial(runner.compile_decode_loop, *args, **knobs) for args in loops],
            [partial(runner.decode_loop, *args, **knobs) for args in loops])

    def recover_kv_cache(self) -> bool:
        return self.single.recover_kv_cache()

    def _run_loop(self, plan: SchedulerOutput) -> StepResult:
        self.model_runner.apply_block_ops(plan.block_ops)
        seqs = [seq for seq, _ in plan.scheduled]
        result = self.model_runner.decode_loop(self.kv_manager.state.device,
                                               self._loop_input(plan),
                                               num_steps=self.num_decode_steps,
                                               num_top=self.single.max_logprobs)
        # Writable copies: the host's transitions store into the pool in place.
        pool = jax.tree.map(np.array, result.pool)
        self.kv_manager.adopt_device_blocks(pool, seqs, result.block_tables)
        sampled, steps = result.sampled, self.num_decode_steps
        runs, finite, draw_rows = [], [], []
        for row, num_drawn in enumerate(result.num_drawn[: len(seqs)].tolist()):
            rows = range(row * steps, row * steps + num_drawn)
            row_finite = sampled.finite[rows.start:rows.stop]
            num_taken = int(np.argmin(row_finite)) if not row_finite.all() else num_drawn
            runs.append(sampled.tokens[rows.start:rows.start + num_taken].tolist())
            finite.append(num_taken == num_drawn)
            draw_rows.append(rows)
        tokens = SampledTokens(np.array([run[-1] if run else 0 for run in runs], np.int32),
                               np.array(finite), runs=runs)
        return StepResult(tokens, sampled, draw_rows, [(0, 0)] * len(seqs))

    def _loop_input(self, plan: SchedulerOutput) -> LoopInput:
        """The scheduled sequences as the loop's rows (padded as a decode step's), with
        each row's stop rule as the loop's columns."""
        seqs = [seq for seq, _ in plan.scheduled]
        shapes, steps, vocab_size = self.shapes, self.num_decode_steps, self.single.vocab_size
        block_size = self.kv_manager.block_size
        num_rows = padded_sizes(len(seqs), len(seqs), shapes.buckets, decode_only=True)[1]
        reach = -(-(max(len(seq) for seq in seqs) + steps - 1) // block_size)
        num_blocks = bucket(min(reach, shapes.max_blocks_per_seq),
                            shapes.buckets.min_blocks_per_seq)
        tables = np.zeros((num_rows, num_blocks), np.int32)
        stop_mask = np.zeros((num_rows, vocab_size), bool)
        columns = np.zeros((6, num_rows), np.int32)  # the int32 [B] columns below
        rows_to_draw = []
        for group, rows in plan.draws:
            rule = group.stop_rule
            for index, row in sample_indices(group, plan, rows):
                seq = plan.scheduled[row][0]
                table = self.kv_manager.block_table(seq).array
                tables[row, : len(table)] = table
                columns[:, row] = (seq.token_id(len(seq) - 1), len(seq) - 1, 1,
                                   len(seq.output_token_ids), rule.max_output, rule.min_tokens)
                stop_mask[row, list(rule.stop_token_ids)] = True
                # The loop suppresses the stop tokens itself, iteration by iteration.
                rows_to_draw.append((row, dataclasses.replace(sampling_row(group, seq, index),
                                                              suppressed_token_ids=())))
        rows_to_draw = [r for _, r in sorted(rows_to_draw, key=lambda item: item[0])]
        input_ids, positions, live, num_output, max_output, min_tokens = columns
        return LoopInput(
            input_ids=input_ids, positions=positions, block_tables=tables,
            live=live.astype(bool), num_output=num_output, max_output=max_output,
            min_tokens=min_tokens, stop_mask=stop_mask,
            sampling=sampling_tensors(rows_to_draw, num_rows, vocab_size, dense=True),
            yield_on_finish=np.bool_(bool(plan.stats.num_waiting or plan.stats.num_swapped)))


def single_step_features(plan: SchedulerOutput) -> set[Feature]:
    """What keeps `plan` from looping (none: every scheduled sequence decodes its next
    token alone): prompt tokens, a fork into samples, a beam search, a grammar (whose
    masks the host fills after every token)."""
    features = set()
    if plan.num_draws != len(plan.scheduled):
        features.add(Feature.PREFILL)
    for (seq, num_new_tokens), group in zip(plan.scheduled, plan.groups, strict=True):
        if num_new_tokens != 1 or seq.num_uncomputed_tokens != 1:
            features.add(Feature.PREFILL)
        if group.is_beam_search:
            features.add(Feature.BEAM_SEARCH)
        elif group.forks_at_next_draw:
            features.add(Feature.PARALLEL_SAMPLING)
        if seq.grammar is not None:
            features.add(Feature.STRUCTURED_OUTPUT)
    return features
