"""OutputProcessor: what a step's tokens mean to the user.

The engine core hands it every step's `CoreOutput` (token ids, their
log-probabilities, which groups ended); it turns them into text (incremental
detokenization), finds stop strings, makes logprob entries and cuts each
request's `RequestOutput` as its output kind says (cumulative, delta, final
only). A stop string ends a sample: `process` returns those sequences so that
the engine ends them through the scheduler before the next step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from jpaged.engine.beam_search import Hypothesis
from jpaged.engine.detokenizer import IncrementalDetokenizer, find_stop_string, held_back_length
from jpaged.engine.engine_core import CoreOutput
from jpaged.engine.input_processor import EngineRequest
from jpaged.engine.stats import EngineStats
from jpaged.outputs import (
    FINISH_REASONS,
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SampleState:
    """What one sample has produced for the user, and how much of it was reported.

    text:        the visible text: stop strings cut, text that may still become
                 a stop string held back.
    stopped:     a stop string ended it.
    num_tokens:  its sequence's output tokens taken so far: its output (a stop string
                 drops what a verified run accepted after it).
    num_*_sent:  how many tokens, characters, logprob entries went out as deltas.
    """

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float = 0.0
    text: str = ""
    stop_reason: int | str | None = None
    stopped: bool = False
    num_tokens: int = 0
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    num_logprobs_sent: int = 0
    finish_sent: bool = False


class StringStop(NamedTuple):
    """A sample a stop string ended: its sequence keeps num_output_tokens tokens (a
    verified run can go on past the stop string)."""

    group: SequenceGroup
    seq: Sequence
    num_output_tokens: int


@dataclass
class RequestState:
    """One request's user-facing state.

    samples: one per sample, in the group's order (a sampling request).
    beam_results: the best hypotheses once a beam search is over.
    prompt_logprobs: [None, then one entry per prompt token as computed], when asked.
    """

    group: SequenceGroup
    prompt: str | None
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    beam_results: list[Hypothesis] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def params(self) -> SamplingParams | BeamSearchParams:
        return self.group.params

    def is_finished(self) -> bool:
        if self.group.is_beam_search:
            return self.group.is_finished
        return all(seq.is_finished or sample.stopped
                   for seq, sample in zip(self.group.seqs, self.samples, strict=True))


class OutputProcessor:
    """Text, logprob entries and RequestOutputs of every request in flight."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, request: EngineRequest, group: SequenceGroup) -> None:
        state = RequestState(group, request.prompt, RequestMetrics(request.arrival_time))
        params = request.params
        if isinstance(params, SamplingParams):
            state.samples.append(self._new_sample(0, group))
            if params.prompt_logprobs is not None:
                state.prompt_logprobs = [None]
        self.requests[request.request_id] = state

    def _new_sample(self, index: int, group: SequenceGroup) -> SampleState:
        params = group.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                             skip_special_tokens=params.skip_special_tokens)
        return SampleState(index, detokenizer, None if params.logprobs is None else [])

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    # One step.

    def process(self, core: CoreOutput, stats: EngineStats) -> tuple[list[RequestOutput],
                                                                     list[StringStop]]:
        """The outputs of the requests the step touched (finished ones leave, their
        latencies and lengths recorded in `stats`), and the sequences a stop string
        ended, for the scheduler to end."""
        # A request aborted while its step ran (async scheduling) is gone: it is skipped.
        requests = self.requests
        for request_id, logical, physical in core.block_usage:
            if request_id in requests:
                metrics = requests[request_id].metrics
                metrics.logical_block_steps += logical
                metrics.physical_block_steps += physical
        self._add_prompt_logprobs(core)
        touched = [requests[g.request_id] for g in [*core.plan.ignored, *core.failed]
                   if g.request_id in requests]
        stops = []
        if core.sampled is not None:
            now = time.perf_counter()
            first = 0
            for group, rows in core.plan.draws:
                draws = range(first, first + len(rows))
                first += len(rows)
                state = requests.get(group.request_id)
                if state is None:
                    continue
                touched.append(state)
                state.metrics.first_token_time = state.metrics.first_token_time or now
                for draw in draws:
                    proposed, accepted = core.proposals[draw]
                    state.metrics.num_draft_tokens += proposed
                    state.metrics.num_accepted_tokens += accepted
                if group.is_beam_search or not all(
                        core.sampled.finite[core.draw_rows[draw]].all() for draw in draws):
                    continue
                stops += self._add_tokens(state, core, rows, draws)
        for request_id, results in core.beam_results.items():
            if request_id in requests:
                requests[request_id].beam_results = results
        return [output for state in touched if (output := self._output(state, stats))], stops

    def _add_tokens(self, state: RequestState, core: CoreOutput, rows: tuple[int, ...],
                    draws: range) -> list[StringStop]:
        """The tokens each draw gave its sequence (one, or a verified run), as text and
        logprob entries; the sequences a stop string ended."""
        group, sampled = state.group, core.sampled
        if len(state.samples) < len(group.seqs):  # the prompt forked its samples
            state.samples += [self._new_sample(i, group)
                              for i in range(len(state.samples), len(group.seqs))]
            seqs = group.seqs
        else:
            seqs = [core.plan.scheduled[row][0] for row in rows]
        # A draw's sample is its sequence's place in the group (samples end at different
        # steps: a lone draw may be any sample's).
        index_of = ({id(seq): i for i, seq in enumerate(group.seqs)} if len(group.seqs) > 1
                    else None)
        stops = []
        for seq, draw in zip(seqs, draws, strict=True):
            sample = state.samples[0 if index_of is None else index_of[id(seq)]]
            # What the scheduler appended: it stopped at a stop token or a length limit.
            new_tokens = seq.output_token_ids[sample.num_tokens:]
            for token, row in zip(new_tokens, core.draw_rows[draw], strict=False):
                sample.num_tokens += 1
                sample.cumulative_logprob += float(sampled.logprobs[row])
                if sample.logprobs is not None:
                    k = state.params.logprobs
                    sample.logprobs.append(self._logprob_entry(
                        token, sampled.logprobs[row], sampled.ranks[row],
                        sampled.top_ids[row, :k], sampled.top_logprobs[row, :k]))
                ended = sample.num_tokens == len(seq.output_token_ids) and seq.is_finished
                if self._add_text(sample, token, state.params, ended,
                                  ended and _is_stop_token(group, seq, token)):
                    stops.append(StringStop(group, seq, sample.num_tokens))
                    break
        return stops

    @staticmethod
    def _add_text(sample: SampleState, token: int, params: SamplingParams, ended: bool,
                  stop_token: bool) -> bool:
        """Detokenize `token` into the sample's text; True if a stop string ended it.
        ended: the sequence ended at this token (the scheduler's stop, a complete grammar,
        or a limit); stop_token: it ended as the stop token `token` (EOS, stop_token_ids).

        vLLM's order: a stop token (the scheduler ended the sequence) leaves its text
        out unless include_stop_str_in_output; a stop string (once min_tokens are
        out) cuts the text there, whatever else ended the sequence; at its end the
        held-back text is released.
        """
        detokenizer = sample.detokenizer
        if stop_token:
            sample.stop_reason = token if token in params.stop_token_ids else None
            if params.include_stop_str_in_output:
                detokenizer.append(token)
            detokenizer.finish()
            sample.text = detokenizer.text
            return False
        new_text = detokenizer.append(token)
        text = detokenizer.text
        if params.stop and sample.num_tokens >= params.min_tokens:
            match = find_stop_string(text, len(new_text), params.stop,
                                     params.include_stop_str_in_output)
            if match is not None:
                cut, sample.stop_reason = match
                sample.text, sample.stopped = text[:cut], True
                return True
        if ended:
            detokenizer.finish()
            sample.text = detokenizer.text
        else:
            sample.text = text[: len(text) - held_back_length(text, params.stop)]
        return False

    def _add_prompt_logprobs(self, core: CoreOutput) -> None:
        for group, position, logprob, rank, top_ids, top_logprobs in core.prompt_logprobs.entries:
            state = self.requests.get(group.request_id)
            if state is None:
                continue
            if len(state.prompt_logprobs) != position + 1:
                continue  # computed again after a preemption
            k = state.params.prompt_logprobs
            target = group.prompt_token_ids[position + 1]
            state.prompt_logprobs.append(self._logprob_entry(
                target, logprob, rank, top_ids[:k], top_logprobs[:k]))

    # Outputs.

    def _output(self, state: RequestState, stats: EngineStats) -> RequestOutput | None:
        """This step's output, or None when there is nothing to report; a finished
        request leaves (its metrics recorded)."""
        finished = state.is_finished()
        if finished:
            state.metrics.finished_time = time.perf_counter()
            stats.record_finished(state.metrics, _output_lengths(state))
            del self.requests[state.group.request_id]
        # Beams change every step until the search ends: they report only then.
        beam_search = state.group.is_beam_search
        kind = RequestOutputKind.FINAL_ONLY if beam_search else state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if beam_search:
            completions = self._beam_completions(state)
        elif kind is RequestOutputKind.DELTA:
            completions = _sample_deltas(state)
            if not completions and not finished:
                return None
        else:
            completions = [_sample_completion(state, seq, sample)
                           for seq, sample in zip(state.group.seqs, state.samples, strict=True)]
        prompt_logprobs = state.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.group.request_id,
            prompt=state.prompt,
            prompt_token_ids=list(state.group.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=dataclasses.replace(state.metrics),
            num_cached_tokens=state.group.num_cached_tokens,
        )

    def _beam_completions(self, state: RequestState) -> list[CompletionOutput]:
        """The best hypotheses, best first (a finished beam-search request)."""
        completions = []
        for rank, hypothesis in enumerate(state.beam_results or ()):
            beam = hypothesis.beam
            tokens = beam.output_token_ids
            text_tokens = tokens[:-1] if hypothesis.finish_reason == "stop" else tokens
            completions.append(CompletionOutput(
                index=rank, text=self.tokenizer.decode(text_tokens, skip_special_tokens=True),
                token_ids=list(tokens), cumulative_logprob=beam.cum_logprob,
                logprobs=[self._candidates_entry(*step) for step in beam.candidates],
                finish_reason=hypothesis.finish_reason,
            ))
        return completions

    # Token texts.

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_entry(self, token: int, logprob, rank, top_ids, top_logprobs) -> dict:
        """{token: Logprob} for the chosen token, then the top ones by rank."""
        entry = {token: Logprob(float(logprob), int(rank), self._token_text(token))}
        entry.update(self._candidates_entry(top_ids, top_logprobs))
        return entry

    def _candidates_entry(self, top_ids, top_logprobs) -> dict:
        return {
            int(t): Logprob(float(lp), rank, self._token_text(int(t)))
            for rank, (t, lp) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1)
        }


