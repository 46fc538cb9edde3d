"""Compiling an engine's steps before it serves: every shape, in threads, and a cache on disk."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.step_shapes import StepShapes
from jpaged.engine.decode_loop import padding_input
from jpaged.engine.runner import ModelRunner
from jpaged.memory.allocator import BlockPool
from jpaged.model.default_model import cache_directory
from jpaged.model.sampler import SamplingRow, sampling_tensors


def use_persistent_compilation_cache() -> None:
    """Keep compiled steps on disk (under the jpaged cache) unless the user chose a place:
    a process that serves the same shapes again loads them instead of compiling."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_directory() / "xla"))


def warmup(runner: ModelRunner, shapes: StepShapes, *, vocab_size: int, hidden_size: int,
           num_top: int, decode_loop: tuple[BlockPool, int] | None = None,
           async_scheduling: bool = False) -> int:
    """Compile every step shape the limits allow, so serving never compiles: the model
    steps, the logits and the sampler's four variants (greedy or drawing, with or
    without the dense inputs of penalties, logit bias and min_tokens) for every row
    count, and the prompt log-probabilities; with decode_loop = (the device pool,
    num_decode_steps), the decode loop of every decode step shape, greedy and drawing;
    with async_scheduling, the feeding of each step's inputs from a sampler's tokens.

    XLA compiles without holding the GIL, so the compiles run in one thread per
    core; each step shape then runs once, from the compiled cache, on the
    donated KV cache (which threads cannot share).

    returns the number of (token, sequence, block) bucket shapes run.
    """
    step_shapes = shapes.warmup_shapes()
    row_counts = sorted({s for _, s, _, decode_only in step_shapes if decode_only})
    # One thread per core; os.sched_getaffinity would exist on Linux only.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = [pool.submit(runner.compile_step, *shape) for shape in step_shapes]
        jobs += [pool.submit(call) for call in _sampling_calls(
            runner, shapes, row_counts, vocab_size, hidden_size, num_top)]
        if async_scheduling:
            jobs += [pool.submit(call) for call in _feed_calls(runner, shapes, step_shapes)]
        loops = _loop_calls(runner, step_shapes, vocab_size, num_top, decode_loop)
        jobs += [pool.submit(partial(runner.compile_decode_loop, *args, **kwargs))
                 for args, kwargs in loops]
        for job in jobs:
            job.result()
    for shape in step_shapes:
        runner.run_padding_step(*shape)
    for args, kwargs in loops:
        runner.decode_loop(*args, **kwargs)
    return len(step_shapes)


def _feed_calls(runner: ModelRunner, shapes: StepShapes,
                step_shapes: list[tuple[int, int, int, bool]]) -> list[Callable[[], Any]]:
    """`feed_tokens` for every step's token count and every sampler row count."""
    token_counts = {num_tokens for num_tokens, _, _, _ in step_shapes}
    row_counts = {shapes.sampler_rows(n) for n in range(1, shapes.max_rows + 1)}
    return [partial(runner.feed_tokens, np.zeros(tokens, np.int32), jnp.zeros(rows, jnp.int32),
                    np.zeros(tokens, np.int32))
            for tokens in token_counts for rows in row_counts]


def _loop_calls(runner: ModelRunner, step_shapes: list[tuple[int, int, int, bool]],
                vocab_size: int, num_top: int, decode_loop: tuple[BlockPool, int] | None
                ) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of a decode loop of each decode step shape, greedy and drawing."""
    if decode_loop is None:
        return []
    device_pool, num_steps = decode_loop
    return [((device_pool, padding_input(rows, blocks, vocab_size, draws)),
             dict(num_steps=num_steps, num_top=num_top))
            for _, rows, blocks, decode_only in step_shapes if decode_only
            for draws in (False, True)]


def _sampling_calls(runner: ModelRunner, shapes: StepShapes, row_counts: list[int],
                    vocab_size: int, hidden_size: int, num_top: int
                    ) -> list[Callable[[], Any]]:
    """Calls that compile what follows a step of each row count: its logits, the
    gathers of its rows for the sampler, the sampler's variants for each padded
    row count (with speculative decoding, those that verify proposals too), and
    the prompt log-probabilities. Each runs on its own zeros."""
    dtype = runner.hidden_dtype
    mixed_rows = shapes.buckets.mixed_num_seqs
    calls = []
    for num_rows in row_counts:
        if mixed_rows >= num_rows:  # a mixed step's logits of its rows in use
            calls.append(partial(runner.logits, jnp.zeros((mixed_rows, hidden_size), dtype),
                                 num_rows))
        calls += [partial(runner.gather_rows, jnp.zeros((num_rows, vocab_size), jnp.float32),
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
        logits = jnp.zeros((padded, vocab_size), jnp.float32)
        calls += [partial(runner.sample, logits, np.zeros(padded, np.int32),
                          sampling_tensors([variant], padded, vocab_size), num_top)
                  for variant in variants]
    calls.append(partial(runner.token_logprobs, jnp.zeros((1, hidden_size), dtype),
                         np.zeros(1, np.int32), num_top))
    return calls
