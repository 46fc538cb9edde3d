"""The near-tie rule of tests/references/compare.py on the stored SmolLM2 reference and
copies of it changed by hand: a changed token or log-probability fails unless the
reference's candidates there lie within the tie threshold. No model runs here."""

from __future__ import annotations

import copy

import pytest

from tests.references.compare import (
    ATOL,
    BEAM_TIE,
    TIE,
    Mismatch,
    beam_gaps,
    compare_beam,
    compare_greedy,
    compare_references,
    load_reference,
)

REFERENCE = load_reference("smollm2")
EOS = REFERENCE["eos_token_ids"]


def stored_logprobs(case) -> list[dict[int, float]]:
    return [dict(zip(ids, values, strict=True))
            for ids, values in zip(case["top_ids"], case["top_logprobs"], strict=True)]


def clear_step(case) -> int:
    """A step whose best two candidates lie far apart."""
    return next(step for step, values in enumerate(case["top_logprobs"])
                if values[0] - values[1] > 100 * TIE)


def test_the_stored_reference_matches_itself_without_ties():
    assert compare_references(REFERENCE, REFERENCE) == {"greedy": 0, "top-k boundary": 0,
                                                        "beam": 0}


def test_the_stored_greedy_tokens_are_each_steps_best():
    for case in REFERENCE["greedy"]:
        assert case["tokens"] == [ids[0] for ids in case["top_ids"]]
        assert all(values == sorted(values, reverse=True) for values in case["top_logprobs"])


@pytest.mark.parametrize("case_index", range(len(REFERENCE["greedy"])))
def test_one_changed_token_fails_unless_at_a_near_tie(case_index):
    case = REFERENCE["greedy"][case_index]
    step = clear_step(case)
    tokens = list(case["tokens"])
    tokens[step] = case["top_ids"][step][1]  # the runner-up, far behind
    with pytest.raises(Mismatch, match=f"step {step}: .* not a near tie"):
        compare_greedy(case, tokens, stored_logprobs(case))

    # The same change where the stored best two lie within the threshold: accepted once,
    # and the steps after it (a different text) are not compared.
    tied = copy.deepcopy(case)
    values = tied["top_logprobs"][step]
    values[1] = values[0] - TIE / 2
    tokens[step + 1:] = [0] * (len(tokens) - step - 1)
    assert compare_greedy(tied, tokens) == (1, 0)


@pytest.mark.parametrize("case_index", range(len(REFERENCE["greedy"])))
def test_one_changed_stored_token_fails(case_index):
    """The reference changed, our tokens the true ones: the stored token is not among
    the stored candidates, or far from ours."""
    case = REFERENCE["greedy"][case_index]
    step = clear_step(case)
    changed = copy.deepcopy(case)
    changed["tokens"][step] += 1
    with pytest.raises(Mismatch, match=f"step {step}: .* not a near tie"):
        compare_greedy(changed, case["tokens"], stored_logprobs(case))
    changed["tokens"][step] = case["top_ids"][step][1]
    with pytest.raises(Mismatch, match=f"step {step}: .* not a near tie"):
        compare_greedy(changed, case["tokens"], stored_logprobs(case))


def test_a_logprob_off_by_more_than_the_tolerance_fails():
    case = REFERENCE["greedy"][0]
    logprobs = stored_logprobs(case)
    token = case["top_ids"][3][2]
    logprobs[3][token] += 0.9 * ATOL
    assert compare_greedy(case, case["tokens"], logprobs) == (0, 0)
    logprobs[3][token] += 0.2 * ATOL
    with pytest.raises(Mismatch, match=f"step 3: token {token} has log-probability"):
        compare_greedy(case, case["tokens"], logprobs)


def test_a_top_k_token_swapped_at_the_boundary_needs_a_near_tie():
    case = REFERENCE["greedy"][0]
    logprobs = stored_logprobs(case)
    fifth = case["top_ids"][2][4]
    del logprobs[2][fifth]
    logprobs[2][99] = case["top_logprobs"][2][4] - TIE / 2  # a sixth just below the fifth
    assert compare_greedy(case, case["tokens"], logprobs) == (0, 1)
    logprobs[2][99] = case["top_logprobs"][2][4] + 2 * TIE
    with pytest.raises(Mismatch, match="step 2: token 99 .* not a near tie"):
        compare_greedy(case, case["tokens"], logprobs)


@pytest.mark.parametrize("case_index", range(len(REFERENCE["beams"])))
def test_a_changed_best_beam_fails_unless_the_search_met_a_near_tie(case_index):
    case = REFERENCE["beams"][case_index]
    tokens = list(case["tokens"])
    tokens[2] += 1
    assert min(gap for _, gap in beam_gaps(case, EOS)) >= BEAM_TIE
    with pytest.raises(Mismatch, match="met no near tie"):
        compare_beam(case, tokens, EOS)
    tied = copy.deepcopy(case)
    scores = tied["candidate_scores"][5]
    scores[case["beam_width"]] = scores[case["beam_width"] - 1] - BEAM_TIE / 2
    assert compare_beam(tied, tokens, EOS) == 1
