"""benchmarks.decode_loop --quick: every system runs, outputs agree, and the host round
trips per token are what one prefill step plus decode steps or loops of 4 and 16 give."""

from __future__ import annotations

import json

import pytest

from benchmarks import decode_loop

# A benchmark run: the full tier.
pytestmark = pytest.mark.full


def test_quick_run_counts_the_round_trips():
    report = decode_loop.main(["--quick"])
    json.loads(json.dumps(report, allow_nan=False))
    batches = report["results"]["tiny"]
    assert set(batches) == {"batch_8"}
    tokens = report["settings"]["max_tokens"]  # 16: one prefill step draws the first
    for batch, rows in batches.items():
        size = int(batch.split("_")[1])
        # Async scheduling finishes as many steps as single steps, plus one wasted step
        # at most (planned before the last tokens were known): here none, at max_tokens.
        expected = {"single": tokens, "loop4": 1 + -(-(tokens - 1) // 4),
                    "loop16": 1 + -(-(tokens - 1) // 16), "async": tokens}
        for name, row in rows.items():
            assert row["tokens_equal_single"]
            assert row["round_trips_per_token"] == pytest.approx(
                expected[name] / (size * tokens))
            assert 0 < row["host_share"] < 1 and row["host_ms_per_token"] > 0
    assert "tiny_batch8_loop16_vs_single" in report["targets"]
