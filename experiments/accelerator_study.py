"""Figure 12 where a CPU cannot go: the simulator on a device's step-cost clock.

The sweep's `accelerators` study, after the rate study (whose engine runs it needs):

1. Calibration: the project's CPU gets peaks measured in the run (a float32
   matmul, a streaming read), then `step_cost.fit` finds its achieved fractions
   and overhead from the rate study's engine steps (their shapes and measured
   seconds, compiling steps left out). Runs alternate between two folds; each
   fold's fit predicts the other fold's steps, and the study reports the median
   and 90th-percentile relative error of those held-out predictions. The final
   calibration is fitted to every run.
2. The CPU check: the simulator, on that calibrated clock, runs the rate study's
   ShareGPT-like requests, pool and limits under the rate study's rules
   (experiments.rate_study: capacity all at once, the threshold from paged's
   unloaded run, the bracketing search), its Orca policies reserving paged
   blocks as the engine's do; its rate ratios stand beside the engine's. The
   same requests, pool and model (in bfloat16) then run on an A100's clock: the
   ratios the clock alone changes.
3. Figure 12 in simulation: OPT-13B on an A100-40GB with the paper's KV pool, on
   ShareGPT-like and Alpaca-like requests at full length, paged against the
   three Orca policies on contiguous slabs (the paper's Orca), beside the
   paper's ratios. The device's efficiencies are assumed (step_cost.ASSUMED).
4. Projections: a Llama-3-8B-shaped model on an H200 and a TPU v5e-4, its KV
   pool what 90% of the memory leaves past the weights; a benchmarks.accelerator
   report from one of them (--device-calibration) replaces the assumed
   efficiencies with the ones fitted there.

Every simulation of a step of the search runs in a worker process (--jobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments import rate_study
from experiments.engine_runs import read_step_log
from experiments.paper import FIGURE1_KV_CACHE_SHARE, FIGURE12_SHAREGPT_RATE_RATIO
from experiments.rate_study import RateSettings
from experiments.simulator import SimConfig, simulate
from experiments.step_cost import (
    ASSUMED,
    DEVICES,
    LLAMA3_8B,
    OPT_13B,
    Calibration,
    Device,
    ModelShape,
    StepCost,
    StepShape,
    error_summary,
    fit,
    relative_errors,
)
from experiments.workloads import VOCAB_SIZE
from jpaged.core.step_shapes import default_buckets

PAPER_DEVICE = "a100-40gb"
PROJECTED_DEVICES = ("h200", "tpu-v5e-4")
# Full-length requests; vLLM's sequence cap, OPT's context, a chunk of a context's size.
PAPER_LIMITS = dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
                    max_model_len=2048, length_scale_override=1.0)
PROJECTION_LIMITS = dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
                         max_model_len=8192, length_scale_override=1.0)
REQUESTS = {"sharegpt": 1000, "alpaca": 2000}
QUICK_REQUESTS = {"sharegpt": 150, "alpaca": 300}
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXT = 512
FIGURE_POINTS = 2000  # held-out steps kept for the calibration's figure


@dataclass(frozen=True)
class Scenario:
    """One server simulated under the rate study's rules."""

    name: str
    settings: RateSettings
    pool_tokens: int
    cost: StepCost
    orca_blocks: bool
    vocab_size: int = VOCAB_SIZE


def sim_config(scenario: Scenario, policy: str) -> SimConfig:
    settings = scenario.settings
    return SimConfig(allocator=policy, block_size=settings.block_size,
                     num_kv_slots=scenario.pool_tokens, max_num_seqs=settings.max_num_seqs,
                     max_num_batched_tokens=settings.max_num_batched_tokens,
                     max_model_len=settings.max_model_len, step_cost=scenario.cost,
                     orca_blocks=scenario.orca_blocks, seed=settings.seed)


def point(scenario: Scenario, policy: str, rate: float, fraction: float | None) -> dict:
    """One simulation of the scenario's requests at `rate` (inf: all at once)."""
    requests = rate_study.workload(scenario.settings, scenario.vocab_size, rate)
    result = simulate(requests, sim_config(scenario, policy))
    return {"request_rate": rate, "capacity_fraction": fraction,
            "normalized_latency_s_mean": result.mean_normalized_latency_s,
            "mean_running_requests": result.mean_running_requests,
            "mean_kv_utilization_pct": 100 * result.mean_kv_utilization,
            "num_preemptions": result.num_preemptions, "num_steps": result.num_steps,
            "simulated_s": result.simulated_s, "wall_s": result.wall_s}


