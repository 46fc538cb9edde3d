"""`python -m benchmarks.accelerator --smoke`: every section runs on CPU, in interpret
mode, and reports numbers within their bounds; the report on disk is the one printed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.accelerator import GPU_OP, SMOKE, TPU_OP, engine_workload, main

ROOT = Path(__file__).resolve().parents[2]
# Max abs error of a bfloat16 decode against the float32 reference, as in test_kernels.
BF16_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[dict, dict]:
    """(the JSON printed last, the JSON written to --out) of one smoke run."""
    out = tmp_path_factory.mktemp("accelerator") / "report.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.accelerator", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


@pytest.mark.full
def test_the_report_is_written_and_printed_whole(smoke_run):
    printed, written = smoke_run
    assert printed == written
    assert set(printed["sections"]) == {"machine", "tests", "kernels", "engine", "step_cost"}
    for name, section in printed["sections"].items():
        assert "error" not in section and "timed_out" not in section, name
    assert printed["sections"]["machine"]["backend"] == "cpu"


@pytest.mark.full
def test_compiled_test_run_passes_and_skips_other_backends_kernels(smoke_run):
    tests = smoke_run[0]["sections"]["tests"]
    assert tests["passed"] >= 1 and tests["failed"] == tests["errors"] == 0
    # On CPU the Triton and TPU kernels cannot compile: their tests are skipped.
    assert tests["skipped"] >= 2 and tests["failures"] == []


@pytest.mark.full
def test_every_decode_op_measured_at_every_point_within_tolerance(smoke_run):
    kernels = smoke_run[0]["sections"]["kernels"]
    assert kernels["jpaged_implementation"] == "triton" and kernels["interpret"]
    # jax 0.12 dropped its Triton GPU ops, the GPU paged-attention op among them.
    shipped = {name for name in (GPU_OP, TPU_OP) if importlib.util.find_spec(name)}
    assert {name for name, state in kernels["jax_ops"].items() if state == "measured"} == shipped
    assert all(state.startswith("absent from jax")
               for name, state in kernels["jax_ops"].items() if name not in shipped)
    grid = {(b, c, s) for b in SMOKE.batches for c in SMOKE.contexts for s in SMOKE.block_sizes}
    assert {(p["batch"], p["context"], p["block_size"]) for p in kernels["points"]} == grid
    _, num_kv_heads, head_dim = SMOKE.attention_shape
    for point in kernels["points"]:
        # K and V, two bytes an element.
        kv_elements = point["batch"] * num_kv_heads * point["context"] * head_dim
        assert point["kv_bytes"] == 2 * kv_elements * 2
        # Mosaic GPU interpret mode needs jax >= 0.12; the XLA loop runs everywhere.
        others = {f"jpaged_{name}" for name, state in kernels["jpaged_others"].items()
                  if state == "measured"}
        assert "jpaged_xla" in others
        assert set(point["ops"]) == {"jpaged", "dense", *shipped, *others}
        for name, op in point["ops"].items():
            assert op["finite"] and op["max_abs_error"] < BF16_TOLERANCE, name
            assert op["seconds"] > 0
            assert op["bandwidth_gb_s"] == pytest.approx(point["kv_bytes"] / op["seconds"] / 1e9)
            assert op["fraction_of_peak"] is None  # a CPU has no entry in the peak table
            assert op["fraction_of_copy_bandwidth"] == pytest.approx(
                op["bandwidth_gb_s"] / kernels["copy_bandwidth_gb_s"])


@pytest.mark.full
def test_the_mixed_step_runs_every_implementation_within_tolerance(smoke_run):
    """A prefill chunk and decode rows in one ragged step: the bytes are every sequence's
    K and V once, the FLOPs the causal products' (4 per query row, key and element)."""
    kernels = smoke_run[0]["sections"]["kernels"]
    mixed = kernels["mixed"]
    prefill, decodes, context = SMOKE.mixed_step
    num_q_heads, num_kv_heads, head_dim = SMOKE.attention_shape
    assert mixed["kv_bytes"] == 2 * (1 + decodes) * num_kv_heads * context * head_dim * 2
    keys_seen = sum(context - prefill + i + 1 for i in range(prefill)) + decodes * context
    assert mixed["flops"] == 4 * num_q_heads * head_dim * keys_seen
    measured = {f"jpaged_{name}" for name, state in kernels["jpaged_others"].items()
                if state == "measured"}
    assert set(mixed["ops"]) == {f"jpaged_{kernels['jpaged_implementation']}", *measured}
    for name, op in mixed["ops"].items():
        assert op["finite"] and op["max_abs_error"] < BF16_TOLERANCE, name
        assert op["tflop_s"] == pytest.approx(mixed["flops"] / op["seconds"] / 1e12)
        assert op["fraction_of_peak_flops"] is None  # a CPU has no entry in the peak table


@pytest.mark.full
def test_engine_sides_generate_every_requested_token(smoke_run):
    engine = smoke_run[0]["sections"]["engine"]
    requested = sum(length for _, length in engine_workload(SMOKE))
    jpaged, transformers = engine["jpaged"], engine["transformers"]
    assert jpaged["output_tokens"] == transformers["output_tokens"] == requested
    assert jpaged["attention_backend"] == "triton"
    assert jpaged["compilations_during_run"] == 0
    assert engine["output_tokens_per_s_ratio"] == pytest.approx(
        jpaged["output_tokens_per_s"] / transformers["output_tokens_per_s"])
    assert transformers["device"] == "cpu"
    decode = jpaged["decode"]
    assert set(decode) == {"single", "loop8", "async"}
    tokens = SMOKE.max_num_seqs * min(SMOKE.max_model_len - 32, 64)
    assert {run["output_tokens"] for run in decode.values()} == {tokens}
    assert decode["loop8"]["round_trips_per_token"] < decode["single"]["round_trips_per_token"]


@pytest.mark.full
def test_step_cost_fits_the_engines_own_steps(smoke_run):
    """On CPU the device's peaks are measured; the fitted fractions of them lie in (0, 1]
    and the second run's steps were predicted (their error is a share, not a guess)."""
    section = smoke_run[0]["sections"]["step_cost"]
    assert section["device_key"] == "cpu" and section["device"]["peak_flops"] > 0
    assert section["run0_steps"] > 0 and section["run1_steps"] > 0
    assert section["held_out_error"]["num_steps"] == section["run1_steps"]
    assert section["held_out_error"]["median_pct"] >= 0
    for phase in ("decode", "prefill"):
        fitted = section["calibration"][phase]
        assert 0 < fitted["compute"] <= 1 and 0 < fitted["bandwidth"] <= 1
        assert fitted["overhead_s"] > 0


def test_a_time_limit_of_zero_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--time-limit", "0"])
    assert exit_info.value.code == 2
    assert "--time-limit must be > 0 seconds, got 0.0" in capsys.readouterr().err
