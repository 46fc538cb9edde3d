"""The real-engine studies of `python -m experiments.sweep`: settings, tables, summary.

Loads the default model once and runs the selected studies (rate with its
simulator validation, block-size, preemption, KV cache dtypes, sharing, shared
prefixes, the chatbot), each with the full or the --quick settings; returns their JSON
sections, then turns them into the sweep's tables and its closing summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from experiments import (
    accelerator_study,
    block_size_study,
    chatbot_study,
    kv_dtype_study,
    prefix_study,
    rate_study,
    sharing_study,
    validation,
)
from experiments.chatbot_study import ChatbotSettings, ReplaySettings
from experiments.paper import FIGURE12_SHAREGPT_RATE_RATIO
from experiments.prefix_study import PrefixSettings
from experiments.report import progress
from experiments.step_cost import ModelShape
from experiments.translation import SHOTS

# --quick: paged's run at its capacity sets the threshold, then one step up where needed.
QUICK_RATE_FRACTIONS = (1.0, 2.0)
QUICK_BASE_FRACTION = 1.0
QUICK_LENGTH_SCALE = 0.1
QUICK_BLOCK_SIZES = (8, 32)
QUICK_PREEMPTION_BLOCK_SIZES = (16,)
QUICK_MAX_MODEL_LEN = 64  # below what the quick burst holds at once, so that it preempts
# --quick shared prefixes and chatbot: smoke runs, capacities only on a few requests; the
# replay on a few short conversations.
QUICK_PREFIX_POOL_SCALE = 1 / 16
QUICK_PREFIX_REQUESTS = 12
QUICK_CHATBOT = ChatbotSettings(prompt_cut=32, num_conversations=20, num_requests=12,
                                curves=False)
QUICK_REPLAY = ReplaySettings(num_conversations=3, output_cap=32, max_model_len=128,
                              device_pool_tokens=256, tier_tokens=2048, think_s=5.0,
                              max_num_seqs=8, max_num_batched_tokens=128)


def prefix_settings(args: argparse.Namespace) -> list[PrefixSettings]:
    """Figure 16's runs per prefix: the pool scale asked for, or --quick's."""
    scale = QUICK_PREFIX_POOL_SCALE if args.quick else args.prefix_pool_scale
    return [PrefixSettings(prefix, pool_scale=scale, reserve=args.reserve_prefix,
                           curves=not args.quick,
                           num_requests=QUICK_PREFIX_REQUESTS if args.quick else None,
                           seed=args.seed) for prefix in SHOTS]


def chatbot_settings(args: argparse.Namespace) -> tuple[ChatbotSettings, ReplaySettings]:
    """Figure 17's runs and the replay's, full or --quick, with the arms asked for."""
    chatbot = QUICK_CHATBOT if args.quick else ChatbotSettings(prompt_cut=args.chatbot_prompt_cut)
    replay = QUICK_REPLAY if args.quick else ReplaySettings()
    return (dataclasses.replace(chatbot, seed=args.seed),
            dataclasses.replace(replay, arms=tuple(args.replay_arms), seed=args.seed))


def rate_settings(dataset: str, args: argparse.Namespace) -> rate_study.RateSettings:
    """ShareGPT-like gets latency curves; Alpaca-like its capacities only (time)."""
    settings = rate_study.RateSettings(dataset, num_requests=args.rate_requests, seed=args.seed,
                                       curves=dataset == "sharegpt")
    if args.quick:
        settings = dataclasses.replace(settings, rate_fractions=QUICK_RATE_FRACTIONS,
                                       start_fraction=QUICK_RATE_FRACTIONS[0],
                                       base_fraction=QUICK_BASE_FRACTION,
                                       length_scale_override=QUICK_LENGTH_SCALE)
    return settings


def run(selected: list[str], args: argparse.Namespace, timings: dict) -> dict:
    """The JSON sections of the selected real-engine studies; timings gets each
    study's wall seconds."""
    from jpaged.model.loader import load_model

    loaded = load_model("smollm2")
    vocab = loaded[1].vocab_size
    report: dict = {"engine": {"model": "smollm2 (SmolLM2-135M-Instruct)", "dtype": "float32",
                               "clock": "virtual: measured step times less compilation"}}
    sharegpt_pool = capacity = None
    if "rate" in selected:
        began = time.perf_counter()
        datasets = ("sharegpt",) if args.quick else ("sharegpt", "alpaca")
        report["figure12"], report["validation"] = {}, {}
        for dataset in datasets:
            settings = rate_settings(dataset, args)
            result, burst = rate_study.run_dataset(loaded, settings, vocab)
            report["figure12"][dataset] = result
            validated = {policy: result["all_at_once"][policy]
                         for policy in validation.VALIDATED}
            report["validation"][dataset] = validation.validate(
                validated, burst, result["pool_tokens"], settings)
            progress(f"rate study {dataset}: {result.get('rate_ratios')} "
                     f"{result['capacity_ratios']}")
        sharegpt = report["figure12"]["sharegpt"]
        report |= sharegpt["rate_ratios"] | sharegpt["capacity_ratios"]
        report["sim_vs_engine_gap_pct"] = report["validation"]["sharegpt"][
            "sim_vs_engine_gap_pct"]
        sharegpt_pool = sharegpt["pool_tokens"]
        capacity = sharegpt["capacity_requests_per_s"]["paged"]
        timings["rate"] = time.perf_counter() - began
    if "accelerators" in selected:
        began = time.perf_counter()
        model = ModelShape.of(loaded[1], "SmolLM2-135M", dtype_bytes=4)
        report["accelerators"] = accelerator_study.run(report["figure12"], model, args)
        progress("accelerators study: "
                 f"{report['accelerators']['calibration']['held_out_error']['all']}")
        timings["accelerators"] = time.perf_counter() - began
    block_settings = block_size_study.BlockSizeSettings(
        num_requests=args.engine_requests, seed=args.seed,
        block_sizes=QUICK_BLOCK_SIZES if args.quick else block_size_study.BLOCK_SIZES,
        length_scale=QUICK_LENGTH_SCALE if args.quick else rate_study.LENGTH_SCALES["sharegpt"],
        max_model_len=QUICK_MAX_MODEL_LEN if args.quick else 512)
    if sharegpt_pool is None:
        burst = block_size_study.workload(block_settings, vocab, math.inf)
        sharegpt_pool = rate_study.pool_tokens(burst, rate_settings("sharegpt", args))
    if "block-size" in selected:
        began = time.perf_counter()
        report["figure18"] = block_size_study.latency_by_block_size(
            loaded, block_settings, vocab, sharegpt_pool, capacity, progress)
        timings["block-size"] = time.perf_counter() - began
    if "preemption" in selected:
        began = time.perf_counter()
        sizes = (QUICK_PREEMPTION_BLOCK_SIZES if args.quick
                 else block_size_study.PREEMPTION_BLOCK_SIZES)
        report["figure19"] = {
            "operations": block_size_study.operation_costs(loaded, block_settings, vocab,
                                                           progress),
            "runs": block_size_study.preemption_runs(
                loaded, dataclasses.replace(block_settings, block_sizes=sizes), vocab,
                progress)}
        timings["preemption"] = time.perf_counter() - began
    if "kv-dtype" in selected:
        began = time.perf_counter()
        report["kv_dtype"] = kv_dtype_study.run(loaded, rate_settings("sharegpt", args), vocab)
        progress(f"kv dtype study: {report['kv_dtype']['capacity_ratios_vs_float32']} "
                 f"{report['kv_dtype'].get('rate_ratios_vs_float32')}")
        timings["kv-dtype"] = time.perf_counter() - began
    if "sharing" in selected:
        began = time.perf_counter()
        settings = sharing_study.SharingSettings(
            num_requests=3 if args.quick else 8, seed=args.seed,
            degrees=(2,) if args.quick else sharing_study.DEGREES)
        report["figures14_15"] = sharing_study.run(loaded, settings, vocab, progress)
        timings["sharing"] = time.perf_counter() - began
    if "prefix" in selected:
        began = time.perf_counter()
        report["figure16"] = prefix_study.run(loaded, prefix_settings(args), vocab, progress)
        timings["prefix"] = time.perf_counter() - began
    if "chatbot" in selected:
        began = time.perf_counter()
        report["figure17"] = chatbot_study.run(loaded, *chatbot_settings(args), vocab, progress,
                                               tuple(args.chatbot_parts))
        timings["chatbot"] = time.perf_counter() - began
    return report


