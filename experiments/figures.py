"""The sweep's figures, in the paper's manner, drawn with matplotlib from sweep.json's data.

Each function takes the sections of the sweep's report it plots and writes one
PNG; `draw_all` draws those whose sections are present and returns the file names.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # noqa: E402

from experiments.paper import (  # noqa: E402
    FIGURE2_SHAREGPT_TOKEN_STATES_PCT,
    FIGURE15_MEMORY_SAVED_PCT,
)

SMOKE_NOTE = ("smoke run (--quick): for the figure run python -m experiments.sweep "
              "--studies {studies}; measured: docs/results.md")


def _title(fig, title: str, smoke: bool, studies: str) -> None:
    """The figure's title; a --quick run's says it is a smoke run and where the figure is."""
    fig.suptitle(title + ("\n" + SMOKE_NOTE.format(studies=studies) if smoke else ""),
                 fontsize=10 if smoke else None)

POLICY_STYLE = {
    "paged": ("jpaged (paged)", "tab:blue", "o"),
    "orca-oracle": ("Orca (Oracle)", "tab:green", "s"),
    "orca-pow2": ("Orca (Pow2)", "tab:orange", "^"),
    "orca-max": ("Orca (Max)", "tab:red", "v"),
}
SYSTEM_LABELS = {"orca-max": "Orca\n(Max)", "orca-pow2": "Orca\n(Pow2)",
                 "orca-oracle": "Orca\n(Oracle)", "paged": "jpaged"}
BREAKDOWN = (("token_states", "Token states", "tab:green"),
             ("reserved", "Reserved", "tab:orange"),
             ("internal_fragmentation", "Internal fragmentation", "tab:red"),
             ("external_fragmentation", "External fragmentation & others", "tab:gray"))
DATASET_LABELS = {"sharegpt": "ShareGPT-like", "alpaca": "Alpaca-like"}
DPI = 120


def _block_size_axis(ax, sizes: list[int]) -> None:
    """A log2 x axis ticked at the block sizes measured, in plain numbers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(size) for size in sizes])
    ax.minorticks_off()
    ax.set_xlabel("Block size (tokens)")


def _save(fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=DPI)
    plt.close(fig)
    return name


