"""A request's host-side state between steps, and the outputs made from it.

The scheduler and block manager see a request as a SequenceGroup: token ids
and KV blocks. This module holds what only the user sees: per sample its text
(decoded incrementally), log-probabilities, stop decision and what was already
reported; per beam-search request its beams and finished hypotheses; and how a
step's output is cut (cumulative, delta, final only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from jpaged.engine.beam_search import Beam, BeamSearch, Hypothesis
from jpaged.engine.detokenizer import IncrementalDetokenizer, find_stop_string, held_back_length
from jpaged.outputs import (
    FINISH_REASONS,
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class Sample:
    """What one sampled sequence has produced, and how much of it was reported.

    text:        the visible text: stop strings cut, text that may still become
                 a stop string held back.
    num_*_sent:  how many tokens, characters, logprob entries went out as deltas.
    """

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float = 0.0
    text: str = ""
    stop_reason: int | str | None = None
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    num_logprobs_sent: int = 0
    finish_sent: bool = False

    def fork(self, index: int) -> Sample:
        return dataclasses.replace(
            self, index=index, detokenizer=self.detokenizer.fork(),
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )


@dataclass
class Request:
    """One request: its sequence group, parameters and host-side outputs.

    samples: seq_id -> Sample, for a sampling request.
    beams:   seq_id -> Beam of each live beam, `search`, and once it is done
             `beam_results`, the best hypotheses, for a beam search.
    prompt_logprobs: [None, then one entry per prompt token as computed], when asked.
    """

    group: SequenceGroup
    params: SamplingParams | BeamSearchParams
    prompt: str | None
    seed: int
    metrics: RequestMetrics
    samples: dict[int, Sample] = field(default_factory=dict)
    beams: dict[int, Beam] = field(default_factory=dict)
    search: BeamSearch | None = None
    beam_results: list[Hypothesis] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def is_beam_search(self) -> bool:
        return self.search is not None

    def output_lengths(self) -> list[int]:
        """Output tokens of each sample, or of each returned beam."""
        if self.is_beam_search:
            return [len(h.beam.output_token_ids) for h in self.beam_results or ()]
        return [len(seq.output_token_ids) for seq in self.group.seqs]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.group.prompt_token_ids
        )

    # Sampling ---------------------------------------------------------------------------

    def append_token(
        self, seq: Sequence, token: int, logprob: float, logprob_entry: dict | None,
        eos_token_ids: tuple[int, ...], max_model_len: int,
    ) -> SequenceStatus | None:
        """Add a sampled token to `seq`; the finished status it reaches, or None.

        Stop checks in vLLM's order: none before min_tokens; EOS (unless
        ignore_eos) and stop_token_ids, whose text is left out unless
        include_stop_str_in_output; stop strings, cutting the text there;
        max_tokens and max_model_len.
        """
        params, sample = self.params, self.samples[seq.seq_id]
        seq.append_token(token)
        sample.cumulative_logprob += logprob
        if sample.logprobs is not None:
            sample.logprobs.append(logprob_entry)
        num_output = len(seq.output_token_ids)
        checks_stop = num_output >= params.min_tokens
        stop_token = checks_stop and (
            token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
        )
        if stop_token:
            sample.stop_reason = token if token in params.stop_token_ids else None
            if params.include_stop_str_in_output:
                sample.detokenizer.append(token)
            sample.detokenizer.finish()
            sample.text = sample.detokenizer.text
            return SequenceStatus.FINISHED_STOPPED
        new_text = sample.detokenizer.append(token)
        text = sample.detokenizer.text
        if checks_stop and params.stop:
            match = find_stop_string(text, len(new_text), params.stop,
                                     params.include_stop_str_in_output)
            if match is not None:
                cut, sample.stop_reason = match
                sample.text = text[:cut]
                return SequenceStatus.FINISHED_STOPPED
        if (params.max_tokens is not None and num_output >= params.max_tokens) or (
            len(seq) >= max_model_len
        ):
            sample.detokenizer.finish()
            sample.text = sample.detokenizer.text
            return SequenceStatus.FINISHED_LENGTH
        sample.text = text[: len(text) - held_back_length(text, params.stop)]
        return None

    # Outputs --------------------------------------------------------------------------

    def output(self, decode: Callable[[list[int], bool], str]) -> RequestOutput | None:
        """This step's output, or None when there is nothing to report.

        decode(token_ids, skip_special_tokens) -> text, for beam hypotheses.
        """
        finished = self.group.is_finished
        # Beams change every step until the search ends: they report only then.
        kind = RequestOutputKind.FINAL_ONLY if self.is_beam_search else self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.is_beam_search:
            completions = self._beam_completions(decode)
        elif kind is RequestOutputKind.DELTA:
            completions = self._sample_deltas()
            if not completions and not finished:
                return None
        else:
            completions = [self._sample_completion(seq) for seq in self._sampled_seqs()]
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.group.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=dataclasses.replace(self.metrics),
        )

    def _sampled_seqs(self) -> list[Sequence]:
        """The group's sampled sequences in sample-index order."""
        return sorted(self.group.seqs, key=lambda seq: self.samples[seq.seq_id].index)

    def _sample_completion(self, seq: Sequence) -> CompletionOutput:
        sample = self.samples[seq.seq_id]
        return CompletionOutput(
            index=sample.index,
            text=sample.text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=None if sample.logprobs is None else list(sample.logprobs),
            finish_reason=FINISH_REASONS.get(seq.status),
            stop_reason=sample.stop_reason,
        )

    def _sample_deltas(self) -> list[CompletionOutput]:
        """Per sample, what is new since its last delta (samples with nothing new left out)."""
        deltas = []
        for seq in self._sampled_seqs():
            sample = self.samples[seq.seq_id]
            finish_reason = FINISH_REASONS.get(seq.status)
            new_tokens = seq.output_token_ids[sample.num_tokens_sent:]
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
            sample.num_tokens_sent = len(seq.output_token_ids)
            sample.num_chars_sent = len(sample.text)
            sample.num_logprobs_sent = len(sample.logprobs or ())
            sample.finish_sent = finish_reason is not None
        return deltas

    def _beam_completions(self, decode) -> list[CompletionOutput]:
        """The best hypotheses, best first (a finished beam-search request)."""
        completions = []
        for rank, hypothesis in enumerate(self.beam_results or ()):
            tokens = hypothesis.beam.output_token_ids
            text_tokens = tokens[:-1] if hypothesis.finish_reason == "stop" else tokens
            completions.append(CompletionOutput(
                index=rank, text=decode(text_tokens, True), token_ids=list(tokens),
                cumulative_logprob=hypothesis.beam.cum_logprob,
                logprobs=list(hypothesis.beam.logprobs), finish_reason=hypothesis.finish_reason,
            ))
        return completions
