"""benchmarks.startup --quick on a tiny model: every code path runs, and the report's
figures agree with the workload and with each other."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.throughput import mixed_workload
from tests.plugins.hf_models import tiny_tokenizer

# A benchmark run: the full tier.
pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tiny_llama_dir) -> dict:
    command = [sys.executable, "-m", "benchmarks.startup", "--quick", "--model",
               str(tiny_llama_dir)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    stdout = subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True, timeout=600).stdout
    return json.loads(stdout)  # the script prints its JSON alone on stdout


def test_mixed_workloads_count_every_requested_token(report, tiny_llama_dir):
    settings = report["settings"]
    for dataset in ("sharegpt", "alpaca"):
        workload = mixed_workload(settings["num_requests"], settings["scale"],
                                  len(tiny_tokenizer()),
                                  settings["seed"], settings["seed"] + 1, dataset,
                                  settings["max_total_len"])
        expected = sum(output_len for _, output_len in workload)
        for system in ("jpaged", "transformers"):
            assert report[system]["mixed"][dataset]["output_tokens"] == expected


def test_ratios_are_jpaged_over_transformers(report):
    ours, theirs = report["jpaged"], report["transformers"]
    for dataset, ratio in report["mixed_ratio_vs_transformers"].items():
        assert ratio == pytest.approx(ours["mixed"][dataset]["output_tokens_per_s"]
                                      / theirs["mixed"][dataset]["output_tokens_per_s"])
    assert report["peak_rss_ratio_vs_transformers"] == pytest.approx(
        ours["peak_rss_mib"] / theirs["peak_rss_mib"])
    rounds = zip(ours["batch1"]["rounds"], theirs["batch1"]["rounds"], strict=True)
    round_ratios = [mine["output_tokens_per_s"] / peer["output_tokens_per_s"]
                    for mine, peer in rounds]
    assert report["batch1_ratio_vs_transformers"] == pytest.approx(statistics.median(round_ratios))


def test_bf16_agreement_is_reported_per_prompt(report):
    bf16 = report["bf16"]
    positions = bf16["first_differing_position"]
    assert len(positions) == bf16["prompts"]
    assert all(p is None or 0 <= p < bf16["tokens_per_prompt"] for p in positions)
    assert bf16["identical_outputs_rate"] == sum(p is None for p in positions) / len(positions)


def test_cli_time_is_the_median_of_its_runs(report):
    cli = report["generate_cli_s"]
    assert len(cli["runs_s"]) == report["settings"]["cli_runs"]
    assert cli["median_s"] == statistics.median(cli["runs_s"]) > 0


def test_cold_warmup_reports_its_shapes_and_an_aliased_cache(report):
    warmup = report["warmup"]
    assert report["cold_warmup_s"] == warmup["cold_warmup_s"] > 0
    assert warmup["num_step_shapes"] > 0
    # The donated cache comes back aliased, not copied.
    assert warmup["decode_step_memory"]["alias_bytes"] == warmup["decode_step_memory"][
        "kv_cache_bytes"]