def memory_breakdown(runs: list[dict], out_dir: Path) -> str:
    """Figure 2: stacked % of KV memory by use per system, the paper's token states marked."""
    rows = [r for r in runs if r["table"] == "figure2"]
    fig, ax = plt.subplots(figsize=(8.6, 4.2))
    names = [r["config"]["allocator"] for r in rows]
    bottoms = [0.0] * len(rows)
    for key, label, color in BREAKDOWN:
        values = [r["breakdown_pct"][key] for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottoms, label=label, color=color, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    paper = [FIGURE2_SHAREGPT_TOKEN_STATES_PCT[n] for n in names]
    ax.scatter(range(len(rows)), paper, marker="_", s=900, color="black",
               zorder=3, label="Paper: token states")
    ax.set_xticks(range(len(rows)), [SYSTEM_LABELS[n] for n in names])
    ax.set_ylabel("KV cache memory (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Figure 2: KV memory by use (simulator, ShareGPT-like)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), markerscale=0.3)
    return _save(fig, out_dir, "figure2_memory_breakdown.png")


def latency_vs_rate(figure12: dict, out_dir: Path, smoke: bool = False) -> str:
    """Figure 12: mean normalized latency against request rate, one panel per dataset
    with curves, each policy's capacity marked; then every dataset's capacities."""
    with_curves = {dataset: r for dataset, r in figure12.items() if "curves" in r}
    fig, axes = plt.subplots(1, len(with_curves) + 1, figsize=(5.4 * len(with_curves) + 5.0, 4.8),
                             squeeze=False)
    for ax, (dataset, result) in zip(axes[0], with_curves.items(), strict=False):
        for policy, points in result["curves"].items():
            label, color, marker = POLICY_STYLE[policy]
            ax.plot([p["request_rate"] for p in points],
                    [p["normalized_latency_s_mean"] for p in points],
                    marker=marker, color=color, label=label)
            ax.axvline(result["capacity_requests_per_s"][policy], color=color, linestyle="--",
                       alpha=0.5)
        ax.axhline(result["threshold_normalized_latency_s"], color="black", linestyle=":",
                   label="threshold")
        ax.plot([], [], color="gray", linestyle="--", label="capacity (all at once)")
        ax.set_xlabel("Request rate (req/s, virtual clock)")
        ax.set_ylabel("Normalized latency (s/token)")
        ax.set_title(f"{DATASET_LABELS[dataset]}, pool {result['pool_tokens']} tokens")
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    capacity_bars(figure12, axes[0][-1])
    _title(fig, "Figure 12 on the engine: SmolLM2-135M on CPU", smoke, "rate")
    return _save(fig, out_dir, "figure12_latency_vs_rate.png")


def capacity_bars(figure12: dict, ax) -> None:
    """Each policy's capacity (requests/s, all queued at once), grouped by dataset."""
    policies = list(POLICY_STYLE)
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        label, color, _ = POLICY_STYLE[policy]
        xs = [d + (i - (len(policies) - 1) / 2) * width for d in range(len(figure12))]
        values = [r["capacity_requests_per_s"][policy] for r in figure12.values()]
        ax.bar(xs, values, width=width, color=color, label=label)
    ax.set_xticks(range(len(figure12)), [DATASET_LABELS[dataset] for dataset in figure12])
    ax.set_ylabel("Capacity (req/s, virtual clock)")
    ax.set_title("Capacity: every request queued at once")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)


def block_size_memory(runs: list[dict], out_dir: Path) -> str:
    """The simulator's block-size study: internal fragmentation and batch size."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rows = [r for r in runs if r["table"] == "block_size"]
    for workload in dict.fromkeys(_workload_name(r) for r in rows):
        mine = [r for r in rows if _workload_name(r) == workload]
        sizes = [r["config"]["block_size"] for r in mine]
        frag = [r["breakdown_pct"]["internal_fragmentation"] if r["breakdown_pct"] else None
                for r in mine]
        if all(f is not None for f in frag):
            left.plot(sizes, frag, marker="o", label=workload)
        right.plot(sizes, [r["mean_running_seqs"] for r in mine], marker="o", label=workload)
    for ax in (left, right):
        _block_size_axis(ax, sorted({r["config"]["block_size"] for r in rows}))
        ax.legend(fontsize=8)
    left.set_ylabel("Internal fragmentation (% of KV memory)")
    right.set_ylabel("Mean running sequences")
    fig.suptitle("Block size in simulation (all requests at t=0)")
    return _save(fig, out_dir, "block_size_simulator.png")


def _workload_name(run: dict) -> str:
    prefix = run["workload"].get("prefix")
    return run["dataset"] + (f"+{prefix}" if prefix else "")


def block_size_engine(rows: list[dict], out_dir: Path, smoke: bool = False) -> str:
    """Figure 18: normalized latency and attention time per step against block size."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [r["block_size"] for r in rows]
    left.plot(sizes, [r["normalized_latency_s_mean"] for r in rows], marker="o")
    left.set_ylabel("Normalized latency (s/token)")
    left.set_title(f"ShareGPT-like at {rows[0]['request_rate']:.2f} req/s")
    right.plot(sizes, [1e3 * r["attention_s_per_step"] for r in rows], marker="o",
               color="tab:purple")
    right.set_ylabel("Attention time per step, all layers (ms)")
    right.set_title("Attention op alone, same steps")
    for ax in (left, right):
        _block_size_axis(ax, sizes)
    _title(fig, "Figure 18 on the engine: SmolLM2-135M on CPU", smoke, "block-size")
    return _save(fig, out_dir, "figure18_block_size_engine.png")


def preemption_cost(figure19: dict, out_dir: Path, smoke: bool = False) -> str:
    """Figure 19: (a) swapping and recomputing one sequence, (b) normalized latency
    of a burst that preempts, with each mode, against block size."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ops = figure19["operations"]
    op_sizes = [o["block_size"] for o in ops]
    for label, seconds, style in (
            ("Recompute", [o["recompute_s"] for o in ops], dict(color="tab:blue", marker="o")),
            ("Swap in + out", [o["swap_in_s"] + o["swap_out_s"] for o in ops],
             dict(color="tab:orange", marker="o")),
            ("Swap out", [o["swap_out_s"] for o in ops],
             dict(color="tab:orange", ls="--", marker="^")),
            ("Swap in", [o["swap_in_s"] for o in ops],
             dict(color="tab:orange", ls=":", marker="v"))):
        left.plot(op_sizes, [1e3 * s for s in seconds], label=label, **style)
    left.set_yscale("log")
    left.set_ylabel("Time (ms)")
    left.set_title(f"(a) One sequence of {ops[0]['tokens']} tokens, engine idle")
    rows = figure19["runs"]
    sizes = [r["block_size"] for r in rows]
    for mode, other, color in (("recompute", "swap", "tab:blue"),
                               ("swap", "recompute", "tab:orange")):
        latencies = [r[mode]["normalized_latency_s_mean"] for r in rows]
        right.plot(sizes, latencies, marker="o", color=color, label=mode.capitalize())
        for size, latency, row in zip(sizes, latencies, rows, strict=True):
            # The higher point's count goes above it, the lower's below, so they never meet.
            higher = latency >= row[other]["normalized_latency_s_mean"]
            right.annotate(str(row[mode]["num_preemptions"]), (size, latency), fontsize=7,
                           textcoords="offset points", xytext=(0, 6 if higher else -11),
                           ha="center", color=color)
    right.set_ylabel("Normalized latency (s/token)")
    right.set_title("(b) A burst on a pool that preempts")
    right.margins(y=0.15)
    _block_size_axis(left, op_sizes)
    _block_size_axis(right, sizes)
    left.legend(fontsize=8)
    right.legend(fontsize=8, title="numbers: preemptions", title_fontsize=8)
    _title(fig, "Figure 19 on the engine: recompute vs swap", smoke, "preemption")
    return _save(fig, out_dir, "figure19_preemption_cost.png")


def sharing_savings(rows: list[dict], out_dir: Path, smoke: bool = False) -> str:
    """Figures 14 and 15: memory saved and throughput gain by block sharing."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, color in (("parallel", "tab:blue"), ("beam", "tab:orange")):
        mine = [r for r in rows if r["kind"] == kind]
        degrees = [r["degree"] for r in mine]
        label = "Parallel sampling" if kind == "parallel" else "Beam search"
        left.plot(degrees, [r["memory_saved_pct"] for r in mine], marker="o", color=color,
                  label=label)
        paper = FIGURE15_MEMORY_SAVED_PCT[mine[0]["dataset"]][kind]
        left.axhspan(paper.low, paper.high, color=color, alpha=0.15,
                     label=f"{label}, paper (OPT-13B)")
        right.plot(degrees, [r["throughput_ratio"] for r in mine], marker="o", color=color,
                   label=label)
    left.set_ylabel("KV memory saved by sharing (%)")
    right.set_ylabel("Throughput, sharing / no sharing (x)")
    right.axhline(1.0, color="black", linestyle=":")
    for ax in (left, right):
        ax.set_xticks(sorted({r["degree"] for r in rows}))
        ax.set_xlabel("Number of samples / beam width")
        ax.legend(fontsize=8)
    _title(fig, f"Figures 14 and 15 on the engine: {DATASET_LABELS[rows[0]['dataset']]} "
                "requests", smoke, "sharing")
    return _save(fig, out_dir, "figures14_15_sharing.png")


def _curve_panel(ax, result: dict, title: str, engine: dict | None = None) -> None:
    """One scenario's normalized latency against rate per policy, its threshold, and the
    engine's curves dashed where given."""
    for policy, points in result["curves"].items():
        label, color, marker = POLICY_STYLE[policy]
        ax.plot([p["request_rate"] for p in points],
                [p["normalized_latency_s_mean"] for p in points],
                marker=marker, color=color, label=label)
        if engine is not None and policy in engine["curves"]:
            ax.plot([p["request_rate"] for p in engine["curves"][policy]],
                    [p["normalized_latency_s_mean"] for p in engine["curves"][policy]],
                    marker=marker, color=color, linestyle="--", alpha=0.6)
    ax.axhline(result["threshold_normalized_latency_s"], color="black", linestyle=":",
               label="threshold")
    if engine is not None:
        ax.plot([], [], color="gray", linestyle="--", label="engine")
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel("Normalized latency (s/token)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def accelerator_figures(section: dict, figure12: dict, out_dir: Path, smoke: bool = False
                        ) -> list[str]:
    """The accelerators study: the calibration's held-out steps and the CPU check, Figure
    12 in simulation on an A100, and the projections."""
    scenarios = section["scenarios"]
    fig, (fit_ax, check_ax) = plt.subplots(1, 2, figsize=(11.0, 4.6))
    held_out = section["calibration"]["held_out_steps"]
    errors = section["calibration"]["held_out_error"]["all"]
    measured = [1e3 * s for s in held_out["measured_s"]]
    fit_ax.scatter(measured, [1e3 * s for s in held_out["predicted_s"]], s=4, alpha=0.4)
    low, high = min(measured), max(measured)
    fit_ax.plot([low, high], [low, high], color="black", linewidth=1, label="prediction = measured")
    fit_ax.fill_between([low, high], [0.85 * low, 0.85 * high], [1.15 * low, 1.15 * high],
                        color="gray", alpha=0.2, label="within 15%")
    fit_ax.set_xscale("log")
    fit_ax.set_yscale("log")
    for axis in (fit_ax.xaxis, fit_ax.yaxis):  # 20, 50, 100, 200 ms: plain numbers
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    fit_ax.set_xlabel("Measured step (ms)")
    fit_ax.set_ylabel("Predicted step (ms)")
    fit_ax.set_title(f"Held-out engine steps: median error {errors['median_pct']:.1f}%, "
                     f"p90 {errors['p90_pct']:.1f}%", fontsize=10)
    fit_ax.legend(fontsize=7)
    _curve_panel(check_ax, scenarios["cpu-smollm2-sharegpt"],
                 "SmolLM2-135M on this CPU: simulated (solid), engine (dashed)",
                 engine=figure12["sharegpt"])
    if smoke:  # its engine steps and curves are the quick rate study's
        _title(fig, "Calibration and CPU check", smoke, "rate,accelerators")
    names = [_save(fig, out_dir, "accelerators_cpu_check.png")]
    for name, keys, title in (
            ("accelerators_figure12_a100.png", ("a100-opt13b-sharegpt", "a100-opt13b-alpaca"),
             "Figure 12 in simulation: OPT-13B on an A100-40GB, the paper's KV pool"),
            ("accelerators_projections.png",
             ("h200-llama3-8b-sharegpt", "tpu-v5e-4-llama3-8b-sharegpt"),
             "Projections: a Llama-3-8B-shaped model, ShareGPT-like requests")):
        fig, axes = plt.subplots(1, len(keys), figsize=(5.6 * len(keys), 4.6), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            result = scenarios[key]
            _curve_panel(ax, result, f"{result['device']}, {result['settings']['dataset']}-like, "
                                     f"pool {result['pool_tokens']} tokens")
        fig.suptitle(title)
        names.append(_save(fig, out_dir, name))
    return names


def _rate_panel(ax, result: dict, title: str) -> None:
    """Normalized latency against rate per server of a rate_search result, each
    capacity dashed, the threshold dotted."""
    for server, points in result["curves"].items():
        label, color, marker = POLICY_STYLE[server]
        ax.plot([p["request_rate"] for p in points],
                [p["normalized_latency_s_mean"] for p in points], marker=marker, color=color,
                label=label)
        ax.axvline(result["capacity_requests_per_s"][server], color=color, linestyle="--",
                   alpha=0.5)
    ax.axhline(result["threshold_normalized_latency_s"], color="black", linestyle=":",
               label="threshold")
    ax.set_xlabel("Request rate (req/s, virtual clock)")
    ax.set_ylabel("Normalized latency (s/token)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _ratio(result: dict) -> tuple[float, str]:
    """paged / orca-oracle: the sustained-rate ratio, else the capacity ratio."""
    if "rate_ratios" in result:
        return result["rate_ratios"]["rate_ratio_vs_orca_oracle"], "sustained rate"
    return result["capacity_ratios"]["capacity_ratio_vs_orca_oracle"], "capacity"


def shared_prefix(section: dict, out_dir: Path, smoke: bool) -> str:
    """Figure 16: each prefix's curves on the engine, and paged / Orca (Oracle) on the
    engine and in simulation beside the paper's."""
    prefixes = section["prefixes"]
    with_curves = {p: r["engine"] for p, r in prefixes.items() if "curves" in r["engine"]}
    fig, axes = plt.subplots(1, len(with_curves) + 1, figsize=(5.0 * (len(with_curves) + 1), 4.4),
                             squeeze=False)
    for ax, (prefix, engine) in zip(axes[0], with_curves.items(), strict=False):
        _rate_panel(ax, engine, f"{prefix} prefix ({engine['prefix_tokens']} tokens), pool "
                                f"{engine['pool_tokens']} tokens")
    ax = axes[0][-1]
    names = list(prefixes)
    bars = (("engine", "tab:blue"), ("simulator", "tab:purple"))
    for i, (where, color) in enumerate(bars):
        values = [_ratio(prefixes[p][where])[0] for p in names]
        ax.bar([x + (i - 1) * 0.27 for x in range(len(names))], values, width=0.27,
               color=color, label=f"{where} ({_ratio(prefixes[names[0]][where])[1]})")
    ax.bar([x + 0.27 for x in range(len(names))],
           [section["paper_rate_ratio"][p] for p in names], width=0.27, color="gray",
           label="paper (LLaMA-13B, A100)")
    ax.axhline(1.0, color="black", linestyle=":")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("paged / Orca (Oracle)")
    ax.set_title("Sustained rate (or capacity), paged over Orca (Oracle)", fontsize=9)
    ax.legend(fontsize=7)
    _title(fig, "Figure 16: a shared translation prefix, SmolLM2-135M on CPU and simulated",
           smoke, "prefix")
    return _save(fig, out_dir, "figure16_shared_prefix.png")


def chatbot(section: dict, out_dir: Path, smoke: bool) -> str:
    """Figure 17's curves (or capacities), the replay's time to first token per arm, and
    a block recomputed against loaded: those the section holds."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15.0, 4.4))
    for ax, part in ((left, "figure17"), (middle, "replay"), (right, "block_costs")):
        ax.set_visible(part in section)
    chat = section.get("figure17", {})
    if "curves" in chat:
        _rate_panel(left, chat, f"Figure 17: prompts cut to {chat['settings']['prompt_cut']} "
                                f"tokens, pool {chat['pool_tokens']} tokens")
    elif chat:
        policies = list(chat["capacity_requests_per_s"])
        left.bar(range(len(policies)), [chat["capacity_requests_per_s"][p] for p in policies],
                 color=[POLICY_STYLE[p][1] for p in policies])
        left.set_xticks(range(len(policies)), [SYSTEM_LABELS[p] for p in policies])
        left.set_ylabel("Capacity (req/s, virtual clock)")
        left.set_title("Figure 17: capacity, every request queued at once", fontsize=9)
    arms = section.get("replay", {}).get("arms", {})
    names = list(arms)
    for i, (stat, color) in enumerate((("mean", "tab:blue"), ("p90", "tab:orange"))):
        middle.bar([x + (i - 0.5) * 0.4 for x in range(len(names))],
                   [arms[a][f"ttft_s_{stat}"] for a in names], width=0.4, color=color,
                   label=stat)
    middle.set_xticks(range(len(names)), [f"{a}\n{arms[a]['device_pool_tokens']} tok"
                                          for a in names], fontsize=8)
    middle.set_ylabel("Time to first token (s, virtual clock)")
    middle.set_title("Conversations replayed, KV kept between rounds", fontsize=9)
    middle.legend(fontsize=7)
    costs = section.get("block_costs", {})
    wheres = (("engine", "this CPU (measured)"), ("gpu_projection", "A100 + PCIe (model)"))
    wheres = wheres if costs else ()
    for i, (kind, color) in enumerate((("recompute", "tab:red"), ("load", "tab:green"))):
        right.bar([x + (i - 0.5) * 0.4 for x in range(len(wheres))],
                  [costs[w][f"{kind}_ms_per_block"] for w, _ in wheres], width=0.4,
                  color=color, label=kind)
    right.set_xticks(range(len(wheres)), [label for _, label in wheres])
    right.set_yscale("log")
    right.set_ylabel("ms per block")
    right.set_title("A prompt block: recomputed or loaded from host memory", fontsize=9)
    right.legend(fontsize=7)
    _title(fig, "Figure 17 and past it: conversations, SmolLM2-135M on CPU", smoke, "chatbot")
    return _save(fig, out_dir, "figure17_chatbot.png")


def draw_all(report: dict, out_dir: Path) -> list[str]:
    """Every figure whose data the report holds; the PNG file names written."""
    names = []
    smoke = report.get("args", {}).get("quick") == "True"
    if "figure16" in report:
        names.append(shared_prefix(report["figure16"], out_dir, smoke))
    if "figure17" in report:
        names.append(chatbot(report["figure17"], out_dir, smoke))
    if "runs" in report:
        names.append(memory_breakdown(report["runs"], out_dir))
        names.append(block_size_memory(report["runs"], out_dir))
    if "figure12" in report:
        names.append(latency_vs_rate(report["figure12"], out_dir, smoke))
    if "figure18" in report:
        names.append(block_size_engine(report["figure18"], out_dir, smoke))
    if "figure19" in report:
        names.append(preemption_cost(report["figure19"], out_dir, smoke))
    if "figures14_15" in report:
        names.append(sharing_savings(report["figures14_15"], out_dir, smoke))
    if "accelerators" in report:
        names += accelerator_figures(report["accelerators"], report["figure12"], out_dir, smoke)
    return names
