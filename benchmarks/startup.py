"""What a new user meets: `LLM()` with its defaults against transformers, same run.

    python -m benchmarks.startup [--only mixed,batch1,bf16,cli] [--quick] [--model DIR]
                                 [--baseline REV]

Figures, each peer measured in this run. Every section runs in a fresh process
per system, transformers right after jpaged, so the two meet about the same
load on a shared machine and each one's peak memory is its own:

- mixed_ratio_vs_transformers: output tok/s of `LLM()` with its defaults
  against transformers `generate` in static batches of --hf-batch-size (greedy,
  ignore_eos, the same requests, as benchmarks.throughput), on a ShareGPT-like
  and an Alpaca-like workload (experiments.workloads). jpaged runs a warm-up
  pass with other tokens first (it compiles the workload's step shapes).
- peak_rss_ratio_vs_transformers: peak RSS of each process after loading its
  model and serving the ShareGPT-like workload.
- batch1_ratio_vs_transformers: batch-1 decode tok/s (a 64-token prompt),
  the median of --batch1-rounds alternating rounds' ratios, with a profile of
  jpaged's step: the whole engine step against the jitted model step alone,
  sampling alone and the host's scheduling and batch building.
- bf16: batch-1 decode in bfloat16 (weights and KV) against float32, and greedy
  agreement with float32 over --bf16-prompts prompts: the first position where
  the two differ, per prompt.
- generate_cli_s: `python -m jpaged generate "What is the capital of France?"`,
  wall time with the model cached and an empty compilation cache, median of 3.
- cold_warmup_s: `LLMEngine.warmup()` with an empty compilation cache and the
  default limits (`python -m benchmarks.warmup`, whose whole report lands
  under "warmup": step shapes, step times, the decode step's memory analysis).

--baseline REV runs jpaged's mixed and batch-1 sections from that git revision
too and reports the ratios against it: the mixed sections in the order baseline,
jpaged, jpaged, baseline (each side's mean), batch-1 just before jpaged's own in
each round.
--quick runs every code path with a few short requests (a smoke test, not a
measurement). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.cli_start import export_revision
from benchmarks.throughput import hf_generate, mixed_workload
from experiments.report import REPO, new_report, progress

FIGURES = ("mixed", "batch1", "bf16", "cli", "cold_warmup")
DATASETS = ("sharegpt", "alpaca")
CLI_PROMPT = "What is the capital of France?"
TOPICS = ["the moon", "rivers", "bread", "volcanoes", "chess", "honey bees", "glass", "rain",
          "the printing press", "penguins", "copper", "tea", "bridges", "clocks", "deserts",
          "music", "salt", "owls", "maps", "paper", "the ocean", "trains", "cheese", "snow",
          "lighthouses", "bicycles", "coral reefs", "ink", "wind", "castles", "mushrooms",
          "the alphabet"]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _settings(args) -> dict:
    """Workload sizes: --quick shrinks everything to a smoke run."""
    if args.quick:
        return {"num_requests": 6, "scale": 0.05, "batch1_tokens": 8, "batch1_rounds": 1,
                "bf16_prompts": 2, "bf16_tokens": 8, "cli_runs": 1, "max_total_len": 64}
    return {"num_requests": args.num_requests, "scale": args.scale, "batch1_tokens": 128,
            "batch1_rounds": args.batch1_rounds,
            "bf16_prompts": args.bf16_prompts, "bf16_tokens": 32, "cli_runs": 3,
            "max_total_len": 512}


def _workload(args, vocab: int, dataset: str, token_seed_offset: int):
    s = _settings(args)
    return mixed_workload(s["num_requests"], s["scale"], vocab, args.seed,
                          args.seed + token_seed_offset, dataset, s["max_total_len"])


# jpaged's side, in its own process.


def jpaged_mixed(llm, args, dataset: str) -> dict:
    """Output tok/s of a warm-up pass (compiling) and of the timed pass."""
    from jpaged import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    workload = _workload(args, vocab, dataset, 1)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    started = time.perf_counter()
    llm.generate([p for p, _ in _workload(args, vocab, dataset, 2)], params)
    warmup_s = time.perf_counter() - started
    started = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == sum(o for _, o in workload), "a request lost tokens"
    progress(f"jpaged {dataset}: warm-up {warmup_s:.1f} s, timed {elapsed:.1f} s")
    return {"warmup_s": warmup_s, "elapsed_s": elapsed, "output_tokens": num_tokens,
            "output_tokens_per_s": num_tokens / elapsed}


def _batch1_prompts(vocab: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed + 1).integers(0, vocab, (2, 64)).tolist()


def jpaged_batch1(llm, args) -> dict:
    """Batch-1 decode tok/s, and where a step's time goes."""
    return {"output_tokens_per_s": jpaged_batch1_speed(llm, args),
            "profile_ms": batch1_profile(llm, args)}


