"""Comparing answers with a stored reference, under the suite's near-tie rule.

Two float32 implementations of one model round differently, so where two candidates are
(nearly) equally likely either may come first. A divergence is accepted only at a step
where the reference's two candidates in question lie within TIE of each other; every
helper returns how many such ties it accepted, for the test to report.

The thresholds, from what the file stores and what jpaged measured against it: values
are rounded to 4 decimal places (settings.decimals), each within 0.5e-4 of transformers'
float32 value, a difference of two within ROUNDING = 1e-4. jpaged's log-probabilities
differed from the stored ones by at most 0.9e-4 (SmolLM2) and 1.4e-4 (Gemma 3), rounding
included; the tests allow ATOL = 1e-3. Two candidates whose values each move by up to
ATOL can swap only if their reference gap is below 2 * ATOL + ROUNDING: that is TIE. A
beam's accumulated score sums up to 24 steps' log-probabilities, and their errors: jpaged's
best beams differed from the stored candidates' scores by up to 8.2e-4 (16 steps of
Gemma 3), so beams allow BEAM_ATOL = 2e-3 per score, and BEAM_TIE = 2 * BEAM_ATOL +
ROUNDING.

Plain Python: nothing of jpaged, torch or transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROUNDING = 1e-4
ATOL = 1e-3
TIE = 2 * ATOL + ROUNDING
BEAM_ATOL = 2e-3
BEAM_TIE = 2 * BEAM_ATOL + ROUNDING


class Mismatch(AssertionError):
    """An answer that differs from the reference other than at a near tie."""


def load_reference(model: str, directory: Path = HERE) -> dict[str, Any]:
    return json.loads((directory / f"{model}.json").read_text())


def compare_top(step: int, ref_ids: list[int], ref_values: list[float],
                ours: dict[int, float], atol: float = ATOL, tie: float = TIE) -> int:
    """Our top-k log-probabilities of one step (token -> value; more than k allowed, the
    best k taken) against the reference's top k. Every common token agrees within atol; a
    token in one top k and not the other must sit at the k-th place in a near tie.
    Returns the number of such boundary ties (0 or more)."""
    k = len(ref_ids)
    ours_top = sorted(ours, key=lambda token: -ours[token])[:k]
    boundary = ref_values[-1]
    ties = 0
    for token, value in zip(ref_ids, ref_values, strict=True):
        if token in ours and abs(ours[token] - value) > atol:
            raise Mismatch(f"step {step}: token {token} has log-probability "
                           f"{ours[token]:.5f}, reference {value:.5f} (atol {atol})")
        if token not in ours_top:
            if value - boundary >= tie:
                raise Mismatch(f"step {step}: token {token} (reference log-probability "
                               f"{value:.4f}) missing from the top {k}, not a near tie at "
                               f"the {k}-th place ({boundary:.4f})")
            ties += 1
    for token in ours_top:
        if token not in ref_ids and ours[token] - boundary >= tie:
            raise Mismatch(f"step {step}: token {token} (log-probability {ours[token]:.4f}) "
                           f"in the top {k}, not in the reference's, not a near tie at the "
                           f"{k}-th place ({boundary:.4f})")
    return ties


def compare_greedy(case: dict[str, Any], tokens: list[int],
                   logprobs: list[dict[int, float]] | None = None,
                   atol: float = ATOL, tie: float = TIE) -> tuple[int, int]:
    """Our greedy tokens (and, given, each step's log-probabilities) against a reference
    case. The tokens agree up to the end, or up to a step where ours is one of the
    reference's candidates within `tie` of the reference's token (a near tie: past it, the
    two continue from different texts and are not compared). Log-probabilities are compared
    up to that step. Returns (token divergences at near ties, boundary ties of the
    top-k)."""
    ref_tokens = case["tokens"]
    if len(tokens) != len(ref_tokens):
        raise Mismatch(f"{len(tokens)} tokens, reference {len(ref_tokens)}")
    boundary_ties = 0
    for step, (ours, theirs) in enumerate(zip(tokens, ref_tokens, strict=True)):
        ids, values = case["top_ids"][step], case["top_logprobs"][step]
        if logprobs is not None:
            boundary_ties += compare_top(step, ids, values, logprobs[step], atol, tie)
        if ours != theirs:
            candidates = dict(zip(ids, values, strict=True))
            if (ours not in candidates or theirs not in candidates
                    or abs(candidates[theirs] - candidates[ours]) >= tie):
                raise Mismatch(f"step {step}: token {ours}, reference {theirs} (reference "
                               f"top {list(zip(ids, values, strict=True))}), not a near tie")
            return 1, boundary_ties
    return 0, boundary_ties


def beam_gaps(case: dict[str, Any], eos: list[int]) -> list[tuple[str, float]]:
    """The reference search's gaps at its selection boundaries, (where, gap): at every
    step between the beam_width-th and the next candidate (an EOS candidate finishes only
    from the best beam_width) and between the beam_width-th and the next candidate not
    EOS (the beams that go on); and between the returned hypotheses' final scores (which
    is best)."""
    width, gaps = case["beam_width"], []
    for step, (ids, scores) in enumerate(zip(case["candidate_ids"], case["candidate_scores"],
                                             strict=True)):
        if len(scores) > width:
            gaps.append((f"step {step}", scores[width - 1] - scores[width]))
        live = [score for token, score in zip(ids, scores, strict=True) if token not in eos]
        if len(live) > width:
            gaps.append((f"step {step}, beams going on", live[width - 1] - live[width]))
    finals = case["final_scores"]
    gaps += [(f"final score {i}", finals[i] - finals[i + 1]) for i in range(len(finals) - 1)]
    return gaps


def compare_beam(case: dict[str, Any], tokens: list[int], eos: list[int],
                 tie: float = BEAM_TIE) -> int:
    """Our best beam against the reference's: equal, or the reference search met a near
    tie at one of its selection boundaries (past which either beam may win). Returns 1 for
    an accepted divergence, else 0."""
    if tokens == case["tokens"]:
        return 0
    near = [(where, gap) for where, gap in beam_gaps(case, eos) if gap < tie]
    if not near:
        smallest = min((gap for _, gap in beam_gaps(case, eos)), default=float("inf"))
        raise Mismatch(f"best beam {tokens}, reference {case['tokens']}, and the reference "
                       f"met no near tie (smallest gap {smallest:.4f}, threshold {tie})")
    return 1


def compare_references(stored: dict[str, Any], fresh: dict[str, Any]) -> dict[str, int]:
    """A freshly written reference against the stored one, as an implementation is
    compared with it: ids equal, tokens equal up to a near tie of the stored search,
    log-probabilities within ATOL. Returns the near ties accepted, by kind."""
    for key in ("model", "settings", "eos_token_ids", "tokenizer"):
        if fresh[key] != stored[key]:
            raise Mismatch(f"{key}: {fresh[key]!r}, stored {stored[key]!r}")
    ties = {"greedy": 0, "top-k boundary": 0, "beam": 0}
    greedy = [(s, f) for s, f in zip(stored["greedy"], fresh["greedy"], strict=True)]
    if "prefix_sharing" in stored:
        shared, again = stored["prefix_sharing"], fresh["prefix_sharing"]
        greedy += [(shared[key], again[key]) for key in ("first", "second")]
    for old, new in greedy:
        if old.get("prompt_ids") != new.get("prompt_ids"):
            raise Mismatch(f"prompt ids {new.get('prompt_ids')}, stored {old.get('prompt_ids')}")
        logprobs = [dict(zip(ids, values, strict=True))
                    for ids, values in zip(new["top_ids"], new["top_logprobs"], strict=True)]
        diverged, boundary = compare_greedy(old, new["tokens"], logprobs)
        ties["greedy"] += diverged
        ties["top-k boundary"] += boundary
    for old, new in zip(stored["beams"], fresh["beams"], strict=True):
        if old["prompt_ids"] != new["prompt_ids"]:
            raise Mismatch(f"prompt ids {new['prompt_ids']}, stored {old['prompt_ids']}")
        ties["beam"] += compare_beam(old, new["tokens"], stored["eos_token_ids"])
    return ties
