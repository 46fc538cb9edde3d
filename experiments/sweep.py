"""The block-size study and the paper's memory comparisons, in simulation.

`python -m experiments.sweep` runs the model-free simulator (experiments/simulator.py)
over synthetic workloads (experiments/workloads.py: fits to the vLLM paper's
published mean lengths, not the datasets) and prints three tables:

1. Block sizes 1 to 256 on ShareGPT-like and Alpaca-like requests, plus an
   Alpaca-like workload with a one-shot shared prefix and prefix caching on:
   how much KV memory holds token states, how many sequences run at once,
   preemptions, simulated throughput and prefix-cache hit rate.
2. The paper's Figure 2: the KV memory breakdown of Orca (Max / Pow2 / Oracle)
   and jpaged on ShareGPT-like requests at block size 16, beside the paper.
3. Memory saved by sharing blocks: parallel sampling and beam search
   (n = 2, 4, 6) on Alpaca-like requests, beside the paper, and prefix sharing.

Every run serves its requests all at once (arrival time 0), so memory is the
bottleneck; every allocator gets the same KV memory (--num-kv-slots token
slots, about what OPT-13B leaves on a 40 GB A100). The default sizes finish in
a few minutes on two cores; raise the request counts for tighter numbers.
Results go to <out-dir>/sweep.json and one CSV per table.
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

from experiments.simulator import SimConfig, simulate
from experiments.workloads import make_workload

PAPER_TOKEN_STATES = {"orca-max": 20.4, "orca-pow2": 26.8, "orca-oracle": 38.2, "jpaged": 96.3}
PAPER_SHARING_SAVED = {"parallel": "6.1-9.8", "beam": "37.6-55.2"}
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Run:
    """One simulation: a table row's workload and server."""

    table: str
    dataset: str
    num_requests: int
    config: SimConfig
    workload: dict = field(default_factory=dict)
    seed: int = 0


def execute(run: Run) -> dict:
    """Simulate one run; its summary, workload and timeline as a JSON-ready dict."""
    requests = make_workload(run.dataset, run.num_requests, seed=run.seed, **run.workload)
    result = simulate(requests, run.config)
    return {
        "table": run.table,
        "dataset": run.dataset,
        "workload": run.workload,
        **result.summary(),
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
    for allocator in PAPER_TOKEN_STATES:
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
    return runs


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
                "requests_per_s": f"{r['num_finished'] / r['simulated_s']:.2f}",
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
                "paper_token_states_pct": PAPER_TOKEN_STATES[allocator],
                "reserved_pct": f"{breakdown['reserved']:.1f}",
                "internal_frag_pct": f"{breakdown['internal_fragmentation']:.1f}",
                "external_frag_and_other_pct": f"{breakdown['external_fragmentation']:.1f}",
                "token_states_pct_of_allocated": _pct(r["token_states_of_allocated"]),
                "mean_running_seqs": f"{r['mean_running_seqs']:.1f}",
                "preemptions": r["num_preemptions"],
                "requests_per_s": f"{r['num_finished'] / r['simulated_s']:.2f}",
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
            paper = PAPER_SHARING_SAVED[kind]
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = plan_runs(args)
    start = time.perf_counter()
    print(
        f"{len(runs)} simulations on synthetic ShareGPT-/Alpaca-like workloads (log-normal "
        "lengths fitted to the paper's published means), no model; "
        f"{args.num_kv_slots} KV token slots per server"
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
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, (title, rows) in tables.items():
        print(f"\n{title}\n{format_table(rows)}")
        write_csv(args.out_dir / f"sweep_{name}.csv", rows)
    cpu_seconds = sum(r["cpu_s"] for r in results)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "wall_s": elapsed,
        "simulation_cpu_s": cpu_seconds,
        "runs": results,
    }
    (args.out_dir / "sweep.json").write_text(json.dumps(report, indent=1, default=str))
    print(
        f"\n{len(runs)} simulations took {cpu_seconds:.0f} s CPU, "
        f"{elapsed:.0f} s wall clock with {args.jobs} jobs; results in {args.out_dir}/"
    )


if __name__ == "__main__":
    main()
