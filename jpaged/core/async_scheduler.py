"""AsyncScheduler: the scheduler of async scheduling, which plans step N + 1 while the
device still runs step N.

`update_from_output` comes in two halves around the next `schedule`:

    predict(plan N)          its tokens taken as drawn: placeholder tokens appended
    schedule()               step N + 1, planned against that prediction
    reconcile(plan N, ...)   the real tokens in the placeholders' place, stop rule applied

Only a predictable plan is predicted: one whose tokens the next schedule need not know
(a fork into samples, beams, penalties and grammars depend on them:
`unpredictable_features`);
the engine finishes any other plan before it schedules again. Proposals need the
tokens too: async scheduling and speculative decoding conflict (jpaged.core.step_modes).
"""

from __future__ import annotations

from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SampledTokens, SchedulerOutput, SchedulerStats
from jpaged.core.step_modes import Feature
from jpaged.sequence import PLACEHOLDER_TOKEN


class AsyncScheduler(Scheduler):
    """A Scheduler whose steps may be taken as done before their tokens are known."""

    @staticmethod
    def unpredictable_features(plan: SchedulerOutput) -> set[Feature]:
        """What keeps the next schedule from taking `plan`'s tokens as drawn (none: every
        draw is one sample's token without penalties): a beam choice, a fork into
        samples, penalties (the next draw's would count the token), a grammar (the next
        draw's mask follows the token)."""
        features = set()
        for group, _ in plan.draws:
            if group.is_beam_search:
                features.add(Feature.BEAM_SEARCH)
            elif group.forks_at_next_draw:
                features.add(Feature.PARALLEL_SAMPLING)
            elif group.params.uses_penalties:
                features.add(Feature.PENALTIES)
            if not group.is_beam_search and group.params.structured_outputs is not None:
                features.add(Feature.STRUCTURED_OUTPUT)
        return features

    def predict(self, plan: SchedulerOutput) -> None:
        """Take `plan`'s step, still running on the device, as done: its new tokens
        computed (full blocks registered) and each draw's token a PLACEHOLDER_TOKEN, so
        the next `schedule` plans the step after it. A request that its tokens take to
        its length limit is held back until `reconcile`. Sequences that ended since the
        plan (an abort, a stop string) are left alone."""
        for seq, num_new_tokens in plan.scheduled:
            if not seq.is_finished:
                seq.num_computed_tokens += num_new_tokens
                self.block_manager.mark_computed(seq)
        for group, rows in plan.draws:
            for row in rows:
                seq = plan.scheduled[row][0]
                if seq.is_finished:
                    continue
                seq.output_token_ids.append(PLACEHOLDER_TOKEN)
                if group.stop_rule.reaches_length(len(seq.output_token_ids)):
                    self.held_back.add(group.request_id)

    def reconcile(self, plan: SchedulerOutput, sampled: SampledTokens) -> SchedulerStats:
        """The tokens of a `predict`ed plan arrived: each replaces its draw's placeholder
        under the stop rule (a non-finite draw ends its group with FINISHED_ERROR). A
        sequence that ended since keeps the token unchecked (a failed step after this
        one), or had its placeholder cut already (a stop string); one the schedule in
        between preempted ends where it waits."""
        ended = False
        draws = [(group, row) for group, rows in plan.draws for row in rows]
        for (group, row), token, finite in zip(draws, sampled.tokens.tolist(),
                                               sampled.finite.tolist(), strict=True):
            self.held_back.discard(group.request_id)
            seq = plan.scheduled[row][0]
            output = seq.output_token_ids
            if not output or output[-1] != PLACEHOLDER_TOKEN:
                continue  # never predicted (it had ended), or cut at a stop string
            del output[-1]
            if not finite:
                if not seq.is_finished:
                    self._end_non_finite(group)
                    ended = True
            elif seq.is_finished:
                output.append(token)
            else:
                ended |= self._append(group, seq, (token,))
        if ended:
            for queue in (self.running, self.waiting, self.swapped):
                for group in [g for g in queue if g.is_finished]:
                    queue.remove(group)
        return self.stats()
