"""The soak benchmark, short, in CI: random traffic, aborts and injected faults leak
no block and change no completed greedy output."""

from __future__ import annotations

import pytest

from benchmarks import soak

# A benchmark run: the full tier.
pytestmark = pytest.mark.full


def test_a_short_soak_leaks_nothing(tiny_llama_dir):
    # A step floor as well as a time: a slow or cold machine still meets every event.
    result = soak.main(["--model", str(tiny_llama_dir), "--seconds", "10", "--min-steps", "600",
                        "--num-blocks", "40", "--fault-rate", "0.01"])
    assert result["leaked_blocks"] == 0, result
    assert result["greedy_mismatches"] == 0, result
    assert result["invariant_checks"] == result["steps"] > 0, result
    # A consumed KV cache is covered step by step in test_faults.
    for counter in ("completed", "errored", "aborted", "faults_injected", "greedy_checked"):
        assert result[counter] > 0, (counter, result)
    assert all(mode["preemptions"] > 0 for mode in result["by_mode"].values()), result
