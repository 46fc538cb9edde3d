"""The paper's studies: memory in simulation, serving on the real engine, with figures.

    python -m experiments.sweep [--studies memory,rate,block-size,preemption,kv-dtype,sharing,
                                           accelerators,prefix,chatbot]
                                [--quick] [--out-dir results]

Studies (all but prefix and chatbot by default; --quick runs each with small
settings in a few minutes, to check the pipeline rather than the numbers: its
engine figures are titled as smoke runs):

- memory: the model-free simulator (below);
- rate: the paper's Figure 12 on the real engine (experiments.rate_study:
  each policy's capacity on ShareGPT-like and Alpaca-like requests, latency
  against rate on ShareGPT-like) and the simulator validated against the
  engine (experiments.validation);
- block-size and preemption: Figures 18 and 19 on the real engine
  (experiments.block_size_study);
- kv-dtype: float32, bfloat16 and int8 KV caches at one pool in bytes, their
  capacity and sustained rate by the rate study's rules
  (experiments.kv_dtype_study);
- sharing: Figures 14 and 15 on the real engine (experiments.sharing_study);
- accelerators: the simulator on a step-cost model of a device
  (experiments.step_cost), calibrated on this CPU by the rate study's engine
  steps (selecting it selects rate), checked against the engine's rate ratios,
  then Figure 12 for OPT-13B on an A100 and projections for a Llama-3-8B-shaped
  model on an H200 and a TPU v5e-4 (experiments.accelerator_study);
- prefix: Figure 16, translation behind a shared 1-shot or 5-shot prefix, paged
  against Orca (Oracle) on the engine and in simulation at LLaMA-13B / A100 shapes
  (experiments.prefix_study);
- chatbot: Figure 17, conversation rounds with no KV kept between them, paged
  against Orca's three policies; then the conversations replayed round after round
  with no cache, the device's prefix cache, a host tier, and a device pool of the
  tier's bytes; and a block recomputed against loaded (experiments.chatbot_study).

The real-engine studies run the default model (SmolLM2-135M-Instruct, float32)
with Poisson arrivals replayed on a virtual clock of measured step times
(experiments.engine_runs). Everything lands in --out-dir: sweep.json (the
script, command, date, machine and package versions of the run, as every
benchmark's report has them (experiments.report), then every measurement, its
settings and timings), sweep_timelines.json (each simulation's per-step
timeline, in the order of sweep.json's runs), sweep_steps.json (each engine run's
steps: sequences, context tokens, padded bucket, seconds; keyed by where the run
sits in sweep.json), one CSV per table and one PNG per
figure (experiments.figures); a summary table ends the output.

The memory study runs the model-free simulator (experiments/simulator.py)
over synthetic workloads (experiments/workloads.py: fits to the vLLM paper's
published mean lengths, not the datasets) and prints these tables:

1. Block sizes 1 to 256 on ShareGPT-like and Alpaca-like requests, plus an
   Alpaca-like workload with a one-shot shared prefix and prefix caching on:
   how much KV memory holds token states, how many sequences run at once,
   preemptions, simulated throughput and prefix-cache hit rate.
2. The paper's Figure 2: the KV memory breakdown of Orca (Max / Pow2 / Oracle)
   and jpaged on ShareGPT-like requests at block size 16, beside the paper.
3. Memory saved by sharing blocks: parallel sampling and beam search
   (n = 2, 4, 6) on Alpaca-like requests, beside the paper, and prefix sharing.
4. Sliding windows past the paper: the Figure-2 breakdown and the sequences running
   at once for a dense model, a Gemma-3-like one (3 global and 15 sliding layers,
   window 512: KV cache groups, the window's blocks freed) and one whose every layer
   slides, on ShareGPT-like requests at block size 16.
5. KV cache dtypes past the paper: the same pool in bytes holding float32,
   bfloat16, int8 or fp8 tokens (with their scales), its memory breakdown and the
   sequences running at once, on ShareGPT-like requests at block size 16.

Every run serves its requests all at once (arrival time 0), so memory is the
bottleneck; every allocator gets the same KV memory (--num-kv-slots token
slots, about what OPT-13B leaves on a 40 GB A100). The default sizes finish in
a few minutes on two cores; raise the request counts for tighter numbers.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from experiments import chatbot_study, engine_studies, figures, paper, rate_study
from experiments.paper import FIGURE2_SHAREGPT_TOKEN_STATES_PCT, FIGURE15_MEMORY_SAVED_PCT
from experiments.report import new_report
from experiments.simulator import SimConfig, simulate
from experiments.workloads import make_workload

DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GEMMA3_LIKE_LAYERS = ((512,) * 5 + (None,)) * 3
WINDOW_MODELS = {"dense": (None,), "gemma3-like": GEMMA3_LIKE_LAYERS,
                 "all-sliding": (512,)}
# K or V bytes of one token and KV head of OPT-13B (head_dim 128; the simulated pool
# of --num-kv-slots tokens is float16 there): each KV cache dtype's element, and a
# float32 scale beside the quantized ones.
KV_DTYPE_HEAD_BYTES = {"float32": 4 * 128, "bfloat16": 2 * 128, "int8": 128 + 4,
                       "fp8_e4m3": 128 + 4}
POOL_HEAD_BYTES = 2 * 128


@dataclass(frozen=True)
class Run:
    """One simulation: a table row's workload and server."""

    table: str
    dataset: str
    num_requests: int
    config: SimConfig
    workload: dict = field(default_factory=dict)
    seed: int = 0
    label: str = ""


