"""End-to-end serving throughput: jpaged against Hugging Face `generate`, same model, same run.

    python -m benchmarks.throughput [--num-requests 128 --scale 0.25]

Two workloads on the default model (SmolLM2-135M-Instruct, float32):

(a) mixed: seeded ShareGPT-like request lengths (experiments.workloads, a
    synthetic fit to the paper's published means), scaled down by --scale to
    fit a CPU, all arriving at once. jpaged serves them with continuous
    batching; transformers runs them in static batches of --hf-batch-size,
    each batch generating until its longest request is done (static batching
    as the paper's baselines do). Throughput counts each request's own output
    tokens only.
(b) batch 1: one 64-token prompt, 128 greedy tokens.

Each system runs in its own process, so each one's peak memory (max RSS) is
its own. Prints one JSON object last, with ratios jpaged / transformers.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from experiments.report import new_report, progress
from experiments.workloads import sample_lengths
from jpaged.engine.stats import percentiles

MAX_TOTAL_LEN = 512


def mixed_workload(num_requests: int, scale: float, vocab_size: int, seed: int, token_seed: int,
                   dataset: str = "sharegpt", max_total_len: int = MAX_TOTAL_LEN):
    """[(prompt token ids, output length)], the dataset's lengths (ShareGPT-like or
    Alpaca-like) scaled by `scale` and clipped to max_total_len (prompts to half of it).

    The lengths come from `seed`, the token ids from `token_seed`: a warm-up run
    with other tokens takes the same steps (so compiles the same shapes) but
    gets no prefix-cache hits from the timed run's prompts.
    """
    lengths = sample_lengths(dataset, num_requests, np.random.default_rng(seed))
    prompt_lens = np.clip((lengths[:, 0] * scale).astype(int), 4, max_total_len // 2)
    output_lens = np.clip((lengths[:, 1] * scale).astype(int), 4, max_total_len - prompt_lens)
    tokens = np.random.default_rng(token_seed)
    return [
        (tokens.integers(0, vocab_size, p).tolist(), int(o))
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def run_jpaged(args) -> dict:
    from jpaged import LLM, SamplingParams
    from jpaged.engine.stats import EngineStats
    from jpaged.model.loader import load_model

    loaded = load_model("smollm2")
    vocab = loaded[1].vocab_size
    workload = mixed_workload(args.num_requests, args.scale, vocab, args.seed, args.seed + 1)
    llm = LLM("smollm2", loaded=loaded, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=MAX_TOTAL_LEN,
              kv_cache_memory_bytes=int(args.kv_cache_mib * 2**20))
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    warmup = mixed_workload(args.num_requests, args.scale, vocab, args.seed, args.seed + 2)
    started = time.perf_counter()
    llm.generate([p for p, _ in warmup], params)
    warmup_s = time.perf_counter() - started
    progress(f"jpaged warm-up run (compiles its step shapes): {warmup_s:.1f} s")

    llm.engine.stats = EngineStats()
    started = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - started
    progress(f"jpaged mixed workload: {elapsed:.1f} s")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == sum(o for _, o in workload), "a request lost tokens"
    summary = llm.engine.stats.summary()
    mixed = {
        "elapsed_s": elapsed,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / elapsed,
        "ttft_s": percentiles([o.metrics.ttft for o in outputs]),
        "tpot_s": percentiles([o.metrics.tpot(len(o.outputs[0].token_ids)) for o in outputs
                                if len(o.outputs[0].token_ids) > 1]),
        "kv_utilization_mean": summary["kv_utilization_mean"],
        "running_mean": summary["running_mean"],
        "preemptions": summary["preemptions"],
    }
    batch1 = _jpaged_batch1(llm, vocab, args.seed)
    return {"warmup_s": warmup_s, "kv_cache": str(llm.engine.kv_cache_info),
            "mixed": mixed, "batch1": batch1}


def _jpaged_batch1(llm, vocab: int, seed: int) -> dict:
    from jpaged import SamplingParams

    prompt, warmup = np.random.default_rng(seed + 1).integers(0, vocab, (2, 64)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    # Another prompt of the same length: the same shapes, no prefix-cache hit.
    llm.generate([warmup], params)
    started = time.perf_counter()
    output = llm.generate([prompt], params)[0]
    elapsed = time.perf_counter() - started
    return {"elapsed_s": elapsed, "output_tokens_per_s": 128 / elapsed,
            "ttft_s": output.metrics.ttft, "tpot_s": output.metrics.tpot(128)}


class _StepTimes:
    """A logits processor that records when each generation step's logits arrive."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model, torch, prompts: list[list[int]], max_new_tokens: int, pad_id: int):
    """Left-padded greedy generation of exactly max_new_tokens; returns step times."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    step_times = _StepTimes()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, pad_token_id=pad_id,
                       logits_processor=LogitsProcessorList([step_times]))
    return step_times.times


def run_transformers(args) -> dict:
    import torch
    import transformers

    from jpaged.model.loader import default_model_directory

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_directory(), dtype=torch.float32
    ).eval()
    vocab = model.config.vocab_size
    workload = mixed_workload(args.num_requests, args.scale, vocab, args.seed, args.seed + 1)
    pad_id = 0
    hf_generate(model, torch, [workload[0][0]], 4, pad_id)

    started = time.perf_counter()
    ttft, tpot = [], []
    for start in range(0, len(workload), args.hf_batch_size):
        batch = workload[start : start + args.hf_batch_size]
        times = hf_generate(model, torch, [p for p, _ in batch], max(o for _, o in batch), pad_id)
        progress(f"transformers batch {start // args.hf_batch_size}: {times[-1] - started:.1f} s")
        for _, num_out in batch:
            ttft.append(times[0] - started)
            if num_out > 1:
                tpot.append((times[num_out - 1] - times[0]) / (num_out - 1))
    elapsed = time.perf_counter() - started
    num_tokens = sum(o for _, o in workload)
    mixed = {"elapsed_s": elapsed, "output_tokens": num_tokens,
             "output_tokens_per_s": num_tokens / elapsed,
             "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot)}

    prompt, warmup = np.random.default_rng(args.seed + 1).integers(0, vocab, (2, 64)).tolist()
    hf_generate(model, torch, [warmup], 128, pad_id)
    started = time.perf_counter()
    times = hf_generate(model, torch, [prompt], 128, pad_id)
    elapsed = time.perf_counter() - started
    batch1 = {"elapsed_s": elapsed, "output_tokens_per_s": 128 / elapsed,
              "ttft_s": times[0] - started, "tpot_s": (times[-1] - times[0]) / 127}
    return {"torch_threads": torch.get_num_threads(), "mixed": mixed, "batch1": batch1}


def _child(args) -> None:
    result = run_jpaged(args) if args.system == "jpaged" else run_transformers(args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--scale", type=float, default=0.25,
                        help="factor on ShareGPT-like lengths, to fit a CPU")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=float, default=384,
                        help="jpaged's KV pool (transformers grows its cache per batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system", choices=["jpaged", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        _child(args)
        return
    report = new_report("benchmarks.throughput", peers=("torch", "transformers"))
    results = {}
    for system in ("jpaged", "transformers"):
        command = [sys.executable, "-m", "benchmarks.throughput", "--system", system,
                   *sys.argv[1:]]
        progress(f"running {system} ...")
        lines = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        results[system] = json.loads(lines.strip().splitlines()[-1])
    ours, theirs = results["jpaged"], results["transformers"]
    report |= {
        "settings": vars(args) | {"model": "smollm2 (SmolLM2-135M-Instruct)", "dtype": "float32",
                                  "max_total_len": MAX_TOTAL_LEN},
        "jpaged": ours,
        "transformers": theirs,
        "ratios": {
            "mixed_output_tokens_per_s": ours["mixed"]["output_tokens_per_s"]
            / theirs["mixed"]["output_tokens_per_s"],
            "batch1_output_tokens_per_s": ours["batch1"]["output_tokens_per_s"]
            / theirs["batch1"]["output_tokens_per_s"],
            "peak_rss": ours["peak_rss_mib"] / theirs["peak_rss_mib"],
        },
        "targets": {"mixed_output_tokens_per_s_ratio": ">= 2", "batch1_ratio": ">= 1"},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
