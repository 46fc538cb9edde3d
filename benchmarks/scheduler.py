"""Host time of one decode step: schedule + block bookkeeping + padded gather indices.

For 64, 256 and 1024 running sequences at block size 16, each step times
`Scheduler.schedule()` (with the BlockManager's slot appends and its committed
step), `build_model_input()` (the padded int32 arrays the device step reads)
and `Scheduler.update_from_output()` (computed tokens, prefix-cache
registration, the drawn tokens appended and their stop checks). Contexts of
128 and 2048 tokens and a 4x larger pool show what the cost does not depend on.
The peer, measured in the same run, is the same scheduler over Orca's
contiguous arena (experiments.baselines), which keeps no block tables.

Target: <= 1 ms per step at 256 running sequences, growing at most linearly
with the number of running sequences. Times are this thread's CPU time (a
shared machine's other processes do not inflate them) with the wall-clock
median beside. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np

from experiments.baselines import ContiguousArena
from experiments.report import new_report, progress
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.batch_builder import build_model_input
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SampledTokens
from jpaged.memory.block_manager import BlockManager
from jpaged.sequence import Sequence, SequenceGroup

BLOCK_SIZE = 16
TARGET_MS_AT_256 = 1.0
PREFILL_BUDGET = 8192


def max_len(num_seqs: int, context_len: int, steps: int) -> int:
    """Room for the prompt, the tokens decoded while others prefill, and the timed steps."""
    setup_steps = math.ceil(num_seqs * context_len / (PREFILL_BUDGET - num_seqs))
    return context_len + setup_steps + steps + 1


def running_scheduler(manager, num_seqs: int, context_len: int, steps: int, seed: int = 0):
    """A scheduler whose `num_seqs` sequences have up to `context_len` tokens computed and decode.

    Prompt lengths step down by one token per sequence, over a block, so that
    each step about 1/BLOCK_SIZE of the sequences start a new block (allocation,
    prefix-cache registration), as in a steady state. Equal lengths would put
    every sequence's block boundary on the same step, leaving the median step
    with no block work at all.
    """
    config = SchedulerConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=PREFILL_BUDGET,
        max_model_len=max_len(num_seqs, context_len, steps),
    )
    scheduler = Scheduler(config, manager)
    tokens = np.random.default_rng(seed).integers(0, 32000, (num_seqs, context_len)).tolist()
    prompts = [row[: context_len - seq_id % BLOCK_SIZE] for seq_id, row in enumerate(tokens)]
    for seq_id, prompt in enumerate(prompts):
        scheduler.add_request(SequenceGroup(f"r{seq_id}", [Sequence(0, prompt)]))
    decoding: set[str] = set()
    while len(decoding) < num_seqs:
        output = scheduler.schedule()
        scheduler.update_from_output(output, tokens_for(output, 1))
        decoding.update(group.request_id for group, _ in output.draws)
    return scheduler


def tokens_for(output, token: int) -> SampledTokens:
    """`token` for every draw of the step, all finite."""
    return SampledTokens(np.full(output.num_draws, token, np.int64),
                         np.ones(output.num_draws, bool))


def time_steps(scheduler: Scheduler, steps: int, build: bool) -> dict[str, float]:
    """Median milliseconds per decode step, in total and by phase.

    Phases are timed in this thread's CPU time, which other processes on a
    shared machine do not inflate; `step_wall_ms` is the wall-clock median.
    """
    phases: dict[str, list[float]] = {"schedule": [], "build": [], "update": [], "step": []}
    walls = []
    for step in range(steps):
        wall_start, start = time.perf_counter(), time.thread_time()
        output = scheduler.schedule()
        scheduled = time.thread_time()
        if build:
            build_model_input(output.scheduled, scheduler.block_manager)
        built = time.thread_time()
        scheduler.update_from_output(output, tokens_for(output, step))
        updated = time.thread_time()
        walls.append(time.perf_counter() - wall_start)
        phases["schedule"].append(scheduled - start)
        phases["build"].append(built - scheduled)
        phases["update"].append(updated - built)
        phases["step"].append(updated - start)
    medians = {f"{name}_ms": 1e3 * statistics.median(times) for name, times in phases.items()}
    return medians | {"step_wall_ms": 1e3 * statistics.median(walls)}


def pool_blocks(num_seqs: int, context_len: int, steps: int) -> int:
    return num_seqs * math.ceil(max_len(num_seqs, context_len, steps) / BLOCK_SIZE)


def measure_paged(num_seqs: int, context_len: int, pool_scale: int, steps: int) -> dict:
    num_blocks = pool_scale * pool_blocks(num_seqs, context_len, steps) + 1
    manager = BlockManager(CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, watermark=0))
    scheduler = running_scheduler(manager, num_seqs, context_len, steps)
    timings = time_steps(scheduler, steps, build=True)
    settings = {"num_seqs": num_seqs, "context_len": context_len, "pool_blocks": num_blocks - 1}
    return settings | timings | {"us_per_seq": 1e3 * timings["step_ms"] / num_seqs}


def measure_contiguous(num_seqs: int, context_len: int, steps: int) -> dict:
    total = max_len(num_seqs, context_len, steps)
    slots = num_seqs * total
    manager = ContiguousArena(slots, "orca-max", total)  # every slab max_model_len = total
    scheduler = running_scheduler(manager, num_seqs, context_len, steps)
    timings = time_steps(scheduler, steps, build=False)
    return {
        "num_seqs": num_seqs,
        "context_len": context_len,
        "schedule_update_ms": (timings["schedule_ms"] + timings["update_ms"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per setting")
    args = parser.parse_args(argv)
    report = new_report("benchmarks.scheduler", argv)
    steps = args.steps

    by_seqs = [measure_paged(n, 2048, 1, steps) for n in (64, 256, 1024)]
    short_context = measure_paged(256, 128, 1, steps)
    big_pool = measure_paged(256, 2048, 4, steps)
    peers = [measure_contiguous(n, 2048, steps) for n in (64, 256, 1024)]
    at_256 = by_seqs[1]
    for row in by_seqs + [short_context, big_pool]:
        progress(json.dumps(row))

    report |= {
        "settings": {
            "block_size": BLOCK_SIZE,
            "timed_steps": steps,
            "prefix_caching": True,
            "step": "every running sequence decodes one token",
        },
        "measurements": {
            "by_running_seqs": by_seqs,
            "context_128": short_context,
            "pool_4x": big_pool,
            "peer_contiguous_scheduler": peers,
        },
        "ratios": {
            "step_ms_256_over_target": at_256["step_ms"] / TARGET_MS_AT_256,
            "us_per_seq_1024_over_64": by_seqs[2]["us_per_seq"] / by_seqs[0]["us_per_seq"],
            "step_ms_1024_over_256": by_seqs[2]["step_ms"] / at_256["step_ms"],
            "step_ms_context_2048_over_128": at_256["step_ms"] / short_context["step_ms"],
            "step_ms_pool_4x_over_1x": big_pool["step_ms"] / at_256["step_ms"],
            "schedule_update_over_peer_at_256": (
                (at_256["schedule_ms"] + at_256["update_ms"]) / peers[1]["schedule_update_ms"]
            ),
        },
        "target": {
            "step_ms_at_256_max": TARGET_MS_AT_256,
            "met": at_256["step_ms"] <= TARGET_MS_AT_256,
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