def execute(run: Run) -> dict:
    """Simulate one run; its summary, workload and timeline as a JSON-ready dict."""
    requests = make_workload(run.dataset, run.num_requests, seed=run.seed, **run.workload)
    result = simulate(requests, run.config)
    return {
        "table": run.table,
        "label": run.label,
        "dataset": run.dataset,
        "workload": run.workload,
        **result.summary(),
        "requests_per_s": result.num_finished / result.simulated_s,
        "timeline": result.timeline,
    }


def plan_runs(args: argparse.Namespace) -> list[Run]:
    base = SimConfig(num_kv_slots=args.num_kv_slots, seed=args.seed)
    runs = []
    block_study = [
        ("sharegpt", args.sharegpt_requests, {}, False),
        ("alpaca", args.alpaca_requests, {}, False),
        ("alpaca", args.alpaca_requests, {"prefix": "one-shot"}, True),
    ]
    for dataset, num_requests, workload, prefix_caching in block_study:
        for block_size in args.block_sizes:
            config = dataclasses.replace(
                base, block_size=block_size, enable_prefix_caching=prefix_caching
            )
            runs.append(Run("block_size", dataset, num_requests, config, workload, args.seed))
    for allocator in FIGURE2_SHAREGPT_TOKEN_STATES_PCT:
        config = dataclasses.replace(base, allocator=allocator)
        runs.append(Run("figure2", "sharegpt", args.figure2_requests, config, seed=args.seed))
    for beam_search in (False, True):
        for n in (2, 4, 6):
            workload = {"n": n, "beam_search": beam_search}
            runs.append(Run("sharing", "alpaca", args.sharing_requests, base, workload, args.seed))
    for prefix in ("one-shot", "five-shot"):
        config = dataclasses.replace(base, enable_prefix_caching=True)
        workload = {"prefix": prefix}
        runs.append(Run("sharing", "alpaca", args.sharing_requests, config, workload, args.seed))
    for layer_windows in WINDOW_MODELS.values():
        config = dataclasses.replace(base, layer_windows=layer_windows)
        runs.append(Run("window", "sharegpt", args.figure2_requests, config, seed=args.seed))
    for kv_dtype, head_bytes in KV_DTYPE_HEAD_BYTES.items():
        runs.append(Run("kv_dtype", "sharegpt", args.figure2_requests,
                        kv_dtype_config(base, head_bytes), seed=args.seed, label=kv_dtype))
    return runs


