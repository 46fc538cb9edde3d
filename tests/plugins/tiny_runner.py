"""A ModelRunner on a tiny random Llama built in process (no transformers), and a decode
loop whose model step only marks the slots it writes.

The marking step stands in for the model wherever a test checks where the decode loop
writes, not what it computes: it stores each row's position + 1 as its key and row + 1
as its value at the slot the loop gave the row, and its logits make row b's next token
its input + 1, so every output of the loop is known in advance.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.memory import allocator
from jpaged.worker.decode_loop import LoopInput, decode_loop
from jpaged.worker.model_runner import ModelRunner
from jpaged.worker.sampling_rows import SamplingRow, sampling_tensors
from kernels_pallas import write_kv

TINY_LLAMA = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64)
VOCAB_SIZE = TINY_LLAMA["vocab_size"]


def random_cache(cache, seed: int = 0):
    """`cache` (a pytree of arrays) filled with random values of each leaf's dtype."""
    rng = np.random.default_rng(seed)

    def random(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.asarray(rng.integers(-127, 128, leaf.shape), leaf.dtype)
        return jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree.map(random, cache)


def tiny_runner(*, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                kv_dtype=jnp.float32) -> ModelRunner:
    """A runner of a one-layer random Llama whose KV cache holds random values."""
    from flax import nnx

    from jpaged.model.config import LlamaConfig
    from jpaged.model.llama import LlamaForCausalLM

    config = LlamaConfig.from_hf_config(TINY_LLAMA)
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=block_size,
                         num_host_blocks=num_host_blocks, kv_dtype=kv_dtype,
                         attention_backend="reference")
    runner.kv_cache = random_cache(runner.kv_cache)
    return runner


def host_pages(runner: ModelRunner) -> list[np.ndarray]:
    """The runner's host pool read by its documented layout (jpaged.worker.host_kv): row
    b holds block b of each device leaf in turn, [L, Hkv, block_size, ...] in C order.
    returns each leaf's pages laid out as the device's, [L, Hkv, N, ...]."""
    rows, pages, start = runner.host_kv.blocks, [], 0
    for leaf in jax.tree.leaves(runner.kv_cache):
        block_shape = (*leaf.shape[:2], *leaf.shape[3:])
        width = int(np.prod(block_shape)) * leaf.dtype.itemsize
        block_major = rows[:, start:start + width].copy().view(leaf.dtype)
        pages.append(np.moveaxis(block_major.reshape(len(rows), *block_shape), 0, 2))
        start += width
    assert start == rows.shape[1], "the rows hold more than the device's leaves"
    return pages


def marking_step(params, input_ids, kv_cache, metadata):
    """A model step that writes position + 1 (keys) and row + 1 (values) at each row's
    slot in layer 0. input_ids int32 [B] -> (one-hot of input + 1 [B, V], the same,
    kv_cache)."""
    del params
    k_cache, v_cache = kv_cache
    rows = jnp.arange(input_ids.shape[0])
    heads, head_dim = k_cache.shape[1], k_cache.shape[-1]

    def rows_of(values):  # [B] -> [T = B, Hkv, D]
        return jnp.broadcast_to(values.astype(jnp.float32)[:, None, None],
                                (len(values), heads, head_dim))

    kv_cache = write_kv(k_cache, v_cache, rows_of(metadata.positions + 1), rows_of(rows + 1),
                        metadata.slot_mapping[0], jnp.int32(0))
    hidden = jax.nn.one_hot((input_ids + 1) % VOCAB_SIZE, VOCAB_SIZE)
    return hidden, hidden, kv_cache


def _marking_logits(params, last_hidden):
    return 10.0 * last_hidden


MARKING_LOOP = jax.jit(functools.partial(decode_loop, marking_step, _marking_logits),
                       static_argnames=("num_steps", "num_top", "block_size"))


def run_marking_loop(kv_cache, pool: allocator.BlockPool, inputs: LoopInput, *,
                     num_steps: int, block_size: int):
    """The decode loop with the marking step: (numpy LoopOutput, kv_cache)."""
    output, kv_cache = MARKING_LOOP((), kv_cache, pool, inputs, num_steps=num_steps,
                                    num_top=1, block_size=block_size)
    return jax.device_get(output), kv_cache


def with_marking_loop(runner: ModelRunner) -> ModelRunner:
    """`runner` with the marking step in its decode loop (its other functions kept)."""
    loop = jax.jit(functools.partial(decode_loop, marking_step, _marking_logits),
                   donate_argnums=1, static_argnames=("num_steps", "num_top", "block_size"))
    runner.functions = dataclasses.replace(runner.functions, decode_loop=loop)
    return runner


def loop_input(tables: np.ndarray, positions, live, max_output) -> LoopInput:
    """A greedy loop input: rows at `positions` (int [B]) with tables int32 [B, M], live
    bool [B], each ending after max_output[b] tokens (none output yet); row b's input
    token is b."""
    num_rows = len(tables)
    zeros = np.zeros(num_rows, np.int32)
    rows = [SamplingRow.greedy(position=int(p) + 1) for p in positions]
    return LoopInput(
        input_ids=np.arange(num_rows, dtype=np.int32),
        positions=np.asarray(positions, np.int32), block_tables=np.asarray(tables, np.int32),
        live=np.asarray(live, bool), num_output=zeros,
        max_output=np.asarray(max_output, np.int32), min_tokens=zeros,
        stop_mask=np.zeros((num_rows, VOCAB_SIZE), bool),
        sampling=sampling_tensors(rows, num_rows, VOCAB_SIZE, dense=True),
        yield_on_finish=np.bool_(False))


def shuffled_state(num_blocks: int, seed: int = 0) -> allocator.AllocatorState:
    """Allocator state whose device free queue holds blocks 1.. in a random order (every
    block allocated, then freed in that order); no host blocks."""
    state = allocator.create(num_blocks, 0)
    state, blocks = allocator.allocate(state, num_blocks - 1)
    order = np.random.default_rng(seed).permutation(blocks)
    return allocator.free(state, order)