def _at_once(task: tuple[Scenario, str]) -> dict:
    scenario, policy = task
    return point(scenario, policy, float("inf"), None)


def _at_fraction(task: tuple[Scenario, str, float, float]) -> dict:
    scenario, policy, capacity, fraction = task
    return point(scenario, policy, fraction * capacity, fraction)


def _search(task: tuple[Scenario, str, float, float, dict]) -> list[dict]:
    scenario, policy, capacity, threshold, points = task
    return rate_study.search_curve(
        lambda fraction: _at_fraction((scenario, policy, capacity, fraction)),
        scenario.settings, threshold, points)


def run_scenarios(scenarios: list[Scenario], jobs: int) -> dict[str, dict]:
    """Every scenario under the rate study's rules, its simulations spread over `jobs`
    processes: capacities, then paged's unloaded runs, then each policy's search."""
    # Spawned, not forked: this process already runs JAX's threads.
    executor = None
    if jobs > 1:
        executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    map_ = executor.map if executor else map
    try:
        pairs = [(s, policy) for s in scenarios for policy in s.settings.policies]
        at_once = dict(zip(((s.name, p) for s, p in pairs), map_(_at_once, pairs), strict=True))
        capacity = {(s.name, p): s.settings.num_requests / at_once[s.name, p]["simulated_s"]
                    for s, p in pairs}
        bases = dict(zip((s.name for s in scenarios), map_(_at_fraction, [
            (s, "paged", capacity[s.name, "paged"], s.settings.base_fraction)
            for s in scenarios]), strict=True))
        threshold = {s.name: rate_study.threshold_of(bases[s.name], s.settings)
                     for s in scenarios}
        searches = [(s, p, capacity[s.name, p], threshold[s.name],
                     {s.settings.base_fraction: bases[s.name]} if p == "paged" else {})
                    for s, p in pairs]
        curves = dict(zip(((s.name, p) for s, p in pairs), map_(_search, searches), strict=True))
    finally:
        if executor:
            executor.shutdown()
    results = {}
    for s in scenarios:
        policies = s.settings.policies
        result = {
            "device": s.cost.device.name, "device_source": s.cost.device.source,
            "model": s.cost.model.name, "calibration": s.cost.calibration.source,
            "orca_memory": "paged blocks reserved" if s.orca_blocks else "contiguous slabs",
            "settings": dataclasses.asdict(s.settings) | {"length_scale": s.settings.length_scale},
            "pool_tokens": s.pool_tokens,
            "capacity_requests_per_s": {p: capacity[s.name, p] for p in policies},
            "all_at_once": {p: at_once[s.name, p] for p in policies},
            "decode_step_ms": decode_step_ms(s.cost),
        }
        result["capacity_ratios"] = rate_study.ratios_to_paged(
            result["capacity_requests_per_s"], "capacity_ratio_vs_")
        result |= rate_study.curves_result("paged", bases[s.name], threshold[s.name],
                                           {p: curves[s.name, p] for p in policies}, s.settings)
        result["rate_ratios"] = rate_study.rate_ratios(result["sustained_rate"])
        results[s.name] = result
    return results


def decode_step_ms(cost: StepCost, batches: Iterable[int] = DECODE_BATCHES,
                   context: int = DECODE_CONTEXT) -> dict[str, float]:
    """The modelled decode step (ms) at each batch, every sequence at `context` tokens:
    how much a step grows with the batch on the device."""
    buckets = default_buckets("xla", 1, max(batches))
    return {str(batch): 1e3 * cost.seconds(StepShape.of([1] * batch, [context] * batch,
                                                         buckets, 16))
            for batch in batches}


# Calibration on the project's CPU.


