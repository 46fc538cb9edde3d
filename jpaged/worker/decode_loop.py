"""Decode steps that stay on the device: a batch of decoding sequences runs up to
`num_steps` steps in one jitted `lax.while_loop`, allocating its blocks on the device.

One iteration, for every live row b (a sequence that has not finished):

    slot     where b's table holds the null block at its position p_b, a block from
             the free queue's head (the allocator's own transitions, on the pool's
             arrays: jpaged.memory.allocator)
    model    one decode step of the batch: K/V written at p_b, attention over 0 .. p_b
    sample   the sampler (`jpaged.model.sampler`) at position p_b + 1: penalties read
             the output counts, which the loop updates, and min_tokens suppresses the
             stop tokens while the row has fewer outputs
    append   the token is b's next input; b finishes by the request's stop rule
             (jpaged.core.stop_rule: the host's, on the device's columns) or on
             non-finite logits

The loop ends after `num_steps` iterations, once every row finished, once a row
finished while requests wait for its place (`LoopInput.yield_on_finish`), before
an iteration whose blocks the pool cannot give, or once a block id it took or reads
lies outside the pool (`LoopOutput.out_of_range`: a corrupt pool; that iteration
writes the null block only, and the host raises); the host then takes what the loop
did (`EngineCore`) and preempts as it does after any step. The first iteration's
slots are the host's (its schedule made them private, copying on write); every
later block comes fresh from the queue, held once, so the loop never writes a
shared block. What a host check decides (stop strings) runs on the host after the
loop, which drops the tokens past a stop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.stop_rule import reaches_length, stops, suppresses_stops
from jpaged.memory import allocator
from jpaged.memory.allocator import BlockPool
from jpaged.model.sampler import NEUTRAL_PENALTIES, SamplerOutput, SamplingTensors, sample_tokens
from jpaged.worker.sampling_rows import SamplingRow, sampling_tensors


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoopInput:
    """A batch of decoding rows (B padded rows, M blocks per row, V vocabulary).

    input_ids:    int32 [B]     each row's last token, the first iteration's input
    positions:    int32 [B]     its position
    block_tables: int32 [B, M]  the rows' tables; the null block past their last block
    live:         bool [B]      real rows (padding rows never run)
    num_output:   int32 [B]     output tokens each row has
    max_output:   int32 [B]     the output length that ends it (max_tokens, max_model_len)
    min_tokens:   int32 [B]
    stop_mask:    bool [B, V]   the row's stop tokens (EOS and stop_token_ids)
    sampling:     the first iteration's SamplingTensors, dense (counts and bias present;
                  the bias without min_tokens' suppression, which the loop adds)
    yield_on_finish: bool []    end the loop once a row finishes (requests wait)
    """

    input_ids: chex.Array
    positions: chex.Array
    block_tables: chex.Array
    live: chex.Array
    num_output: chex.Array
    max_output: chex.Array
    min_tokens: chex.Array
    stop_mask: chex.Array
    sampling: SamplingTensors
    yield_on_finish: chex.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoopOutput:
    """What the loop did (S = num_steps, K = num_top).

    sampled:      SamplerOutput with rows [B * S]: row b * S + i is row b's i-th draw
    num_drawn:    int32 [B]     the draws of row b (its first num_drawn[b] entries)
    block_tables: int32 [B, M]  the tables with the blocks the loop took
    pool:         the device BlockPool after the loop
    out_of_range: bool []       a table held a block id outside the pool, or a live row's
                                position passed its table, in some iteration (sticky):
                                on the device an index there would be clamped or dropped
    """

    sampled: SamplerOutput
    num_drawn: chex.Array
    block_tables: chex.Array
    pool: BlockPool
    out_of_range: chex.Array


def padding_input(num_rows: int, num_blocks: int, vocab_size: int, draws: bool) -> LoopInput:
    """A loop input of `num_rows` padding rows (the loop ends before its first iteration),
    greedy or drawing: one of the two variants of a shape that warm-up compiles."""
    zeros = np.zeros(num_rows, np.int32)
    row = SamplingRow.greedy(position=0, temperature=1.0 if draws else 0.0)
    return LoopInput(
        input_ids=zeros, positions=zeros, block_tables=np.zeros((num_rows, num_blocks), np.int32),
        live=np.zeros(num_rows, bool), num_output=zeros, max_output=zeros, min_tokens=zeros,
        stop_mask=np.zeros((num_rows, vocab_size), bool),
        sampling=sampling_tensors([row], num_rows, vocab_size, dense=True),
        yield_on_finish=np.bool_(False))


def _entries(tables: chex.Array, positions: chex.Array, block_size: int) -> chex.Array:
    """int32 [B]: each row's table entry at its position (the last entry for a finished
    row past its table)."""
    return jnp.minimum(positions // block_size, tables.shape[1] - 1)


def _needs_block(tables: chex.Array, positions: chex.Array, live: chex.Array,
                 block_size: int) -> chex.Array:
    """bool [B]: live rows whose table holds the null block at their position."""
    rows = jnp.arange(tables.shape[0])
    return live & (tables[rows, _entries(tables, positions, block_size)] == 0)


def _slot_blocks(pool: BlockPool, tables: chex.Array, positions: chex.Array,
                 live: chex.Array, block_size: int) -> tuple[BlockPool, chex.Array]:
    """A block from the queue's head for each row that needs one, in row order (the
    host's order of `append_slots`)."""
    entries = _entries(tables, positions, block_size)
    needed = _needs_block(tables, positions, live, block_size)

    def take(row, carry):
        pool, tables = carry
        pool, block = allocator.take_free_block(pool, needed[row])
        return pool, allocator.store(tables, (row, entries[row]), block, needed[row])

    return jax.lax.fori_loop(0, tables.shape[0], take, (pool, tables))


