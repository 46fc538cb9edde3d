"""A job of several processes on loopback: what keeping them in lockstep costs a step.

    python -m benchmarks.multihost [--model smollm2] [--num-processes 3] [--rounds 5]
                                   [--batch 8] [--max-tokens 32]

Starts `python -m jpaged.launch` with this module as every process's program. Each
process drives one CPU device (the layout of hosts with one accelerator each) and
loads the model with tensor_parallel_size = --num-processes, so every step's
all-reduces cross the processes (gloo on loopback). They run the same batch of
greedy requests (random 32-token prompts, --max-tokens new tokens each): once to
compile, then --rounds times, each engine step timed. After each round the
processes time the lockstep's collective alone, 100 gathers of a plan's 16-byte
digest in a row, and the digest of the running plan.

Reported: the median step (ms), the median check (gather and digest, ms) and their
ratio, the share of a step the check adds. Target: under 5% of a step. The
processes' output (JAX's and gloo's logs among it) goes to files, whose folder is
named on stderr; process 0's report is printed, one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.report import new_report, progress, record_end_load

CHECKS_PER_ROUND = 100
PROMPT_TOKENS = 32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--report-file", type=Path, default=None,
                        help=argparse.SUPPRESS)  # set for the processes: where 0 writes
    return parser.parse_args(argv)


def timed_round(engine, prompts, params) -> list[float]:
    """Seconds of each step of one batch."""
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return steps


def timed_checks(engine) -> tuple[float, float]:
    """(seconds of one gather of a digest, seconds of one digest of a plan of the batch)."""
    from jpaged.engine.lockstep import DIGEST_BYTES, schedule_digest

    lockstep, digest = engine.core.lockstep, np.zeros(DIGEST_BYTES, np.uint8)
    lockstep.group.allgather(digest)
    started = time.perf_counter()
    for _ in range(CHECKS_PER_ROUND):
        lockstep.group.allgather(digest)
    gather = (time.perf_counter() - started) / CHECKS_PER_ROUND
    plan = engine.scheduler.schedule()
    started = time.perf_counter()
    schedule_digest(plan, engine.block_manager.block_tables)
    hashing = time.perf_counter() - started
    for group in list(plan.running):  # the plan's sequences end here, their blocks freed
        engine.abort(group.request_id)
    return gather, hashing


def worker(args: argparse.Namespace, arguments: list[str]) -> None:
    from jpaged.launch import initialize

    is_first = initialize()
    import jax

    from jpaged.entrypoints.llm import LLM
    from jpaged.sampling_params import SamplingParams

    report = new_report("benchmarks.multihost", arguments) if is_first else None
    llm = LLM(args.model, tensor_parallel_size=jax.device_count(), max_num_seqs=args.batch,
              persistent_compilation_cache=False)
    engine, rng = llm.engine, np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [rng.integers(1, vocab, PROMPT_TOKENS).tolist() for _ in range(args.batch)]
    timed_round(engine, prompts, params)  # compiles every shape the batch meets
    steps, gathers, digests = [], [], []
    for round_index in range(args.rounds):
        steps += timed_round(engine, prompts, params)
        engine.add_request("check", {"prompt_token_ids": prompts[0]}, params)
        gather, hashing = timed_checks(engine)
        gathers.append(gather)
        digests.append(hashing)
        if is_first:
            progress(f"round {round_index + 1}/{args.rounds}: step "
                     f"{1e3 * statistics.median(steps):.2f} ms, gather {1e3 * gather:.3f} ms")
    if not is_first:
        return
    record_end_load(report)
    step_ms = 1e3 * statistics.median(steps)
    check_ms = 1e3 * (statistics.median(gathers) + statistics.median(digests))
    report |= {
        "model": args.model, "num_processes": jax.process_count(),
        "devices": [str(device) for device in jax.devices()], "batch": args.batch,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "steps_timed": len(steps),
        "step_ms_median": round(step_ms, 3),
        "check_gather_ms_median": round(1e3 * statistics.median(gathers), 4),
        "check_digest_ms_median": round(1e3 * statistics.median(digests), 4),
        "check_share_of_step": round(check_ms / step_ms, 4),
        "target_check_share": 0.05,
    }
    args.report_file.write_text(json.dumps(report))


def main(argv=None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(arguments)
    if args.report_file is not None:
        worker(args, arguments[:arguments.index("--report-file")])
        return 0
    from jpaged.launch import LaunchConfig, launch

    run_dir = Path(tempfile.mkdtemp(prefix="jpaged-multihost-"))
    progress(f"the processes' output: {run_dir}")
    report_file = run_dir / "report.json"
    status = launch(LaunchConfig(
        ("-m", "benchmarks.multihost", *arguments, "--report-file", str(report_file)),
        num_processes=args.num_processes, log_dir=run_dir))
    if status == 0:
        print(report_file.read_text())
    return status


if __name__ == "__main__":
    sys.exit(main())