def measure_cpu(repeats: int = 5) -> Device:
    """This machine's CPU with peaks measured now: the best float32 matmul FLOP/s and the
    best streaming-read bytes/s XLA reaches (the engine's own compiler)."""
    import jax
    import jax.numpy as jnp

    n, read_bytes = 2048, 256 * 2**20
    a = jnp.ones((n, n), jnp.float32)
    x = jnp.ones(read_bytes // 4, jnp.float32)
    matmul, total = jax.jit(lambda a: a @ a), jax.jit(jnp.sum)

    def best(fn, arg) -> float:
        fn(arg).block_until_ready()
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn(arg).block_until_ready()
            times.append(time.perf_counter() - began)
        return min(times)

    flops = 2 * n**3 / best(matmul, a)
    bandwidth = read_bytes / best(total, x)
    return Device(f"this machine's CPU ({os.cpu_count()} cores)", peak_flops=flops,
                  peak_bandwidth=bandwidth, memory_bytes=0.0,
                  source=f"measured in this run: the best of {repeats} float32 {n}x{n} "
                         f"matmuls ({flops / 1e9:.0f} GFLOP/s) and reads of "
                         f"{read_bytes >> 20} MiB ({bandwidth / 1e9:.1f} GB/s) under XLA")


def engine_step_logs(figure12: dict) -> list[dict]:
    """The step log of every engine run of the rate study, in the order run."""
    logs = []
    for result in figure12.values():
        logs += [summary["step_log"] for summary in result["all_at_once"].values()]
        logs += [p["step_log"] for points in result.get("curves", {}).values() for p in points]
    return logs


def usable_steps(columns: dict) -> tuple[list[StepShape], list[float]]:
    """A run's steps that ran sequences and compiled nothing."""
    shapes, seconds, compiled = read_step_log(columns)
    kept = [i for i, shape in enumerate(shapes) if shape.query_lens and not compiled[i]]
    return [shapes[i] for i in kept], [seconds[i] for i in kept]


def calibrate(figure12: dict, cost: StepCost) -> tuple[Calibration, dict]:
    """The CPU's calibration fitted to every rate-study run, and its held-out errors:
    runs alternate between two folds, each fold's fit predicts the other's steps."""
    runs = [usable_steps(log) for log in engine_step_logs(figure12)]
    folds = [runs[0::2], runs[1::2]]
    held_out = {"decode": [], "prefill": [], "measured_s": [], "predicted_s": []}
    for train, test in ((folds[0], folds[1]), (folds[1], folds[0])):
        shapes, seconds = _pooled(train)
        fitted = dataclasses.replace(cost, calibration=fit(cost, shapes, seconds, "fold"))
        shapes, seconds = _pooled(test)
        errors = relative_errors(fitted, shapes, seconds)
        for phase in ("decode", "prefill"):
            held_out[phase] += [e for e, s in zip(errors, shapes, strict=True)
                                if s.is_decode == (phase == "decode")]
        held_out["measured_s"] += seconds
        held_out["predicted_s"] += [fitted.seconds(shape) for shape in shapes]
    shapes, seconds = _pooled(runs)
    calibration = fit(cost, shapes, seconds,
                      f"fitted to {len(seconds)} steps of {len(runs)} engine runs "
                      "(SmolLM2-135M, float32, the rate study's)")
    stride = max(1, len(held_out["measured_s"]) // FIGURE_POINTS)
    errors = {phase: error_summary(np.asarray(held_out[phase])) for phase in ("decode",
                                                                              "prefill")}
    errors["all"] = error_summary(np.asarray(held_out["decode"] + held_out["prefill"]))
    return calibration, {
        "device": device_summary(cost.device), "model": cost.model.name,
        "num_runs": len(runs), "num_steps": len(seconds),
        "calibration": calibration.as_dict(),
        "held_out_error": errors,
        "held_out_rule": "runs alternate between two folds; each fold's fit predicts the "
                         "other's steps (split by run, not by step)",
        "held_out_steps": {key: held_out[key][::stride]
                           for key in ("measured_s", "predicted_s")},
    }


def _pooled(runs: list[tuple[list[StepShape], list[float]]]
            ) -> tuple[list[StepShape], list[float]]:
    shapes = [shape for run_shapes, _ in runs for shape in run_shapes]
    seconds = [s for _, run_seconds in runs for s in run_seconds]
    return shapes, seconds


# The study.


def paper_pool_tokens() -> int:
    """The paper's KV memory for OPT-13B on an A100-40GB (Figure 1's share of the 40 GB),
    in tokens."""
    cost = StepCost(DEVICES[PAPER_DEVICE], OPT_13B)
    kv_bytes = FIGURE1_KV_CACHE_SHARE * cost.device.memory_bytes
    return int(kv_bytes // (OPT_13B.num_layers * OPT_13B.kv_bytes_per_token_layer))


def device_calibrations(path: Path | None) -> dict[str, Calibration]:
    """Calibrations a benchmarks.accelerator report fitted, by device key."""
    if path is None:
        return {}
    fitted = json.loads(path.read_text())["sections"]["step_cost"]
    return {fitted["device_key"]: Calibration.from_dict(fitted["calibration"])}


def scenarios(figure12: dict, cpu_cost: StepCost, quick: bool, seed: int,
              calibrations: dict[str, Calibration]) -> list[Scenario]:
    requests = QUICK_REQUESTS if quick else REQUESTS
    engine = figure12["sharegpt"]
    engine_settings = {k: v for k, v in engine["settings"].items() if k != "length_scale"}
    engine_settings["rate_fractions"] = tuple(engine_settings["rate_fractions"])
    engine_settings["policies"] = tuple(engine_settings["policies"])
    check = Scenario("cpu-smollm2-sharegpt", RateSettings(**engine_settings),
                     engine["pool_tokens"], cpu_cost, orca_blocks=True,
                     vocab_size=cpu_cost.model.vocab_size)
    # The same requests, pool and model on an A100's clock, where a step hardly grows with
    # the batch: what the clock alone changes in the ratios.
    a100 = StepCost(DEVICES[PAPER_DEVICE], dataclasses.replace(cpu_cost.model, dtype_bytes=2))
    out = [check, dataclasses.replace(check, name="a100-smollm2-sharegpt", cost=a100)]
    paper_pool = paper_pool_tokens()
    for dataset in ("sharegpt", "alpaca"):
        settings = RateSettings(dataset, num_requests=requests[dataset], seed=seed,
                                **PAPER_LIMITS)
        out.append(Scenario(f"a100-opt13b-{dataset}", settings, paper_pool,
                            StepCost(DEVICES[PAPER_DEVICE], OPT_13B), orca_blocks=False))
    for key in PROJECTED_DEVICES:
        cost = StepCost(DEVICES[key], LLAMA3_8B, calibrations.get(key, ASSUMED))
        settings = RateSettings("sharegpt", num_requests=requests["sharegpt"], seed=seed,
                                **PROJECTION_LIMITS)
        out.append(Scenario(f"{key}-llama3-8b-sharegpt", settings, cost.kv_pool_tokens(), cost,
                            orca_blocks=False))
    return out


def run(figure12: dict, model: ModelShape, args: argparse.Namespace) -> dict:
    """The study's JSON section (needs the rate study's ShareGPT-like curves)."""
    began = time.perf_counter()
    cpu = StepCost(measure_cpu(), model)
    calibration, calibration_report = calibrate(figure12, cpu)
    cpu = dataclasses.replace(cpu, calibration=calibration)
    results = run_scenarios(scenarios(figure12, cpu, args.quick, args.seed,
                                      device_calibrations(args.device_calibration)), args.jobs)
    check = results["cpu-smollm2-sharegpt"]
    engine_ratios = figure12["sharegpt"]["rate_ratios"]
    check["engine_rate_ratios"] = engine_ratios
    check["sim_minus_engine_rate_ratio"] = {
        key: check["rate_ratios"][key] - engine_ratios[key]
        for key in engine_ratios if not key.endswith("_bound")}
    results["a100-opt13b-sharegpt"]["paper_rate_ratios"] = {
        key: [span.low, span.high] for key, span in FIGURE12_SHAREGPT_RATE_RATIO.items()}
    return {"calibration": calibration_report, "devices": {
                key: device_summary(device) for key, device in DEVICES.items()},
            "paper_pool_rule": f"{FIGURE1_KV_CACHE_SHARE:.0%} of the A100's 40 GB (Figure 1)",
            "projection_pool_rule": "90% of the device memory less the weights",
            "scenarios": results, "wall_s": time.perf_counter() - began}


def device_summary(device: Device) -> dict:
    """A device's figures in the units its table shows (TFLOP/s, GB/s, GiB)."""
    return {"name": device.name, "num_chips": device.num_chips,
            "peak_tflops": device.peak_flops / 1e12, "peak_gb_s": device.peak_bandwidth / 1e9,
            "memory_gib": device.memory_bytes / 2**30,
            "interconnect_gb_s": device.interconnect_bandwidth / 1e9, "source": device.source}


def _f(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(section: dict) -> dict:
    """{table: (title, rows)} of the study."""
    calibration = section["calibration"]
    errors = calibration["held_out_error"]
    fit_rows = [{"phase": phase, "compute_fraction": _f(values["compute"]),
                 "bandwidth_fraction": _f(values["bandwidth"]),
                 "overhead_ms": _f(1e3 * values["overhead_s"], 2),
                 "held_out_steps": errors[phase]["num_steps"],
                 "held_out_median_err_pct": _f(errors[phase]["median_pct"], 1),
                 "held_out_p90_err_pct": _f(errors[phase]["p90_pct"], 1)}
                for phase, values in calibration["calibration"].items() if phase != "source"]
    rate_rows = []
    for name, result in section["scenarios"].items():
        ratios, engine = result["rate_ratios"], result.get("engine_rate_ratios", {})
        paper = result.get("paper_rate_ratios", {})
        for policy in result["settings"]["policies"]:
            key = "rate_ratio_vs_" + policy.replace("-", "_")
            sustained = result["sustained_rate"][policy]
            rate_rows.append({
                "scenario": name, "policy": policy, "pool_tokens": result["pool_tokens"],
                "capacity_req_s": _f(result["capacity_requests_per_s"][policy]),
                "sustained_req_s": _f(sustained["rate"]), "bound": sustained["bound"],
                "capacity_paged_over_policy": _f(result["capacity_ratios"].get(
                    key.replace("rate_ratio", "capacity_ratio")), 2),
                "paged_over_policy": _f(ratios.get(key), 2),
                "engine_paged_over_policy": _f(engine.get(key), 2),
                "paper": "-" if key not in paper else "{:g}-{:g}".format(*paper[key])})
    step_rows = [{"scenario": name, "device": r["device"], "model": r["model"],
                  **{f"decode_ms_batch_{b}": _f(ms, 1) for b, ms in r["decode_step_ms"].items()}}
                 for name, r in section["scenarios"].items()]
    device_rows = [{"device": d["name"], "chips": d["num_chips"],
                    "peak_tflops": _f(d["peak_tflops"], 1), "peak_gb_s": _f(d["peak_gb_s"], 0),
                    "memory_gib": _f(d["memory_gib"], 0),
                    "interconnect_gb_s": _f(d["interconnect_gb_s"], 0), "source": d["source"]}
                   for d in [*section["devices"].values(), calibration["device"]]]
    return {
        "accelerators_calibration": (
            "Step-cost calibration on this CPU: achieved fractions of the measured peaks, "
            "fitted to the rate study's engine steps; errors on runs held out", fit_rows),
        "accelerators_rates": (
            "Figure 12 in simulation: sustained request rates under the rate study's rules",
            rate_rows),
        "accelerators_decode_steps": (
            f"Modelled decode step (ms) by batch, every sequence at {DECODE_CONTEXT} tokens",
            step_rows),
        "accelerators_devices": ("Devices of the step-cost model", device_rows),
    }


def summary_rows(section: dict | None) -> list[dict]:
    """The study's headline numbers for the sweep's summary (none without the study)."""
    if section is None:
        return []
    error = section["calibration"]["held_out_error"]["all"]
    rows = [{"measure": "step-cost model, held-out engine steps, median / p90 error (%)",
             "value": f"{error['median_pct']:.1f} / {error['p90_pct']:.1f}", "paper": "-"}]
    check = section["scenarios"]["cpu-smollm2-sharegpt"]
    for key, engine in check["engine_rate_ratios"].items():
        if not key.endswith("_bound"):
            rows.append({"measure": f"{key}, simulated on this CPU (engine {engine:.2f})",
                         "value": _f(check["rate_ratios"][key], 2), "paper": "-"})
    on_a100 = section["scenarios"]["a100-smollm2-sharegpt"]["rate_ratios"]
    for key in ("rate_ratio_vs_orca_oracle", "rate_ratio_vs_orca_max"):
        rows.append({"measure": f"{key}, the same requests and pool on an A100's clock "
                               f"({on_a100[key + '_bound']})",
                     "value": _f(on_a100[key], 2), "paper": "-"})
    paper = section["scenarios"]["a100-opt13b-sharegpt"]
    for key, (low, high) in paper["paper_rate_ratios"].items():
        ratio_key = "rate_ratio_" + key
        rows.append({"measure": f"{ratio_key}, simulated OPT-13B on an A100 "
                               f"({paper['rate_ratios'][ratio_key + '_bound']})",
                     "value": _f(paper["rate_ratios"][ratio_key], 2),
                     "paper": f"{low:g}-{high:g}"})
    return rows
