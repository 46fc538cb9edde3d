"""Warm-up: every shape a step runner uses, compiled before the engine serves.

A runner lists its `WarmupCalls`: compile jobs, which run in one thread per core (XLA
compiles without holding the GIL), then runs, one after another, each a call of a
compiled shape on the donated KV cache (which threads cannot share).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from jpaged.core.step_shapes import StepShapes
from jpaged.worker.model_runner import ModelRunner
from jpaged.worker.sampling_rows import SamplingRow, sampling_tensors


@dataclass
class WarmupCalls:
    """compiles: calls that compile and may run together in threads; runs: calls that
    then run one after another."""

    compiles: list[Callable[[], Any]] = field(default_factory=list)
    runs: list[Callable[[], Any]] = field(default_factory=list)

    def __add__(self, other: WarmupCalls) -> WarmupCalls:
        return WarmupCalls(self.compiles + other.compiles, self.runs + other.runs)


def run(calls: WarmupCalls) -> None:
    """The compiles, one thread per core, then the runs."""
    # One thread per core; os.sched_getaffinity would exist on Linux only.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for job in [pool.submit(call) for call in calls.compiles]:
            job.result()
    for call in calls.runs:
        call()


def step_calls(runner: ModelRunner, shapes: StepShapes, vocab_size: int, num_top: int
               ) -> WarmupCalls:
    """A model runner's every step shape the limits allow, then what follows a step:
    its logits, the sampler's four variants (greedy or drawing, with or without the
    dense inputs of penalties, logit bias and min_tokens) for every row count (with
    speculative decoding, those that verify proposals too; each serves rows with and
    without token masks), and the prompt log-probabilities; and the writes that load
    LoRA adapters into its slots."""
    step_shapes = shapes.warmup_shapes()
    row_counts = sorted({s for _, s, _, decode_only in step_shapes if decode_only})
    compiles = [partial(runner.compile_step, *shape) for shape in step_shapes]
    compiles += _sampling_jobs(runner, shapes, row_counts, vocab_size,
                               runner.config.hidden_size, num_top)
    compiles += runner.slot_write_compiles()
    return WarmupCalls(compiles, [partial(runner.run_padding_step, *shape)
                                  for shape in step_shapes])


def feed_calls(runner: ModelRunner, shapes: StepShapes) -> WarmupCalls:
    """Async scheduling's feeding of each step's inputs from a sampler's tokens."""
    return WarmupCalls(_feed_jobs(runner, shapes, shapes.warmup_shapes()))


def _feed_jobs(runner: ModelRunner, shapes: StepShapes,
               step_shapes: list[tuple[int, int, int, bool]]) -> list[Callable[[], Any]]:
    """`feed_tokens` for every step's token count and every sampler row count."""
    token_counts = {num_tokens for num_tokens, _, _, _ in step_shapes}
    row_counts = {shapes.sampler_rows(n) for n in range(1, shapes.max_rows + 1)}
    return [partial(runner.feed_tokens, np.zeros(tokens, np.int32),
                    runner.on_device(np.zeros((rows,), np.int32)), np.zeros(tokens, np.int32))
            for tokens in token_counts for rows in row_counts]


def _sampling_jobs(runner: ModelRunner, shapes: StepShapes, row_counts: list[int],
                    vocab_size: int, hidden_size: int, num_top: int
                    ) -> list[Callable[[], Any]]:
    """Calls that compile what follows a step of each row count: its logits, the
    gathers of its rows for the sampler, the sampler's variants for each padded
    row count (with speculative decoding, those that verify proposals too), and the
    prompt log-probabilities. Each runs on its own zeros, laid out as a step's outputs
    are."""
    dtype = runner.hidden_dtype

    def zeros(shape: tuple[int, ...], dtype) -> Any:
        return runner.on_device(np.zeros(shape, dtype))

    mixed_rows = shapes.buckets.mixed_num_seqs
    calls = []
    for num_rows in row_counts:
        if mixed_rows >= num_rows:  # a mixed step's logits of its rows in use
            calls.append(partial(runner.logits, zeros((mixed_rows, hidden_size), dtype),
                                 num_rows))
        calls += [partial(runner.gather_rows, zeros((num_rows, vocab_size), np.float32),
                          np.zeros(padded, np.int32))
                  for padded in {shapes.sampler_rows(n) for n in range(1, num_rows + 1)}]
    variants = [SamplingRow.greedy(position=0, temperature=temperature, **penalty)
                for temperature in (0.0, 1.0)
                for penalty in ({}, {"repetition_penalty": 1.5})]
    k = shapes.num_speculative_tokens
    if k:  # rows that verify a proposal
        variants += [dataclasses.replace(variant, proposal=0) for variant in variants]
    max_draws = row_counts[-1] * (1 + k)
    for padded in {shapes.sampler_rows(n) for n in range(1, max_draws + 1)}:
        logits = zeros((padded, vocab_size), np.float32)
        calls += [partial(runner.sample, logits, np.zeros(padded, np.int32),
                          sampling_tensors([variant], padded, vocab_size), num_top)
                  for variant in variants]
    calls.append(partial(runner.token_logprobs, zeros((1, hidden_size), dtype),
                         np.zeros(1, np.int32), num_top))
    return calls