def _out_of_range(tables: chex.Array, positions: chex.Array, live: chex.Array,
                  num_blocks: int, block_size: int) -> chex.Array:
    """bool []: whether a table entry is no block of a pool of num_blocks, or a live
    row's position lies past its table (`_entries` would clamp it onto the last entry)."""
    outside = ((tables < 0) | (tables >= num_blocks)).any()
    past = (live & (positions // block_size >= tables.shape[1])).any()
    return outside | past


def _metadata(tables: chex.Array, positions: chex.Array, live: chex.Array,
              block_size: int) -> AttentionMetadata:
    """One decode step's metadata (one KV cache group): finished and padding rows write
    the null block and attend to nothing."""
    rows = jnp.arange(tables.shape[0], dtype=jnp.int32)
    slots = (tables[rows, _entries(tables, positions, block_size)] * block_size
             + positions % block_size)
    return AttentionMetadata(
        slot_mapping=jnp.where(live, slots, rows % block_size)[None],
        positions=jnp.where(live, positions, 0),
        block_tables=tables[None],
        context_lens=jnp.where(live, positions + 1, 0),
        query_start_loc=jnp.arange(tables.shape[0] + 1, dtype=jnp.int32),
        logits_indices=rows,
    )


def decode_loop(step_fn, logits_fn, params, kv_cache, pool: BlockPool, inputs: LoopInput, *,
                num_steps: int, num_top: int, block_size: int):
    """Run the loop (see the module docstring). -> (LoopOutput, kv_cache).

    step_fn(params, input_ids [B], kv_cache, metadata) -> (last hidden [B, H], hidden,
    kv_cache): the runner's decode step; logits_fn(params, last_hidden) -> f32 [B, V].
    """
    num_rows = inputs.input_ids.shape[0]
    base = inputs.sampling
    first = SamplerOutput(
        tokens=jnp.zeros((num_rows, num_steps), jnp.int32),
        logprobs=jnp.zeros((num_rows, num_steps), jnp.float32),
        ranks=jnp.zeros((num_rows, num_steps), jnp.int32),
        top_ids=jnp.zeros((num_rows, num_steps, num_top), jnp.int32),
        top_logprobs=jnp.zeros((num_rows, num_steps, num_top), jnp.float32),
        finite=jnp.ones((num_rows, num_steps), bool),
        accepted=jnp.zeros((num_rows, num_steps), bool),
    )
    rows = jnp.arange(num_rows)
    # Rows that read the dense inputs; min_tokens' suppression is checked per iteration.
    uses_dense = (base.penalties != jnp.array(NEUTRAL_PENALTIES)).any() | (base.bias != 0).any()

    def running(carry):
        step, _, pool, tables, _, positions, live, _, _, finished, _, _, out_of_range = carry
        yielded = inputs.yield_on_finish & finished
        return ((step < num_steps) & live.any() & ~yielded & ~out_of_range
                & (_needs_block(tables, positions, live, block_size).sum() <= pool.num_free))

    def iteration(carry):
        (step, kv_cache, pool, tables, input_ids, positions, live, num_output, counts,
         finished, num_drawn, outputs, out_of_range) = carry
        pool, tables = _slot_blocks(pool, tables, positions, live, block_size)
        out_of_range |= _out_of_range(tables, positions, live, pool.num_blocks, block_size)
        # Past a bad id every row writes the null block, as padding does: the device
        # would clamp the id onto another sequence's block or drop the write silently.
        writing = live & ~out_of_range
        last_hidden, _, kv_cache = step_fn(params, input_ids, kv_cache,
                                           _metadata(tables, positions, writing, block_size))
        logits = logits_fn(params, last_hidden)
        suppressing = live & suppresses_stops(num_output, inputs.min_tokens)
        sampling = dataclasses.replace(base, positions=positions + 1)

        def dense():
            bias = jnp.where(suppressing[:, None] & inputs.stop_mask, -jnp.inf, base.bias)
            return sample_tokens(logits, dataclasses.replace(
                sampling, output_counts=counts, bias=bias), num_top)

        def plain():  # no penalty, bias or suppression: the sampler's cheaper variant
            return sample_tokens(logits, dataclasses.replace(
                sampling, penalties=None, output_counts=None, prompt_mask=None, bias=None),
                num_top)

        drawn = jax.lax.cond(uses_dense | suppressing.any(), dense, plain)
        token = drawn.tokens
        ended = (~drawn.finite | reaches_length(num_output + 1, inputs.max_output)
                 | stops(inputs.stop_mask[rows, token], num_output + 1, inputs.min_tokens))
        outputs = jax.tree.map(lambda out, new: out.at[:, step].set(new), outputs, drawn)
        grown = live.astype(jnp.int32)
        return (step + 1, kv_cache, pool, tables, jnp.where(live, token, input_ids),
                positions + grown, live & ~ended, num_output + grown,
                counts.at[rows, token].add(grown), finished | (live & ended).any(),
                num_drawn + grown, outputs, out_of_range)

    carry = (jnp.int32(0), kv_cache, pool, inputs.block_tables, inputs.input_ids,
             inputs.positions, inputs.live, inputs.num_output, base.output_counts,
             jnp.bool_(False), jnp.zeros(num_rows, jnp.int32), first, jnp.bool_(False))
    (_, kv_cache, pool, tables, _, _, _, _, _, _, num_drawn, outputs,
     out_of_range) = jax.lax.while_loop(running, iteration, carry)
    flat = jax.tree.map(lambda x: x.reshape(num_rows * num_steps, *x.shape[2:]), outputs)
    return LoopOutput(flat, num_drawn, tables, pool, out_of_range), kv_cache