def _is_stop_token(group: SequenceGroup, seq: Sequence, token: int) -> bool:
    """Whether `seq`, which ended at `token`, ended as a stop token ends a sequence (not as
    a complete grammar or a length limit do): its text leaves the token out."""
    return seq.status is SequenceStatus.FINISHED_STOPPED and (
        token in group.stop_token_ids or token in group.eos_token_ids)


def _output_lengths(state: RequestState) -> list[int]:
    """Output tokens of each sample, or of each returned beam."""
    if state.group.is_beam_search:
        return [len(h.beam.output_token_ids) for h in state.beam_results or ()]
    return [sample.num_tokens for sample in state.samples]


def _finish_reason(seq: Sequence, sample: SampleState) -> str | None:
    return "stop" if sample.stopped else FINISH_REASONS.get(seq.status)


def _sample_completion(state: RequestState, seq: Sequence, sample: SampleState
                       ) -> CompletionOutput:
    return CompletionOutput(
        index=sample.index,
        text=sample.text,
        token_ids=seq.output_token_ids[:sample.num_tokens],
        cumulative_logprob=sample.cumulative_logprob,
        logprobs=None if sample.logprobs is None else list(sample.logprobs),
        finish_reason=_finish_reason(seq, sample),
        stop_reason=sample.stop_reason,
    )


def _sample_deltas(state: RequestState) -> list[CompletionOutput]:
    """Per sample, what is new since its last delta (samples with nothing new left out)."""
    deltas = []
    for seq, sample in zip(state.group.seqs, state.samples, strict=True):
        finish_reason = _finish_reason(seq, sample)
        new_tokens = seq.output_token_ids[sample.num_tokens_sent:sample.num_tokens]
        new_text = sample.text[sample.num_chars_sent:]
        reports_finish = finish_reason is not None and not sample.finish_sent
        if not new_tokens and not new_text and not reports_finish:
            continue
        logprobs = None
        if sample.logprobs is not None:
            logprobs = sample.logprobs[sample.num_logprobs_sent:]
        deltas.append(CompletionOutput(
            index=sample.index, text=new_text, token_ids=list(new_tokens),
            cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
            finish_reason=finish_reason, stop_reason=sample.stop_reason,
        ))
        sample.num_tokens_sent = sample.num_tokens
        sample.num_chars_sent = len(sample.text)
        sample.num_logprobs_sent = len(sample.logprobs or ())
        sample.finish_sent = finish_reason is not None
    return deltas