def _f(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(report: dict) -> dict:
    """{table: (title, rows)} of the real-engine sections present in the report."""
    out = {}
    if "figure12" in report:
        rows = []
        for dataset, result in report["figure12"].items():
            for policy, points in result.get("curves", {}).items():
                for point in points:
                    rows.append({
                        "dataset": dataset, "policy": policy,
                        "request_rate": _f(point["request_rate"]),
                        "capacity_fraction": _f(point["capacity_fraction"], 2),
                        "normalized_latency_s": _f(point["normalized_latency_s_mean"]),
                        "mean_running": _f(point["mean_running_requests"], 1),
                        "kv_util_pct": _f(point["mean_kv_utilization_pct"], 1),
                        "preemptions": point["num_preemptions"],
                        "pool_tokens": result["pool_tokens"],
                        "threshold_s": _f(result["threshold_normalized_latency_s"]),
                    })
        out["figure12"] = ("Figure 12 on the engine: normalized latency (s/token) vs "
                           "request rate (req/s, virtual clock)", rows)
        out["capacity"] = ("Capacity: every request queued at once, same pool", [
            {"dataset": dataset, "policy": policy, "pool_tokens": result["pool_tokens"],
             "requests_per_s": _f(capacity),
             "paged_over_policy": _f(result["capacity_requests_per_s"]["paged"] / capacity, 2),
             "mean_running": _f(result["all_at_once"][policy]["mean_running_requests"], 1),
             "kv_util_pct": _f(result["all_at_once"][policy]["mean_kv_utilization_pct"], 1),
             "step_ms_median": _f(1e3 * result["all_at_once"][policy]["step_s_median"], 1)}
            for dataset, result in report["figure12"].items()
            for policy, capacity in result["capacity_requests_per_s"].items()])
        out["validation"] = ("Simulator vs engine, same requests and pool, all at once",
                             validation_rows(report["validation"]))
    if "figure18" in report:
        out["figure18"] = ("Figure 18 on the engine: block size", [
            {"block_size": r["block_size"], "request_rate": _f(r["request_rate"]),
             "normalized_latency_s": _f(r["normalized_latency_s_mean"]),
             "attention_ms_per_step": _f(1e3 * r["attention_s_per_step"], 1),
             "mean_running": _f(r["mean_running_requests"], 1),
             "preemptions": r["num_preemptions"]} for r in report["figure18"]])
    if "figure19" in report:
        out["figure19_operations"] = (
            "Figure 19 (a) on the engine: preempting one sequence, engine idle", [
                {"block_size": r["block_size"], "tokens": r["tokens"], "blocks": r["blocks"],
                 "recompute_ms": _f(1e3 * r["recompute_s"], 1),
                 "swap_out_ms": _f(1e3 * r["swap_out_s"], 1),
                 "swap_in_ms": _f(1e3 * r["swap_in_s"], 1)}
                for r in report["figure19"]["operations"]])
        out["figure19_runs"] = ("Figure 19 (b) on the engine: a burst on a pool that preempts", [
            {"block_size": r["block_size"], "pool_tokens": r["pool_tokens"],
             "latency_recompute_s": _f(r["recompute"]["normalized_latency_s_mean"]),
             "preemptions_recompute": r["recompute"]["num_preemptions"],
             "latency_swap_s": _f(r["swap"]["normalized_latency_s_mean"]),
             "preemptions_swap": r["swap"]["num_preemptions"]}
            for r in report["figure19"]["runs"]])
    if "kv_dtype" in report:
        result = report["kv_dtype"]
        sustained = result.get("sustained_rate", {})
        out["kv_dtype_engine"] = (
            "KV cache dtypes on the engine: one pool in bytes, ShareGPT-like", [
                {"kv_dtype": dtype, "bytes_per_token": result["bytes_per_token"][dtype],
                 "pool_tokens": result["pool_tokens"][dtype],
                 "capacity_req_s": _f(capacity),
                 "peak_running": result["all_at_once"][dtype]["peak_running_requests"],
                 "mean_running": _f(result["all_at_once"][dtype]["mean_running_requests"], 1),
                 "step_ms_median": _f(1e3 * result["all_at_once"][dtype]["step_s_median"], 1),
                 "sustained_req_s": _f(sustained[dtype]["rate"]) if dtype in sustained else "-",
                 "bound": sustained[dtype]["bound"] if dtype in sustained else "-"}
                for dtype, capacity in result["capacity_requests_per_s"].items()])
    if "accelerators" in report:
        out |= accelerator_study.tables(report["accelerators"])
    if "figures14_15" in report:
        out["figures14_15"] = ("Figures 14 and 15 on the engine: sharing, Alpaca-like", [
            {"sharing": f"{r['kind']} n={r['degree']}",
             "memory_saved_pct": _f(r["memory_saved_pct"], 1),
             "paper_pct": r["paper_memory_saved_pct"],
             "tok_s_sharing": _f(r["output_tokens_per_s_sharing"], 1),
             "tok_s_no_sharing": _f(r["output_tokens_per_s_no_sharing"], 1),
             "throughput_ratio": _f(r["throughput_ratio"], 2)} for r in report["figures14_15"]])
    if "figure16" in report:
        out |= figure16_tables(report["figure16"])
    if "figure17" in report:
        out |= figure17_tables(report["figure17"])
    return out


def _rate_rows(result: dict, paper) -> list[dict]:
    """One row per server of a rate_search result: capacity, sustained rate and paged's
    ratios over it, beside the paper's."""
    rows = []
    for server, capacity in result["capacity_requests_per_s"].items():
        key = server.replace("-", "_")
        sustained = result.get("sustained_rate", {}).get(server)
        rows.append({
            "server": server, "capacity_req_s": _f(capacity),
            "capacity_paged_over": _f(result["capacity_ratios"].get(
                f"capacity_ratio_vs_{key}"), 2),
            "sustained_req_s": _f(sustained["rate"]) if sustained else "-",
            "bound": sustained["bound"] if sustained else "-",
            "paged_over": _f(result.get("rate_ratios", {}).get(f"rate_ratio_vs_{key}"), 2),
            "paper_paged_over": "-" if server == "paged" else f"{paper:g}",
            "mean_running": _f(result["all_at_once"][server]["mean_running_requests"], 1)})
    return rows


def figure16_tables(section: dict) -> dict:
    """Figure 16 on the engine and in simulation, one row per prefix and server."""
    tables = {}
    for where, title in (("engine", "Figure 16 on the engine: translation behind a shared "
                                    "prefix, paged (prefix {held}) vs Orca (Oracle)"),
                         ("simulator", "Figure 16 in simulation: LLaMA-13B on an A100-40GB, "
                                       "the paper's pool, paged (prefix reserved) vs Orca "
                                       "(Oracle) on contiguous slabs")):
        rows = []
        for prefix, result in section["prefixes"].items():
            run = result[where]
            paper = section["paper_rate_ratio"][prefix]
            for row in _rate_rows(run, paper):
                rows.append({"prefix": prefix,
                             "prefix_tokens": result["engine"]["prefix_tokens"],
                             "pool_tokens": run["pool_tokens"], **row})
        held = next(iter(section["prefixes"].values()))["engine"]["prefix_held"]
        tables[f"figure16_{where}"] = (title.format(held=held), rows)
    return tables


def figure17_tables(section: dict) -> dict:
    """Figure 17 per policy, the replay per arm, the per-block costs: those present."""
    tables = {}
    if "figure17" in section:
        chat = section["figure17"]
        tables["figure17"] = (f"Figure 17 on the engine: chatbot, prompts cut to "
                              f"{chat['settings']['prompt_cut']} tokens, no KV kept between "
                              "rounds", _rate_rows(chat, chat["paper_rate_ratio"]))
    if "replay" in section:
        tables["replay"] = ("Conversations replayed round after round: time to first token "
                            "and throughput by where the history's KV is kept (virtual clock)",
                            replay_rows(section["replay"]))
    if "block_costs" in section:
        tables["block_costs"] = ("A prompt block: recomputed against loaded from host memory",
                                 block_cost_rows(section["block_costs"]))
    return tables


def replay_rows(replay: dict) -> list[dict]:
    """One row per arm of the replay."""
    return [{"arm": arm, "device_pool_tokens": run["device_pool_tokens"],
             "tier_gib": _f(replay["tier_gib"]) if arm == "device+tier" else "-",
             "requests": run["num_requests"],
             "ttft_mean_s": _f(run["ttft_s_mean"]), "ttft_p90_s": _f(run["ttft_s_p90"]),
             "output_tok_s": _f(run["output_tokens_per_virtual_s"], 1),
             "prefix_hit_pct": _f(100 * run["prefix_cache_hit_tokens"]
                                  / run["prefix_cache_query_tokens"], 1)
             if run["prefix_cache_query_tokens"] else "-",
             "tier_hit_tokens": run.get("prefix_cache_tier_hit_tokens", "-")}
            for arm, run in replay["arms"].items()]


def block_cost_rows(costs: dict) -> list[dict]:
    """A block recomputed against loaded, measured here and projected for a GPU."""
    engine, gpu = costs["engine"], costs["gpu_projection"]
    return [{"where": "this CPU, engine (measured)",
             "recompute_ms_per_block": _f(engine["recompute_ms_per_block"], 2),
             "load_ms_per_block": _f(engine["load_ms_per_block"], 2),
             "recompute_over_load": _f(engine["recompute_ms_per_block"]
                                       / engine["load_ms_per_block"], 1)},
            {"where": f"{gpu['model']} on an A100 over PCIe (step-cost model)",
             "recompute_ms_per_block": _f(gpu["recompute_ms_per_block"], 2),
             "load_ms_per_block": _f(gpu["load_ms_per_block"], 2),
             "recompute_over_load": _f(gpu["recompute_over_load"], 1)}]


def validation_rows(sections: dict) -> list[dict]:
    rows = []
    for dataset, section in sections.items():
        for policy, measures in section.items():
            if policy == "sim_vs_engine_gap_pct":
                continue
            for measure, values in measures.items():
                rows.append({"dataset": dataset, "policy": policy, "measure": measure,
                             "simulator": _f(values["simulator"], 2),
                             "engine": _f(values["engine"], 2),
                             "gap_pct": _f(values["gap_pct"], 1)})
    return rows


def summary_rows(report: dict) -> list[dict]:
    """The headline numbers of whatever studies ran, one row each."""
    rows = [{"measure": f"{study} study wall clock (s)", "value": f"{seconds:.0f}", "paper": "-"}
            for study, seconds in report.get("study_wall_s", {}).items()]
    for versus, paper in FIGURE12_SHAREGPT_RATE_RATIO.items():
        key = f"rate_ratio_{versus}"
        if key in report:
            rows.append({"measure": f"{key} (ShareGPT-like; {report[key + '_bound']})",
                         "value": _f(report[key], 2), "paper": str(paper)})
    for dataset, result in report.get("figure12", {}).items():
        for key, ratio in result["capacity_ratios"].items():
            rows.append({"measure": f"{key} ({dataset}-like)", "value": _f(ratio, 2),
                         "paper": "-"})
    for dtype, ratio in report.get("kv_dtype", {}).get("capacity_ratios_vs_float32", {}).items():
        rows.append({"measure": f"capacity ratio {dtype} vs float32 KV (ShareGPT-like)",
                     "value": _f(ratio, 2), "paper": "-"})
    for dtype, ratio in report.get("kv_dtype", {}).get("rate_ratios_vs_float32", {}).items():
        rows.append({"measure": f"sustained rate ratio {dtype} vs float32 KV (ShareGPT-like)",
                     "value": _f(ratio, 2), "paper": "-"})
    rows += accelerator_study.summary_rows(report.get("accelerators"))
    rows += prefix_summary_rows(report.get("figure16"))
    rows += chatbot_summary_rows(report.get("figure17"))
    for policy, gap in report.get("sim_vs_engine_gap_pct", {}).items():
        rows.append({"measure": f"sim_vs_engine_gap_pct, mean running, {policy}",
                     "value": _f(gap, 1), "paper": "-"})
    return rows


def _ratio_row(measure: str, ratios: dict, key: str, paper) -> dict:
    bound = ratios.get(key + "_bound")
    return {"measure": measure + (f" ({bound})" if bound else ""),
            "value": _f(ratios.get(key), 2), "paper": paper}


def prefix_summary_rows(section: dict | None) -> list[dict]:
    """Figure 16's paged / Orca (Oracle) ratios, engine and simulator, per prefix: the
    sustained rates', or the capacities' where only those ran."""
    if section is None:
        return []
    rows = []
    for prefix, result in section["prefixes"].items():
        paper = f"{section['paper_rate_ratio'][prefix]:g}"
        for where, label in (("engine", "engine"),
                             ("simulator", "simulated LLaMA-13B on an A100")):
            run = result[where]
            kind = "rate_ratio" if "rate_ratios" in run else "capacity_ratio"
            rows.append(_ratio_row(f"figure 16 {prefix} {kind}_vs_orca_oracle, {label}",
                                   run.get("rate_ratios") or run["capacity_ratios"],
                                   f"{kind}_vs_orca_oracle", paper))
    return rows


def chatbot_summary_rows(section: dict | None) -> list[dict]:
    """Figure 17's ratios over each Orca policy, and the replay's TTFT ratios."""
    if section is None:
        return []
    rows = []
    if "figure17" in section:
        chat = section["figure17"]
        ratios = chat.get("rate_ratios") or chat["capacity_ratios"]
        kind = "rate_ratio" if "rate_ratios" in chat else "capacity_ratio"
        rows += [_ratio_row(f"figure 17 {kind}_vs_{policy.replace('-', '_')}, engine", ratios,
                            f"{kind}_vs_{policy.replace('-', '_')}",
                            f"{chat['paper_rate_ratio']:g}")
                 for policy in rate_study.ORCA_POLICIES]
    if "replay" in section:
        rows += [{"measure": f"replay TTFT, {key}", "value": _f(value, 2), "paper": "-"}
                 for key, value in section["replay"]["ttft_ratios"].items()]
    return rows
