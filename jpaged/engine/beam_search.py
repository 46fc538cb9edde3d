"""Beam selection: which beams live on after each step, and which hypotheses finish.

Host-side and model-free. The engine runs a beam-search request as one sequence
group: every step it computes each live beam's next-token log-probabilities and
hands their top candidates to `BeamSearch.step`; the scheduler then forks,
extends and drops the group's sequences as the returned `BeamStep` says (in its
`update_from_output`, as a `BeamChoice`), so the group's sequences stay in the
order of `BeamSearch.live`. Beams that branch from one parent share its blocks
by reference count; dropped beams free theirs.

Two scorings (`BeamSearchParams.scoring`):

- "vllm", as `vllm.LLM.beam_search`: each beam proposes its 2 * beam_width best
  tokens; every candidate ending in EOS becomes a finished hypothesis; the best
  beam_width others live on. score = cumulative logprob / length ** length_penalty,
  length counting prompt and output tokens (a final EOS excluded). It always runs
  max_tokens steps and returns the best beam_width of finished and live beams.
- "transformers", as `generate(num_beams=beam_width, do_sample=False)`: the best
  max(2, 1 + number of EOS ids) * beam_width candidates over all beams; the best
  beam_width that do not end (EOS, or the last step) live on; an ending
  candidate becomes a hypothesis only if it ranks within the best beam_width
  candidates, scored cumulative logprob / generated length ** length_penalty
  (EOS counted), and at most beam_width hypotheses are kept. It stops by
  transformers' `early_stopping` rule.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from jpaged.core.scheduler_output import BeamChoice, SchedulerOutput
from jpaged.model.sampler import SamplerOutput
from jpaged.sampling_params import BeamSearchParams

# transformers' stand-in for minus infinity in beam scores.
_MASKED = -1.0e9

# One step's candidates of a beam: (token ids int [K], their log-probabilities f32 [K]),
# best first.
Candidates = tuple[np.ndarray, np.ndarray]


@dataclass
class Beam:
    """A beam's output so far: tokens after the prompt, their summed log-probability,
    and per step the candidates its scores came from."""

    output_token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    candidates: list[Candidates] = field(default_factory=list)


@dataclass(frozen=True)
class Extension:
    """A live beam's next token: `parent` indexes the beams given to `BeamSearch.step`."""

    parent: int
    token: int
    cum_logprob: float


@dataclass
class Hypothesis:
    """A finished beam. finish_reason: "stop" (ended in EOS), "length", or "error"
    (a live beam of a request whose step failed)."""

    beam: Beam
    score: float
    finish_reason: str


@dataclass
class BeamStep:
    """What one step decided: the next live beams, and whether the search is over (then
    the live beams need no more device steps).

    extensions are in the order the group's sequences take them (`in_group_order`):
    each parent chosen goes on as its best extension, in the parents' order, and the
    forks of its other extensions follow, parent by parent, best first.
    """

    extensions: list[Extension]
    done: bool


def in_group_order(extensions: list[Extension]) -> list[Extension]:
    """Extensions (best first) in the order of the sequences that continue them: the
    best extension of each chosen parent, by parent, then the others, by parent and
    best first (the forks, which join the group after the sequences it keeps)."""
    seen: set[int] = set()
    kept, forks = [], []
    for extension in extensions:
        (forks if extension.parent in seen else kept).append(extension)
        seen.add(extension.parent)
    return sorted(kept, key=lambda e: e.parent) + sorted(forks, key=lambda e: e.parent)