def kv_dtype_config(base: SimConfig, head_bytes: int) -> SimConfig:
    """The same pool in bytes holding tokens of head_bytes per head and K or V: its
    token slots scale inversely, and a step reads head_bytes per token and head."""
    ratio = POOL_HEAD_BYTES / head_bytes
    model = dataclasses.replace(base.step_cost.model, kv_head_bytes=head_bytes)
    cost = dataclasses.replace(base.step_cost, model=model)
    return dataclasses.replace(base, num_kv_slots=int(base.num_kv_slots * ratio), step_cost=cost)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def block_size_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r["table"] != "block_size":
            continue
        prefix = r["workload"].get("prefix")
        breakdown = r["breakdown_pct"]
        rows.append(
            {
                "workload": r["dataset"] + (f"+{prefix}" if prefix else ""),
                "block_size": r["config"]["block_size"],
                "token_states_pct_of_allocated": _pct(r["token_states_of_allocated"]),
                "internal_frag_pct_of_kv": (
                    f"{breakdown['internal_fragmentation']:.1f}" if breakdown else "-"
                ),
                "mean_running_seqs": f"{r['mean_running_seqs']:.1f}",
                "preemptions": r["num_preemptions"],
                "requests_per_s": f"{r['requests_per_s']:.2f}",
                "prefix_hit_pct": _pct(r["prefix_cache_hit_rate"]),
                "memory_saved_by_sharing_pct": _pct(r["sharing_saved"]),
            }
        )
    return rows


def figure2_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r["table"] != "figure2":
            continue
        allocator, breakdown = r["config"]["allocator"], r["breakdown_pct"]
        rows.append(
            {
                "system": allocator,
                "token_states_pct": f"{breakdown['token_states']:.1f}",
                "paper_token_states_pct": FIGURE2_SHAREGPT_TOKEN_STATES_PCT[allocator],
                "reserved_pct": f"{breakdown['reserved']:.1f}",
                "internal_frag_pct": f"{breakdown['internal_fragmentation']:.1f}",
                "external_frag_and_other_pct": f"{breakdown['external_fragmentation']:.1f}",
                "token_states_pct_of_allocated": _pct(r["token_states_of_allocated"]),
                "mean_running_seqs": f"{r['mean_running_seqs']:.1f}",
                "preemptions": r["num_preemptions"],
                "requests_per_s": f"{r['requests_per_s']:.2f}",
            }
        )
    return rows


def window_rows(results: list[dict]) -> list[dict]:
    models = {layers: name for name, layers in WINDOW_MODELS.items()}
    rows = []
    for r in results:
        if r["table"] != "window":
            continue
        breakdown = r["breakdown_pct"]
        rows.append(
            {
                "model": models[tuple(r["config"]["layer_windows"])],
                "token_states_pct": f"{breakdown['token_states']:.1f}",
                "reserved_pct": f"{breakdown['reserved']:.1f}",
                "internal_frag_pct": f"{breakdown['internal_fragmentation']:.1f}",
                "external_frag_and_other_pct": f"{breakdown['external_fragmentation']:.1f}",
                "mean_running_seqs": f"{r['mean_running_seqs']:.1f}",
                "peak_running_seqs": r["peak_running_seqs"],
                "preemptions": r["num_preemptions"],
                "requests_per_s": f"{r['requests_per_s']:.2f}",
            }
        )
    return rows


def kv_dtype_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r["table"] != "kv_dtype":
            continue
        breakdown = r["breakdown_pct"]
        rows.append(
            {
                "kv_dtype": r["label"],
                "bytes_per_token_head": KV_DTYPE_HEAD_BYTES[r["label"]],
                "token_slots": r["config"]["num_kv_slots"],
                "token_states_pct": f"{breakdown['token_states']:.1f}",
                "internal_frag_pct": f"{breakdown['internal_fragmentation']:.1f}",
                "mean_running_seqs": f"{r['mean_running_seqs']:.1f}",
                "peak_running_seqs": r["peak_running_seqs"],
                "preemptions": r["num_preemptions"],
                "requests_per_s": f"{r['requests_per_s']:.2f}",
            }
        )
    return rows


