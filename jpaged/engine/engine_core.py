"""EngineCore: one step of the serving loop, in one direction.

    proposer.propose(queues)                 host: speculative decoding's proposals
    plan = scheduler.schedule()              host: who runs, how many tokens each, who draws;
                                             block tables grown (copy-on-write, swaps)
    step = step_runner.dispatch(plan)        device: block ops, the proposer's drafts, the
                                             model and the sampler (jpaged.worker)
    result = step_runner.finish(step)        host waits for the tokens
    beam searches choose their beams         host (jpaged.engine.beam_search)
    scheduler.update_from_output(plan, ...)  host: the one call back: tokens appended,
                                             stops, forks, beams, blocks freed

The step is bound once, at construction: `_step`, or with an AsyncScheduler
`_step_async`, which schedules and dispatches the next step before this one's tokens
are fetched, against a prediction of them (jpaged.core.async_scheduler). The step
runner is the worker's: one model step per plan, or a decode loop.

The core knows token ids only; text is the output processor's. If a step
raises, its requests end with finish_reason "error" and the core recovers (a
lost KV cache is allocated again) so that every other request goes on. Two errors
are fatal (`is_fatal`): an interrupt, and a block id outside the KV pool
(`BlockIdOutOfRange`), whose tables or allocator state are corrupt; `LLMEngine.step`
raises them once the core has ended the step's requests.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from jpaged.core.async_scheduler import AsyncScheduler
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SchedulerOutput, SchedulerStats
from jpaged.core.step_modes import ModeFallbacks, StepMode
from jpaged.engine.beam_search import BeamSearch, Hypothesis, choose_beams
from jpaged.engine.kv_managers import KVManager
from jpaged.engine.lockstep import Lockstep
from jpaged.engine.stats import KVBlockCounts, block_usage
from jpaged.memory.block_ids import BlockIdOutOfRange
from jpaged.model.sampler import SamplerOutput
from jpaged.sequence import SequenceGroup, SequenceStatus
from jpaged.speculative.proposer import Proposer
from jpaged.worker.step_runner import InFlight, PromptLogprobs, StepResult, StepRunner

logger = logging.getLogger("jpaged")


@dataclass
class CoreOutput:
    """What one step did, for the output processor.

    plan:     the step's SchedulerOutput.
    stats:    the scheduler's queues once the step is over.
    kv_blocks: the pool's blocks as the step runs (after scheduling, before sampling).
    block_usage: (request id, logical, physical) blocks of each running request as
              the step runs: its tables' total length, and the distinct blocks in them.
    sampled, draw_rows, proposals: the step runner's (jpaged.worker.step_runner.StepResult).
    failed:   groups whose step failed (they finished with FINISHED_ERROR).
    kv_lost:  whether the failed step lost the KV cache (it was allocated again).
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
    kv_lost: bool = False

    def take(self, result: StepResult) -> None:
        self.sampled, self.draw_rows, self.proposals = (result.sampled, result.draw_rows,
                                                        result.proposals)


class _Dispatched(NamedTuple):
    """A step on the device, its output so far, and whether the next schedule may take its
    tokens as drawn."""

    step: InFlight
    output: CoreOutput
    predictable: bool


def is_fatal(error: BaseException) -> bool:
    """Whether the engine must not go on after a step raised `error`: an interrupt, or a
    block id outside the KV pool (an invariant broken: going on would serve requests
    from corrupt block tables)."""
    return not isinstance(error, Exception) or isinstance(error, BlockIdOutOfRange)