def jpaged_batch1_speed(llm, args) -> float:
    """Decode tok/s of one 64-token prompt (a warm-up prompt of the same length first)."""
    from jpaged import SamplingParams

    num_tokens = _settings(args)["batch1_tokens"]
    prompt, warmup = _batch1_prompts(llm.engine.model_config.vocab_size, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate([warmup], params)
    started = time.perf_counter()
    llm.generate([prompt], params)
    return num_tokens / (time.perf_counter() - started)


def batch1_profile(llm, args, rounds: int = 16) -> dict:
    """Where a batch-1 decode step's time goes, in ms: building a step's padded inputs;
    then the whole engine step, the jitted model step alone (dispatch to result) and
    sampling alone, medians over interleaved rounds (a load change hits all alike)."""
    from jpaged import SamplingParams
    from jpaged.core.batch_builder import build_model_input
    from jpaged.worker.sampling_rows import SamplingRow, sampling_tensors

    engine, runner = llm.engine, llm.engine.runner
    # 60 tokens: the first decode position has its block already (60 is no multiple
    # of 8, 16 or 32), so its inputs can be built without scheduling.
    prompt = _batch1_prompts(engine.model_config.vocab_size, args.seed)[0][:60]
    engine.add_request("profile", prompt, SamplingParams(temperature=0.0, max_tokens=4 * rounds,
                                                         ignore_eos=True))
    engine.step()  # the prompt, in one chunk: every step after it decodes
    seq = engine.scheduler.running[0].seqs[0]
    started = time.perf_counter()
    for _ in range(rounds):
        inputs = build_model_input([(seq, 1)], engine.block_manager, engine.shapes.buckets, 1)
    build_ms = (time.perf_counter() - started) / rounds * 1e3
    # Rewrites position 60's K/V with the same values: harmless to the request.
    logits = runner.execute(inputs.input_ids, inputs.metadata, decode_only=True,
                            num_rows=inputs.num_rows)[0]
    rows = np.zeros(logits.shape[0], np.int32)
    tensors = sampling_tensors([SamplingRow.greedy(position=len(prompt))], logits.shape[0],
                               engine.model_config.vocab_size)
    parts = {
        "engine_step": engine.step,
        "jitted_model_step": lambda: runner.execute(
            inputs.input_ids, inputs.metadata, decode_only=True,
            num_rows=inputs.num_rows)[0].block_until_ready(),
        "sample": lambda: runner.sample(logits, rows, tensors, engine.config.max_logprobs),
    }
    times = {name: [] for name in parts}
    for _ in range(rounds):
        for name, part in parts.items():
            started = time.perf_counter()
            part()
            times[name].append((time.perf_counter() - started) * 1e3)
    engine.abort("profile")
    medians = {name: statistics.median(t) for name, t in times.items()}
    return medians | {"build_model_input": build_ms, "rest_of_engine_step": (
        medians["engine_step"] - medians["jitted_model_step"] - medians["sample"] - build_ms)}


def _bf16_prompts(count: int) -> list[str]:
    return [f"Question: What do you know about {TOPICS[i % len(TOPICS)]}?\nAnswer:"
            for i in range(count)]


def jpaged_bf16(llm, args) -> dict:
    """bfloat16 weights and KV against float32: batch-1 decode speed (interleaved,
    best of two each) and the first position where greedy outputs differ, per prompt."""
    from jpaged import LLM, SamplingParams

    s = _settings(args)
    bf16 = LLM(args.model, dtype="bfloat16")
    speed = {"float32": 0.0, "bfloat16": 0.0}
    for _ in range(2):
        for name, engine in (("float32", llm), ("bfloat16", bf16)):
            speed[name] = max(speed[name], jpaged_batch1_speed(engine, args))
    params = SamplingParams(temperature=0.0, max_tokens=s["bf16_tokens"], ignore_eos=True)
    prompts = _bf16_prompts(s["bf16_prompts"])
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    theirs = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(ours, theirs, strict=True)]
    same = [d is None for d in first_diff]
    return {"batch1_tokens_per_s": speed,
            "speedup_vs_float32": speed["bfloat16"] / speed["float32"],
            "prompts": len(prompts), "tokens_per_prompt": s["bf16_tokens"],
            "identical_outputs_rate": sum(same) / len(same),
            "first_differing_position": first_diff,
            "matching_prefix_mean": float(np.mean(
                [s["bf16_tokens"] if d is None else d for d in first_diff]))}