def sharing_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        if r["table"] != "sharing":
            continue
        workload = r["workload"]
        if "prefix" in workload:
            kind, paper = f"prefix ({workload['prefix']})", "-"
        else:
            kind = "beam" if workload["beam_search"] else "parallel"
            paper = str(FIGURE15_MEMORY_SAVED_PCT[r["dataset"]][kind])
            kind = f"{kind} n={workload['n']}"
        rows.append(
            {
                "sharing": kind,
                "memory_saved_pct": _pct(r["sharing_saved"]),
                "paper_memory_saved_pct": paper,
                "prefix_hit_pct": _pct(r["prefix_cache_hit_rate"]),
                "mean_running_seqs": f"{r['mean_running_seqs']:.1f}",
                "preemptions": r["num_preemptions"],
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    headers = list(rows[0])
    cells = [headers] + [[str(row[h]) for h in headers] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


DEFAULT_STUDIES = ("memory", "rate", "block-size", "preemption", "kv-dtype", "sharing",
                   "accelerators")
# Run when asked for (--studies): past the README's main job's budget.
STUDIES = (*DEFAULT_STUDIES, "prefix", "chatbot")
ENGINE_STUDIES = STUDIES[1:]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=lambda s: s.split(","),
                        default=list(DEFAULT_STUDIES),
                        help=f"comma-separated, of {','.join(STUDIES)} (default "
                             f"{','.join(DEFAULT_STUDIES)})")
    parser.add_argument("--quick", action="store_true",
                        help="every study with small settings (a few minutes)")
    parser.add_argument(
        "--block-sizes",
        type=lambda s: [int(b) for b in s.split(",")],
        default=list(DEFAULT_BLOCK_SIZES),
        help="comma-separated",
    )
    parser.add_argument("--sharegpt-requests", type=int, default=1000)
    parser.add_argument("--alpaca-requests", type=int, default=2000)
    parser.add_argument("--figure2-requests", type=int, default=1000)
    parser.add_argument("--sharing-requests", type=int, default=500)
    parser.add_argument("--num-kv-slots", type=int, default=16384)
    parser.add_argument("--rate-requests", type=int, default=rate_study.NUM_REQUESTS,
                        help="requests per run of the rate study")
    parser.add_argument("--engine-requests", type=int, default=12,
                        help="requests per run of the block-size and preemption studies")
    parser.add_argument("--device-calibration", type=Path, default=None,
                        help="a benchmarks.accelerator report whose fitted step cost "
                             "replaces its device's assumed one in the accelerators study")
    parser.add_argument("--prefix-pool-scale", type=float, default=0.125,
                        help="the prefix study's pool and sequence cap as a share of the "
                             "paper's (1: its 15,728 token slots and 256 sequences)")
    parser.add_argument("--reserve-prefix", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="the prefix study's paged server reserves the prefix before "
                             "each run (else the prefix cache holds it while in use)")
    parser.add_argument("--chatbot-prompt-cut", type=int, default=128,
                        help="the chatbot's prompt cut and output cap, N (the paper's 1024)")
    parser.add_argument("--chatbot-parts", type=lambda s: s.split(","),
                        default=list(chatbot_study.PARTS),
                        help=f"comma-separated, of {','.join(chatbot_study.PARTS)}")
    parser.add_argument("--replay-arms", type=lambda s: s.split(","),
                        default=list(chatbot_study.ARMS),
                        help=f"comma-separated, of {','.join(chatbot_study.ARMS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.studies) - set(STUDIES))
    if unknown:
        parser.error(f"unknown studies {unknown}; choose from {','.join(STUDIES)}")
    if "accelerators" in args.studies and "rate" not in args.studies:
        args.studies.append("rate")  # its engine runs calibrate and check the simulator
    if args.quick:
        apply_quick(args)
    return args


def apply_quick(args: argparse.Namespace) -> None:
    """Small settings for every study: a check of the pipeline, not of the numbers."""
    args.block_sizes = [4, 16, 64]
    args.sharegpt_requests = args.alpaca_requests = args.figure2_requests = 100
    args.sharing_requests = 50
    args.num_kv_slots = 4096
    args.rate_requests = args.engine_requests = 4


def memory_study(args: argparse.Namespace) -> tuple[dict, dict]:
    """The simulator's tables; (JSON section, {table: (title, rows)})."""
    runs = plan_runs(args)
    start = time.perf_counter()
    print(
        f"{len(runs)} simulations on synthetic ShareGPT-/Alpaca-like workloads (log-normal "
        "lengths fitted to the paper's published means), no model; "
        f"{args.num_kv_slots} KV token slots per server", flush=True,
    )
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(execute, runs))
    else:
        results = [execute(run) for run in runs]
    elapsed = time.perf_counter() - start
    tables = {
        "block_size": ("Block-size study (jpaged, all requests at t=0)", block_size_rows(results)),
        "figure2": (
            "Figure 2: KV memory by use, % of KV memory, ShareGPT-like, block size 16",
            figure2_rows(results),
        ),
        "sharing": (
            "Memory saved by sharing blocks, Alpaca-like, block size 16",
            sharing_rows(results),
        ),
        "window": (
            "Sliding windows: KV memory by use (% of KV memory) and sequences running, "
            "ShareGPT-like, block size 16",
            window_rows(results),
        ),
        "kv_dtype": (
            "KV cache dtypes at one pool in bytes (OPT-13B-shaped tokens; int8 and fp8 keep "
            "a float32 scale per token and head): KV memory and sequences running, "
            "ShareGPT-like, block size 16",
            kv_dtype_rows(results),
        ),
    }
    cpu_seconds = sum(r["cpu_s"] for r in results)
    print(f"{len(runs)} simulations took {cpu_seconds:.0f} s CPU, {elapsed:.0f} s wall clock "
          f"with {args.jobs} jobs", flush=True)
    # The KV dtype table's bytes per token and head, kept with the runs it describes.
    return {"wall_s": elapsed, "simulation_cpu_s": cpu_seconds, "runs": results,
            "kv_dtype_head_bytes": KV_DTYPE_HEAD_BYTES}, tables


def split_off(report: dict, key: str, path: str = "") -> dict:
    """Remove every `key` entry from the report's nested dicts and lists; {where each
    was, as a dotted path: its value}."""
    found = {}
    if isinstance(report, dict):
        if key in report:
            found[path.lstrip(".")] = report.pop(key)
        for name, value in report.items():
            found |= split_off(value, key, f"{path}.{name}")
    elif isinstance(report, list):
        for i, value in enumerate(report):
            found |= split_off(value, key, f"{path}.{i}")
    return found


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = new_report("experiments.sweep", argv, peers=("matplotlib",))
    report |= {"args": {k: str(v) for k, v in vars(args).items()}, "study_wall_s": {},
               "paper": paper.published()}
    tables: dict = {}
    if "memory" in args.studies:
        began = time.perf_counter()
        section, memory_tables = memory_study(args)
        report |= section
        tables |= memory_tables
        report["study_wall_s"]["memory"] = time.perf_counter() - began
    selected = [study for study in ENGINE_STUDIES if study in args.studies]
    if selected:
        report |= engine_studies.run(selected, args, report["study_wall_s"])
        tables |= engine_studies.tables(report)
    for name, (title, rows) in tables.items():
        if rows:
            print(f"\n{title}\n{format_table(rows)}")
            write_csv(args.out_dir / f"sweep_{name}.csv", rows)
    report["figures"] = figures.draw_all(report, args.out_dir)
    report["wall_s"] = time.perf_counter() - start
    # The per-step timelines and engine steps are most of the bytes and none of the
    # figures: files apart.
    timelines = [run.pop("timeline") for run in report.get("runs", [])]
    (args.out_dir / "sweep_timelines.json").write_text(json.dumps(timelines))
    (args.out_dir / "sweep_steps.json").write_text(json.dumps(split_off(report, "step_log")))
    (args.out_dir / "sweep.json").write_text(json.dumps(report, indent=1, default=str))
    summary = engine_studies.summary_rows(report)
    print(f"\nSummary\n{format_table(summary)}")
    if args.quick and selected:
        # Too few requests for the engine's figures to separate the systems: say so.
        print("\n--quick is a smoke run of the pipeline: its engine figures are titled so. "
              "The figures: python -m experiments.sweep [--studies ...]; measured: "
              "docs/results.md")
    print(f"\nthe sweep took {report['wall_s']:.0f} s wall clock; results in {args.out_dir}/")


if __name__ == "__main__":
    main()