class EngineCore:
    """The scheduler, its KV cache manager and a step runner, stepped one way.

    proposer: speculative decoding's (the base Proposer proposes nothing).
    fallbacks: where the steps async scheduling cannot overlap are counted.
    lockstep: where the runner's mesh spans processes, the check that all of them
    planned the same step, made before it is dispatched (jpaged.engine.lockstep).
    """

    def __init__(self, scheduler: Scheduler, kv_manager: KVManager, step_runner: StepRunner,
                 proposer: Proposer | None = None, *, fallbacks: ModeFallbacks | None = None,
                 lockstep: Lockstep | None = None):
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.step_runner = step_runner
        self.proposer = proposer or Proposer()
        self.lockstep = lockstep
        self.fallbacks = fallbacks or ModeFallbacks()
        self.beam_searches: dict[str, BeamSearch] = {}
        self._in_flight: _Dispatched | None = None  # async scheduling's running step
        self.step = self._step_async if isinstance(scheduler, AsyncScheduler) else self._step

    def add_request(self, group: SequenceGroup, beam_search: BeamSearch | None) -> None:
        """Queue `group` (raises ValueError, changing nothing, if it can never run)."""
        self.scheduler.add_request(group)
        if beam_search is not None:
            self.beam_searches[group.request_id] = beam_search

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.beam_searches.pop(request_id, None)

    def _step(self) -> list[CoreOutput]:
        """Propose, schedule, run, sample and update once: the step's output. A step that
        raises (an interrupt too) ends its requests and returns its error, with the core
        consistent again."""
        self.proposer.propose((self.scheduler.running, self.scheduler.swapped))
        plan, output = self._schedule()
        if not plan.is_empty:
            try:
                self._update(self.step_runner.dispatch(plan), output)
            except BaseException as error:
                self._fail(plan, error, output)
        return [output]

    def _step_async(self) -> list[CoreOutput]:
        """One step of async scheduling: schedule step N + 1 while step N runs.

            predict N           its tokens taken as drawn (placeholders), if predictable
            schedule N + 1      against that prediction
            dispatch N + 1      on the device, fed N's tokens there, not through the host
            finish N            wait for N's tokens; placeholders replaced, stops checked

        A step whose tokens the next schedule must know is finished before anything else
        is scheduled. -> the outputs of the steps finished (none on the first call), then
        this call's plan's if it is empty and reports something (requests it ignored) or
        nothing ran."""
        in_flight, self._in_flight = self._in_flight, None
        previous = None if in_flight is None else in_flight.step
        if in_flight is not None and not in_flight.predictable:
            return [self._finished(self._update, previous, in_flight.output)]
        if previous is not None:
            self.scheduler.predict(previous.plan)
        plan, output = self._schedule()
        outputs = []
        if not plan.is_empty:
            try:
                step = self.step_runner.dispatch(plan, previous)
                self._in_flight = _Dispatched(step, output, self._predictable(plan))
            except BaseException as error:
                self._fail(plan, error, output)
                outputs.append(output)
        if in_flight is not None:
            outputs.insert(0, self._finished(self._reconcile, previous, in_flight.output))
        if plan.is_empty and (previous is None or plan.ignored):
            outputs.append(output)
        return outputs

    def _predictable(self, plan: SchedulerOutput) -> bool:
        features = self.scheduler.unpredictable_features(plan)
        for feature in features:
            self.fallbacks.note(StepMode.ASYNC_SCHEDULING, feature)
        return not features

    def _schedule(self) -> tuple[SchedulerOutput, CoreOutput]:
        plan = self.scheduler.schedule()
        if self.lockstep is not None:
            self.lockstep.check(plan, self.kv_manager.block_tables)
        output = CoreOutput(plan, plan.stats, KVBlockCounts.of(self.kv_manager))
        if not plan.is_empty:
            output.block_usage = block_usage(self.kv_manager, plan.running)
        return plan, output

    def _update(self, step: InFlight, output: CoreOutput) -> CoreOutput:
        """Read the step's tokens, let beam searches choose, and make the one call back."""
        result = self._read(step, output)
        tokens = result.tokens
        if self.beam_searches and step.plan.draws:
            beams, output.beam_results = choose_beams(self.beam_searches, step.plan,
                                                      result.sampled, result.draw_rows)
            tokens = dataclasses.replace(tokens, beams=beams)
        output.stats = self.scheduler.update_from_output(step.plan, tokens)
        return output

    def _reconcile(self, step: InFlight, output: CoreOutput) -> CoreOutput:
        """Read a predicted step's tokens into the places the prediction held."""
        output.stats = self.scheduler.reconcile(step.plan, self._read(step, output).tokens)
        return output

    def _read(self, step: InFlight, output: CoreOutput) -> StepResult:
        output.prompt_logprobs = step.prompt_logprobs
        result = self.step_runner.finish(step)
        output.take(result)
        return result

    def _finished(self, finish, step: InFlight, output: CoreOutput) -> CoreOutput:
        """finish(step, output) (`_update` or `_reconcile`), or `_fail` if it raises."""
        try:
            return finish(step, output)
        except BaseException as error:
            self._fail(step.plan, error, output)
            return output

    def _fail(self, plan: SchedulerOutput, error: BaseException, output: CoreOutput) -> None:
        """Make the core consistent after `plan`'s step raised.

        The step's requests end with FINISHED_ERROR (their state may be half
        updated). Groups the step swapped out may hold garbage on the host: they
        recompute, and the host tier's copies and the loaded blocks its block ops may
        have left half written are forgotten. If the device call consumed the
        donated KV cache, every device block is lost: the cache is allocated again,
        the prefix cache forgets its blocks (and reserved prefixes theirs) and every
        running group recomputes. The adapter slots the plan loaded are loaded again, or
        freed where no group is left to use them (as the KV blocks its ops were to load).
        """
        failed = output.failed = list({id(group): group for group in plan.groups}.values())
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
        self.kv_manager.forget_unapplied(plan.block_ops)
        if self.step_runner.recover_kv_cache():
            output.kv_lost = True
            logger.error("the KV cache was lost with the step: reallocating it; running "
                         "requests recompute their tokens")
            self.scheduler.recompute(list(self.scheduler.running))
            self.kv_manager.reset_prefix_cache()
        self.scheduler.adapters.forget_unapplied(plan.adapter_loads)
        output.stats = self.scheduler.stats()

    def check_invariants(self) -> None:
        """The KV blocks against the live sequences (RuntimeError on a violation)."""
        scheduler = self.scheduler
        running = [s for g in scheduler.running for s in g.seqs_with(SequenceStatus.RUNNING)]
        swapped = [s for g in scheduler.swapped for s in g.seqs_with(SequenceStatus.SWAPPED)]
        self.kv_manager.check_invariants(running, swapped)
