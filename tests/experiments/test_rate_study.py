"""The rate study's search and interpolation against brute force on known curves.

A latency curve here is any non-decreasing sequence on the ladder of rate
fractions; brute force evaluates every fraction and finds the first one above
the threshold. The search must evaluate that fraction and its lower neighbour
(the bracket the interpolation needs) and no fraction beyond the bracket's side
of where it starts; the interpolation must return the crossing of the straight line through
the bracket, computed independently.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.rate_study import RateSettings, bracket_search, sustained_rate

LADDER = (0.25, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0)


@settings(max_examples=200, deadline=None)
@given(increments=st.lists(st.floats(0.0, 5.0), min_size=len(LADDER), max_size=len(LADDER)),
       threshold=st.floats(0.05, 20.0), start=st.sampled_from(LADDER))
def test_search_measures_the_bracket_brute_force_finds(increments, threshold, start):
    latencies = dict(zip(LADDER, [sum(increments[:i + 1]) for i in range(len(LADDER))],
                         strict=True))
    called = []

    def latency_at(fraction):
        called.append(fraction)
        return latencies[fraction]

    bracket_search(latency_at, LADDER, threshold, start)
    above = [f for f in LADDER if latencies[f] > threshold]
    first_above = LADDER.index(above[0]) if above else len(LADDER)
    assert len(called) == len(set(called)), "no fraction is measured twice"
    assert called[0] == start
    if 0 < first_above < len(LADDER):
        assert {LADDER[first_above - 1], LADDER[first_above]} <= set(called)
    start_index = LADDER.index(start)
    lowest, highest = min(first_above - 1, start_index), max(first_above, start_index)
    assert set(called) == set(LADDER[max(lowest, 0):min(highest, len(LADDER) - 1) + 1])


def test_sustained_rate_interpolates_the_crossing_and_says_when_it_is_a_bound():
    rates, latencies = [1.0, 2.0, 4.0], [0.1, 0.3, 1.5]
    threshold = 0.9
    slope = (1.5 - 0.3) / (4.0 - 2.0)
    expected = 2.0 + (threshold - 0.3) / slope
    assert sustained_rate(rates, latencies, threshold) == pytest.approx(
        {"rate": expected, "bound": "interpolated"})
    assert sustained_rate(rates, latencies, 0.05) == {"rate": 1.0, "bound": "at most"}
    assert sustained_rate(rates, latencies, 2.0) == {"rate": 4.0, "bound": "at least"}


@pytest.mark.parametrize("fractions", [(0.5, 2.0), (0.5, 1.4, 1.4, 2.0), (1.4, 0.5)])
def test_rate_fractions_must_ascend_and_hold_the_start(fractions):
    with pytest.raises(ValueError, match="rate_fractions"):
        RateSettings("sharegpt", rate_fractions=fractions, start_fraction=1.4)