def vllm_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`; length counts prompt and output, without a final EOS."""
    return cum_logprob / length**length_penalty


class BeamSearch:
    """The beam selection of one request.

    params:        its BeamSearchParams.
    prompt_len:    prompt tokens.
    eos_token_ids: the tokens that end a hypothesis (unless params.ignore_eos).
    max_tokens:    output tokens at most (params.max_tokens, cut to max_model_len).

    live:    the beams that go on, in the order of the group's sequences.
    results: once the search is over, the best hypotheses (`results_of`).
    """

    def __init__(self, params: BeamSearchParams, prompt_len: int,
                 eos_token_ids: tuple[int, ...], max_tokens: int):
        self.params = params
        self.prompt_len = prompt_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos = frozenset() if params.ignore_eos else self.eos_token_ids  # ends a beam
        self.max_tokens = max_tokens
        self.num_steps = 0
        self.live = [Beam()]
        self.results: list[Hypothesis] | None = None
        self.finished: list[Hypothesis] = []
        # transformers' stopping state: is_early_stop_heuristic_unsatisfied, the best
        # running beam's score and whether every candidate of the last step ended.
        self._improvable = True
        self._best_running = 0.0
        self._all_end = False

    @property
    def num_candidates(self) -> int:
        """Candidates each live beam must propose (top log-probabilities per beam)."""
        width = self.params.beam_width
        if self.params.scoring == "vllm":
            return 2 * width
        return max(2, 1 + len(self.eos)) * width

    def step(self, top_ids: np.ndarray, top_logprobs: np.ndarray) -> BeamStep:
        """One step of the search: the live beams extended by their candidates.

        top_ids:      int [num live beams, >= num_candidates], each beam's best next
                      tokens, in the order of `live`.
        top_logprobs: float [num live beams, same], their log-probabilities, descending.

        The chosen extensions become `live`; once the search is done they are scored
        with the finished hypotheses into `results`.
        """
        k = self.num_candidates
        beams = self.live
        candidates = [
            (beam.cum_logprob + float(lp), parent, int(token))
            for parent, beam in enumerate(beams)
            for token, lp in zip(top_ids[parent, :k].tolist(), top_logprobs[parent, :k].tolist(),
                                 strict=True)
        ]
        rows = [(top_ids[parent, :k], top_logprobs[parent, :k]) for parent in range(len(beams))]
        select = self._step_vllm if self.params.scoring == "vllm" else self._step_transformers
        extensions, ended = select(candidates)
        for candidate, reason in ended:
            self._record(beams, rows, candidate, reason)
        self.num_steps += 1
        if self.params.scoring == "transformers":
            self._prune_finished()
        done = not extensions or self.num_steps >= self.max_tokens or (
            self.params.scoring == "transformers" and self._transformers_done(extensions, k)
        )
        extensions = in_group_order(extensions)
        self.live = [self.extend(beams[e.parent], e, rows[e.parent]) for e in extensions]
        if done:
            self.results = self._best(self.live)
        return BeamStep(extensions, done)

    def fail(self) -> None:
        """The request's step failed: its live beams become its results, with
        finish_reason "error"."""
        if self.results is None:
            self.results = [Hypothesis(beam, float("-inf"), "error") for beam in self.live]

    def extend(self, beam: Beam, extension: Extension, candidates: Candidates) -> Beam:
        """The beam `extension` makes of its parent `beam`, recording the step's candidates."""
        return Beam(beam.output_token_ids + [extension.token], extension.cum_logprob,
                    beam.candidates + [candidates])

    def _best(self, live: list[Beam]) -> list[Hypothesis]:
        """The best hypotheses, best first, at most beam_width: with vLLM's scoring the
        live beams compete too; with transformers' they were all finished at the end."""
        hypotheses = list(self.finished)
        if self.params.scoring == "vllm":
            hypotheses += [Hypothesis(beam, self._vllm_score(beam), "length") for beam in live]
        hypotheses.sort(key=lambda h: h.score, reverse=True)
        return hypotheses[: self.params.beam_width]

    # vLLM ---------------------------------------------------------------------------

    def _vllm_score(self, beam: Beam) -> float:
        """vLLM's score; as in vLLM, a final EOS is not counted even under ignore_eos."""
        tokens = beam.output_token_ids
        length = self.prompt_len + len(tokens) - int(tokens[-1] in self.eos_token_ids)
        return vllm_score(beam.cum_logprob, length, self.params.length_penalty)

    def _step_vllm(self, candidates):
        """Every EOS candidate finishes; the best beam_width of the others by score live on."""
        ended = [(c, "stop") for c in candidates if c[2] in self.eos]
        running = [c for c in candidates if c[2] not in self.eos]
        length = self.prompt_len + self.num_steps + 1

        def score(candidate):
            cum, _, token = candidate
            return vllm_score(cum, length - int(token in self.eos_token_ids),
                              self.params.length_penalty)

        best = heapq.nlargest(self.params.beam_width, running, key=score)
        return [Extension(parent, token, cum) for cum, parent, token in best], ended

    # transformers --------------------------------------------------------------------

    def _step_transformers(self, candidates):
        width, k = self.params.beam_width, self.num_candidates
        top = heapq.nlargest(k, candidates, key=lambda c: c[0])
        last_step = self.num_steps + 1 >= self.max_tokens
        ends = [last_step or token in self.eos for _, _, token in top]
        # Ending candidates stay in the ranking at -1e9, so they fill in only when
        # fewer than beam_width others exist, exactly as transformers ranks them.
        ranked = sorted(
            range(len(top)), key=lambda i: top[i][0] + (_MASKED if ends[i] else 0.0), reverse=True
        )
        extensions = [Extension(top[i][1], top[i][2], top[i][0]) for i in ranked[:width]]
        self._best_running = top[ranked[0]][0] + (_MASKED if ends[ranked[0]] else 0.0)
        accepting = self._improvable and not (
            self.params.early_stopping is True and len(self.finished) == width
        )
        ended = []
        if accepting:
            ended = [(top[i], "stop" if top[i][2] in self.eos else "length")
                     for i in range(min(width, len(top))) if ends[i]]
        self._all_end = all(ends)
        return extensions, ended

    def _prune_finished(self) -> None:
        width = self.params.beam_width
        self.finished = heapq.nlargest(width, self.finished, key=lambda h: h.score)

    def _transformers_done(self, extensions: list[Extension], k: int) -> bool:
        """transformers' stopping rule, checked after the step."""
        params, width = self.params, self.params.beam_width
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_steps
        best_possible = self._best_running / best_length**params.length_penalty
        if len(self.finished) == width:
            worst = min(h.score for h in self.finished)
            self._improvable = self._improvable and best_possible > worst
        all_finished = len(self.finished) == width
        return not self._improvable or (params.early_stopping is True and all_finished) or (
            self._all_end
        )

    # Both ----------------------------------------------------------------------------

    def _record(self, beams, rows, candidate, reason: str) -> None:
        cum, parent, token = candidate
        beam = self.extend(beams[parent], Extension(parent, token, cum), rows[parent])
        if self.params.scoring == "vllm":
            score = self._vllm_score(beam)
        else:
            score = cum / len(beam.output_token_ids) ** self.params.length_penalty
        self.finished.append(Hypothesis(beam, score, reason))


def choose_beams(searches: dict[str, BeamSearch], plan: SchedulerOutput,
                 sampled: SamplerOutput, draw_rows: list[range]
                 ) -> tuple[dict[str, BeamChoice], dict[str, list[Hypothesis]]]:
    """Each drawing beam search's next beams, from its rows of `sampled` (draw_rows: each
    draw's); the results of those that ended, which leave `searches`."""
    choices, results, first = {}, {}, 0
    for group, rows in plan.draws:
        # A beam's draw is one row: the group's rows follow each other.
        draws = slice(draw_rows[first].start, draw_rows[first + len(rows) - 1].stop)
        first += len(rows)
        if not group.is_beam_search:
            continue
        search = searches[group.request_id]
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
            del searches[group.request_id]
    return choices, results