def run_jpaged(args, section: str) -> dict:
    """One section ("mixed:<dataset>", "batch1" or "bf16") with `LLM()`'s defaults."""
    from jpaged import LLM

    llm = LLM(args.model)  # the defaults, as a new user gets them
    result = {"kv_cache": str(llm.engine.kv_cache_info),
              "limits": {"max_num_seqs": llm.engine.config.max_num_seqs,
                         "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                         "max_model_len": llm.engine.max_model_len}}
    if section.startswith("mixed:"):
        return result | jpaged_mixed(llm, args, section.removeprefix("mixed:"))
    if section == "batch1":
        return result | jpaged_batch1(llm, args)
    return result | jpaged_bf16(llm, args)


# transformers' side, in its own process.


def _hf_directory(model: str) -> str:
    from jpaged.model.loader import default_model_directory

    return str(default_model_directory()) if model == "smollm2" else model


def transformers_mixed(model, torch, args, dataset: str) -> dict:
    s = _settings(args)
    workload = _workload(args, model.config.vocab_size, dataset, 1)
    started = time.perf_counter()
    for start in range(0, len(workload), args.hf_batch_size):
        batch = workload[start : start + args.hf_batch_size]
        hf_generate(model, torch, [p for p, _ in batch], max(o for _, o in batch), 0)
    elapsed = time.perf_counter() - started
    num_tokens = sum(o for _, o in workload)
    progress(f"transformers {dataset}: {elapsed:.1f} s ({s['num_requests']} requests)")
    return {"elapsed_s": elapsed, "output_tokens": num_tokens,
            "output_tokens_per_s": num_tokens / elapsed}


def transformers_batch1(model, torch, args) -> dict:
    num_tokens = _settings(args)["batch1_tokens"]
    prompt, warmup = _batch1_prompts(model.config.vocab_size, args.seed)
    hf_generate(model, torch, [warmup], num_tokens, 0)
    started = time.perf_counter()
    hf_generate(model, torch, [prompt], num_tokens, 0)
    return {"output_tokens_per_s": num_tokens / (time.perf_counter() - started)}


def run_transformers(args, section: str) -> dict:
    """One section ("mixed:<dataset>" or "batch1") with transformers' `generate`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        _hf_directory(args.model), dtype=torch.float32).eval()
    hf_generate(model, torch, [[1, 2, 3, 4]], 4, 0)
    result = {"torch_threads": torch.get_num_threads()}
    if section.startswith("mixed:"):
        return result | transformers_mixed(model, torch, args, section.removeprefix("mixed:"))
    return result | transformers_batch1(model, torch, args)


# Figures measured from the parent.


def generate_cli_s(args) -> dict:
    """Wall time of the README's command, each run with an empty compilation cache."""
    command = [sys.executable, "-m", "jpaged", "generate", CLI_PROMPT, "--model", args.model]
    if args.model != "smollm2":
        command.append("--raw")  # a test model may have no chat template
    times = []
    for _ in range(_settings(args)["cli_runs"]):
        with tempfile.TemporaryDirectory() as cache:
            env = os.environ | {"JAX_COMPILATION_CACHE_DIR": cache}
            started = time.perf_counter()
            answer = subprocess.run(command, check=True, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True).stdout
            times.append(time.perf_counter() - started)
    return {"median_s": statistics.median(times), "runs_s": times,
            "answer": answer.strip()[:200]}


def cold_warmup(args) -> dict:
    """`python -m benchmarks.warmup` on the same model: `LLMEngine.warmup()` with an empty
    compilation cache and the default limits, then step times."""
    command = [sys.executable, "-m", "benchmarks.warmup", "--model", args.model]
    if args.quick:
        command += ["--prompt-len", "16"]
    progress("running the cold warm-up ...")
    lines = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(lines.strip().splitlines()[-1])


def _child_result(system: str, section: str, source: Path = REPO) -> dict:
    """Run one section in a fresh process: its peak RSS is that section's alone. source:
    the jpaged tree it runs (a baseline revision's, for --baseline)."""
    argv = _without_baseline(sys.argv[1:])
    command = [sys.executable, "-m", "benchmarks.startup", "--system", system,
               "--section", section, *argv]
    progress(f"running {system} {section} from {source} ...")
    env = os.environ | {"PYTHONPATH": str(source)}
    lines = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, cwd=source,
                           env=env).stdout
    return json.loads(lines.strip().splitlines()[-1])


def _mean_run(runs: list[dict]) -> dict:
    """One section's runs as one: the first run's figures, with the mean throughput and
    time of all of them, each of which is kept under "runs"."""
    return runs[0] | {
        "output_tokens_per_s": statistics.mean(r["output_tokens_per_s"] for r in runs),
        "elapsed_s": statistics.mean(r["elapsed_s"] for r in runs),
        "runs": [{key: r[key] for key in ("output_tokens_per_s", "elapsed_s", "load_average")}
                 for r in runs]}


def _without_baseline(argv: list[str]) -> list[str]:
    """The arguments but --baseline REV: a child measures one tree."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--baseline":
            skip = True
        elif not arg.startswith("--baseline="):
            kept.append(arg)
    return kept


def _child(args) -> None:
    run = run_jpaged if args.system == "jpaged" else run_transformers
    result = run(args, args.section)
    result |= {"peak_rss_mib": _peak_rss_mib(), "load_average": os.getloadavg()}
    print(json.dumps(result))


def _run_sections(args, figures: list[str], baseline: Path | None
                  ) -> tuple[dict, dict, dict]:
    """Each peer right after jpaged on the same section, so all meet the same load:
    the baseline revision's jpaged (if any), jpaged, transformers.
    -> (jpaged's results, transformers' results, the baseline's) by figure."""
    ours, theirs, base = {}, {}, {}
    if "mixed" in figures:
        for results in (ours, theirs, base):
            results["mixed"] = {}
        for dataset in DATASETS:
            section = f"mixed:{dataset}"
            if baseline is None:
                ours["mixed"][dataset] = _child_result("jpaged", section)
            else:
                # baseline, jpaged, jpaged, baseline: a machine that slows down (or speeds
                # up) over the runs weighs on both sides alike.
                old = [_child_result("jpaged", section, baseline)]
                new = [_child_result("jpaged", section), _child_result("jpaged", section)]
                old.append(_child_result("jpaged", section, baseline))
                ours["mixed"][dataset], base["mixed"][dataset] = _mean_run(new), _mean_run(old)
            theirs["mixed"][dataset] = _child_result("transformers", section)
        # Peak memory of the ShareGPT-like run: model, pool, compiled steps, workload.
        for results in (ours, theirs, base):
            if results["mixed"]:
                results["peak_rss_mib"] = results["mixed"]["sharegpt"]["peak_rss_mib"]
    systems = [("jpaged", ours, REPO), ("transformers", theirs, REPO)]
    if baseline is not None:
        systems.insert(0, ("jpaged", base, baseline))
    if "batch1" in figures:
        # Alternating rounds: batch-1 decode is short, so a burst of load on a shared
        # machine can hit one system's run alone; the median round ratio resists it.
        for _, results, _ in systems:
            results["batch1"] = {"rounds": []}
        for _ in range(_settings(args)["batch1_rounds"]):
            for system, results, source in systems:
                results["batch1"]["rounds"].append(_child_result(system, "batch1", source))
    if "bf16" in figures:
        ours["bf16"] = _child_result("jpaged", "bf16")
    return ours, theirs, base


def _ratio(ours: dict, theirs: dict, *keys: str) -> float:
    def get(d):
        for key in keys:
            d = d[key]
        return d

    return get(ours) / get(theirs)


def _report(args, figures: list[str]) -> dict:
    report = new_report("benchmarks.startup", peers=("torch", "transformers"))
    report["settings"] = vars(args) | _settings(args)
    with tempfile.TemporaryDirectory(prefix="jpaged-baseline-") as scratch:
        baseline = export_revision(args.baseline, Path(scratch)) if args.baseline else None
        ours, theirs, base = _run_sections(args, figures, baseline)
    report |= {"jpaged": ours, "transformers": theirs}
    if args.baseline:
        report["baseline"] = base
        if "mixed" in figures:
            report["mixed_ratio_vs_baseline"] = {
                dataset: _ratio(ours, base, "mixed", dataset, "output_tokens_per_s")
                for dataset in DATASETS}
        if "batch1" in figures:
            report["batch1_ratio_vs_baseline"] = statistics.median(
                _ratio(mine, old, "output_tokens_per_s")
                for mine, old in zip(ours["batch1"]["rounds"], base["batch1"]["rounds"],
                                     strict=True))
    if "mixed" in figures:
        report["mixed_ratio_vs_transformers"] = {
            dataset: _ratio(ours, theirs, "mixed", dataset, "output_tokens_per_s")
            for dataset in DATASETS}
        report["peak_rss_ratio_vs_transformers"] = _ratio(ours, theirs, "peak_rss_mib")
    if "batch1" in figures:
        report["batch1_round_ratios"] = [
            _ratio(mine, peer, "output_tokens_per_s")
            for mine, peer in zip(ours["batch1"]["rounds"], theirs["batch1"]["rounds"],
                                  strict=True)]
        report["batch1_ratio_vs_transformers"] = statistics.median(report["batch1_round_ratios"])
    if "bf16" in figures:
        report["bf16"] = ours["bf16"]
    if "cli" in figures:
        report["generate_cli_s"] = generate_cli_s(args)
    if "cold_warmup" in figures:
        report["warmup"] = cold_warmup(args)
        report["cold_warmup_s"] = report["warmup"]["cold_warmup_s"]
    report["targets"] = {"mixed_ratio_vs_transformers": ">= 3.5 on each workload",
                         "peak_rss_ratio_vs_transformers": "<= 1.25",
                         "batch1_ratio_vs_transformers": ">= 1.5",
                         "generate_cli_s": "<= 10", "cold_warmup_s": "<= 30"}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(FIGURES),
                        help=f"comma-separated figures among {', '.join(FIGURES)}")
    parser.add_argument("--quick", action="store_true", help="a smoke run of every code path")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, or a Hugging Face directory both systems can load")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--scale", type=float, default=0.25,
                        help="factor on the datasets' lengths, to fit a CPU")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--bf16-prompts", type=int, default=32)
    parser.add_argument("--batch1-rounds", type=int, default=3,
                        help="alternating jpaged / transformers batch-1 runs; the ratio is "
                             "the median round's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also run jpaged's sections from this git revision, in the same "
                             "rounds (mixed_ratio_vs_baseline, batch1_ratio_vs_baseline)")
    parser.add_argument("--system", choices=["jpaged", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args()
    figures = [f for f in args.only.split(",") if f]
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figures {unknown}; choose among {', '.join(FIGURES)}")
    if args.system:
        _child(args)
        return
    print(json.dumps(_report(args, figures), indent=2))


if __name__ == "__main__":
    main()
