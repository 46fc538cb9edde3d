"""The runner's block data movement (copy-on-write copies, swaps) against numpy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.memory.allocator import BlockOps
from jpaged.model.loader import load_model
from jpaged.worker.model_runner import ModelRunner
from kernels_pallas import EncodedPages
from tests.plugins.tiny_runner import host_pages

NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE = 12, 6, 4


def _pairs(*pairs) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2)


@pytest.fixture(params=[jnp.float32, jnp.int8], ids=["float32", "int8"])
def runner(tiny_qwen2_dir, request):
    """A runner whose cache (pages, and the scales of an int8 cache) holds random values."""
    model, config, _ = load_model(tiny_qwen2_dir)
    runner = ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         num_host_blocks=NUM_HOST_BLOCKS, kv_dtype=request.param)
    rng = np.random.default_rng(0)

    def random(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.asarray(rng.integers(-127, 128, leaf.shape), leaf.dtype)
        return jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype)

    runner.kv_cache = jax.tree.map(random, runner.kv_cache)
    return runner


def _device(runner) -> list[np.ndarray]:
    """Every array of the cache: k and v [layers, kv heads, blocks, block_size, head_dim],
    each followed by its scales [layers, kv heads, blocks, block_size] if quantized."""
    return [np.array(leaf) for leaf in jax.tree.leaves(runner.kv_cache)]


def _host(runner) -> list[np.ndarray]:
    return host_pages(runner)


def test_cache_stacks_every_layer(runner):
    config = runner.config
    pages = (config.num_layers, config.num_kv_heads)
    cache = runner.kv_cache
    for kind in cache:
        values = kind.values if isinstance(kind, EncodedPages) else kind
        chex.assert_shape(values, (*pages, NUM_BLOCKS, BLOCK_SIZE, config.head_dim))
        if isinstance(kind, EncodedPages):
            chex.assert_shape(kind.scales, (*pages, NUM_BLOCKS, BLOCK_SIZE))
    assert isinstance(cache[0], EncodedPages) == (runner.kv_cache[0].dtype == jnp.int8)
    # The host pool is block-major: a row per block, K and V of every layer (and their
    # scales), whatever the pages' dtype.
    token_bytes = jnp.dtype(runner.kv_cache[0].dtype).itemsize * config.head_dim
    if isinstance(cache[0], EncodedPages):
        token_bytes += 4  # one float32 scale per token and head
    block_bytes = 2 * config.num_layers * config.num_kv_heads * BLOCK_SIZE * token_bytes
    assert runner.host_kv.blocks.shape == (NUM_HOST_BLOCKS, block_bytes)


def test_swap_out_swap_in_and_copies_move_whole_blocks(runner):
    device = _device(runner)
    runner.apply_block_ops(BlockOps(swap_out=_pairs((3, 1), (7, 4)), swap_in=_pairs(),
                                    copies=_pairs()))
    for old, host in zip(device, _host(runner), strict=True):
        np.testing.assert_array_equal(host[:, :, [1, 4]], old[:, :, [3, 7]])

    # Swap the pages back into other blocks, and copy-on-write two blocks, one
    # of them onto a block another copy reads: every source is read first.
    runner.apply_block_ops(BlockOps(swap_out=_pairs(), swap_in=_pairs((1, 9), (4, 2)),
                                    copies=_pairs((5, 10), (10, 11))))
    for old, new in zip(device, _device(runner), strict=True):
        expected = old.copy()
        expected[:, :, [9, 2]] = old[:, :, [3, 7]]
        expected[:, :, 10], expected[:, :, 11] = old[:, :, 5], old[:, :, 10]
        np.testing.assert_array_equal(new, expected)


def test_no_ops_leave_the_cache_alone(runner):
    device = _device(runner)
    runner.apply_block_ops(BlockOps(swap_out=_pairs(), swap_in=_pairs(), copies=_pairs()))
    for old, new in zip(device, _device(runner), strict=True):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.int8])
@pytest.mark.parametrize("decode_only", [True, False])
def test_compiled_step_writes_the_cache_in_place(tiny_qwen2_dir, decode_only, kv_dtype):
    """XLA's own memory analysis of the compiled step: the donated cache (a quantized
    one's scales too) is the output (aliased), and the step's scratch holds less than
    one layer's keys, so no layer, let alone the whole cache, is copied."""
    model, config, _ = load_model(tiny_qwen2_dir)
    runner = ModelRunner(model, config, num_blocks=2048, block_size=16, kv_dtype=kv_dtype)
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.kv_cache))
    one_layer_keys = jax.tree.leaves(runner.kv_cache)[0].nbytes // config.num_layers
    num_tokens = 8 if decode_only else 32
    memory = runner.compile_step(num_tokens, 8, 16, decode_only).memory_analysis()
    assert memory.alias_size_in_bytes == cache_bytes
    assert memory.temp_size_in_bytes < one_layer_keys
