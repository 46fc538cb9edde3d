"""Start-up: `python -m jpaged generate` end to end, as a new user runs it.

    python -m benchmarks.cli_start [--repeats 3 --baseline REV]

Each run is a fresh process answering "What is the capital of France?" (the
README's main command) on the default model, already downloaded and converted,
with an empty compilation cache of its own: the whole wall time from process
start to exit. The peer is transformers doing the same job in its own process
(load the same converted model and tokenizer, apply the chat template, greedy
decoding up to the CLI's 128 tokens). With --baseline, the same command also
runs from a git revision of jpaged, so a change is measured against what it
replaces in the same run. Runs interleave (baseline, jpaged, transformers, ...)
so load on the machine falls on all of them alike; figures are medians.

Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.report import REPO, new_report, progress, record_end_load

PROMPT = "What is the capital of France?"
TRANSFORMERS_PEER = """
import sys
import torch, transformers
from jpaged.model.loader import default_model_directory
directory = default_model_directory()
tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
text = tokenizer.apply_chat_template([{"role": "user", "content": sys.argv[1]}], tokenize=False,
                                     add_generation_prompt=True)
ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=128)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
"""


def timed_run(command: list[str], source: Path) -> tuple[float, str]:
    """(wall seconds, stdout) of one process run from `source`, with an empty
    compilation cache."""
    with tempfile.TemporaryDirectory(prefix="xla-cache-") as cache:
        env = {**os.environ, "PYTHONPATH": str(source), "JAX_COMPILATION_CACHE_DIR": cache}
        started = time.perf_counter()
        result = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed in {source}:\n{result.stderr}")
    return seconds, result.stdout


def export_revision(revision: str, target: Path) -> Path:
    """The tracked files of `revision` of this repository, written under target."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time the command from this git revision of jpaged")
    args = parser.parse_args(argv)
    report = new_report("benchmarks.cli_start", argv, peers=("torch", "transformers"))
    cli = [sys.executable, "-m", "jpaged", "generate", PROMPT]
    timed_run(cli, REPO)  # downloads and converts the model if it is not cached yet
    with tempfile.TemporaryDirectory(prefix="jpaged-baseline-") as scratch:
        systems = {"jpaged": (cli, REPO),
                   "transformers": ([sys.executable, "-c", TRANSFORMERS_PEER, PROMPT], REPO)}
        if args.baseline:
            systems = {"baseline": (cli, export_revision(args.baseline, Path(scratch))),
                       **systems}
        seconds = {name: [] for name in systems}
        answers = {}
        for repeat in range(args.repeats):
            for name, (command, source) in systems.items():
                elapsed, answers[name] = timed_run(command, source)
                seconds[name].append(round(elapsed, 2))
                progress(f"run {repeat + 1}/{args.repeats} {name}: {elapsed:.1f} s")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    record_end_load(report)
    report |= {
        "settings": vars(args) | {"prompt": PROMPT, "compilation_cache": "empty, per run",
                                  "model": "smollm2, cached"},
        "seconds": seconds,
        "answers": answers,
        "generate_cli_s": medians["jpaged"],
        "transformers_s": medians["transformers"],
        "ratio_vs_transformers": round(medians["transformers"] / medians["jpaged"], 2),
    }
    if args.baseline:
        report["baseline_s"] = medians["baseline"]
        report["speedup_vs_baseline"] = round(medians["baseline"] / medians["jpaged"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
