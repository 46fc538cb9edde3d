"""Every place the runner or the decode loop writes a slice of the KV cache, of a block
table or of the loop's outputs back into the same array, against numpy.

XLA:CPU has given wrong values for such writes: `dynamic_update_slice(base,
slice(base))` followed by a reshape reads its own output when the update is a shifted
slice of the operand (openxla/xla issue 49176; jax 0.10.2 and 0.12 both). A step's
block copies meet that pattern when they chain (0 -> 1, 1 -> 2, 2 -> 3: a range
shifted by one block onto itself), and so do swaps that move blocks along. Each write
is checked eagerly and inside a larger jitted function that reshapes its result (where
XLA fuses the write with what reads it), with the block ids traced and as constants,
at the bug's own shapes: blocks [4, 1, 1] shifted by one and read back as [1, 4, 1],
and int32 [8, 16] shifted by one row. numpy defines every expected result:
`new[dst] = old[src]` reads every source before it writes, the order the runner
promises (jpaged.memory.allocator.BlockOps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.memory import allocator
from jpaged.memory.allocator import BlockOps
from jpaged.worker.model_runner import _copy_blocks, _read_blocks, _write_blocks
from tests.plugins.tiny_runner import (
    host_pages,
    loop_input,
    run_marking_loop,
    shuffled_state,
    tiny_runner,
)

NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE = 8, 4, 4


def _pairs(*pairs) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2)


def _leaves(cache) -> list[np.ndarray]:
    """Every array of a cache: k and v [L, Hkv, N, bs, D], each followed by its scales
    [L, Hkv, N, bs] if quantized."""
    return [np.array(leaf) for leaf in jax.tree.leaves(cache)]


def _copied(leaves: list[np.ndarray], pairs: np.ndarray) -> list[np.ndarray]:
    """numpy's block copies: every source read before any destination is written."""
    expected = [leaf.copy() for leaf in leaves]
    for new, old in zip(expected, leaves, strict=True):
        new[:, :, pairs[:, 1]] = old[:, :, pairs[:, 0]]
    return expected


def _assert_leaves_equal(actual, expected, first_block: int = 0) -> None:
    """Equal leaves [L, Hkv, N, ...], compared from block first_block on."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got[:, :, first_block:], want[:, :, first_block:])


@pytest.fixture(params=[jnp.float32, jnp.int8], ids=["float32", "int8"])
def runner(request):
    """A runner whose cache (pages, and the scales of an int8 cache) holds random values."""
    return tiny_runner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                       num_host_blocks=NUM_HOST_BLOCKS, kv_dtype=request.param)


COPIES = {
    "chain": _pairs((1, 2), (2, 3), (3, 4)),            # a range shifted onto itself
    "chain_backwards": _pairs((3, 2), (4, 3), (5, 4)),
    "from_block_0": _pairs((0, 1), (1, 2), (2, 3)),     # xla#49176's shift, padded to 4
    "onto_itself": _pairs((3, 3), (5, 5)),
    "padding_pairs": _pairs((0, 0), (4, 1), (0, 0)),
    "chain_and_more": _pairs((1, 2), (2, 3), (6, 6), (3, 7), (7, 5)),
}


@pytest.mark.parametrize("name", COPIES)
def test_copies_match_numpy(runner, name):
    """Through apply_block_ops, which pads the pairs with (0, 0) to a power of two; a
    quantized cache's scales move with their values."""
    pairs = COPIES[name]
    before = _leaves(runner.kv_cache)
    runner.apply_block_ops(BlockOps(_pairs(), _pairs(), pairs))
    _assert_leaves_equal(_leaves(runner.kv_cache), _copied(before, pairs))


def test_swaps_move_blocks_along_as_numpy_does(runner):
    """Blocks 1, 2, 3 out to the host, then back one block further on (2, 3, 4): the
    device range shifted onto itself; then one step of all three phases that reads what
    the phase before it wrote. The null block is left out: a swap-in's padding pairs
    (host 0, device 0) write into it, as padding tokens do."""
    before = _leaves(runner.kv_cache)
    runner.apply_block_ops(BlockOps(_pairs((1, 0), (2, 1), (3, 2)), _pairs(), _pairs()))
    runner.apply_block_ops(BlockOps(_pairs(), _pairs((0, 2), (1, 3), (2, 4)), _pairs()))
    expected = [leaf.copy() for leaf in before]
    for new, old in zip(expected, before, strict=True):
        new[:, :, [2, 3, 4]] = old[:, :, [1, 2, 3]]
    _assert_leaves_equal(_leaves(runner.kv_cache), expected, first_block=1)
    host = host_pages(runner)

    # Out: 4 -> host 3; in: host 0 -> 4, host 3 -> 5; copies: 4 -> 6, 5 -> 4.
    runner.apply_block_ops(BlockOps(_pairs((4, 3)), _pairs((0, 4), (3, 5)),
                                    _pairs((4, 6), (5, 4))))
    device = expected
    for new_host, old in zip(host, device, strict=True):
        new_host[:, :, 3] = old[:, :, 4]
    for new, new_host in zip(device, host, strict=True):
        new[:, :, [4, 5]] = new_host[:, :, [0, 3]]
        new[:, :, [6, 4]] = new[:, :, [4, 5]].copy()
    _assert_leaves_equal(_leaves(runner.kv_cache), device, first_block=1)
    _assert_leaves_equal(host_pages(runner), host)


# xla#49176's shapes in the cache's layout [L, Hkv, N, bs, D]: four blocks of one
# value ([4, 1, 1] over N, bs, D), and eight blocks of 16 (int32 [8, 16]).
BUG_SHAPES = {"blocks_4x1x1": ((1, 1, 4, 1, 1), (1, 4, 1)),
              "int32_8x16": ((1, 1, 8, 16, 1), (1, 8, 16))}


def _shift_pairs(num_blocks: int, forwards: bool) -> np.ndarray:
    """Every block onto its neighbour: (0, 1), (1, 2), ... or (1, 0), (2, 1), ..."""
    src = np.arange(num_blocks - 1)
    pairs = np.stack([src, src + 1], axis=1)
    return (pairs if forwards else pairs[:, ::-1]).astype(np.int32)


def _base(x: np.ndarray) -> np.ndarray:
    """The operand xla#49176 needs: computed in the same function as the write."""
    return x + 1


@pytest.mark.parametrize("forwards", [True, False], ids=["forwards", "backwards"])
@pytest.mark.parametrize("shape", BUG_SHAPES)
def test_copies_at_the_xla_49176_shapes(shape, forwards):
    cache_shape, read_back = BUG_SHAPES[shape]
    x = np.arange(np.prod(cache_shape), dtype=np.int32).reshape(cache_shape)
    pairs = _shift_pairs(cache_shape[2], forwards)
    (expected,) = _copied([_base(x)], pairs)

    def copied_then_reshaped(cache, pairs):
        base = _base(cache)
        return _copy_blocks((base, base), pairs)[0].reshape(read_back)

    eager = _copy_blocks((jnp.asarray(_base(x)), jnp.asarray(_base(x))), pairs)[0]
    np.testing.assert_array_equal(eager, expected)
    traced = jax.jit(copied_then_reshaped)(x, pairs)
    constant = jax.jit(lambda cache: copied_then_reshaped(cache, pairs))(x)
    for result in (traced, constant):
        np.testing.assert_array_equal(result, expected.reshape(read_back))


@pytest.mark.parametrize("forwards", [True, False], ids=["forwards", "backwards"])
@pytest.mark.parametrize("shape", BUG_SHAPES)
def test_read_then_written_blocks_at_the_xla_49176_shapes(shape, forwards):
    """A swap's two halves in one function: blocks read (`_read_blocks`) and written back
    one block along (`_write_blocks`), scales with them, then reshaped."""
    cache_shape, read_back = BUG_SHAPES[shape]
    x = np.arange(np.prod(cache_shape), dtype=np.int32).reshape(cache_shape)
    pairs = _shift_pairs(cache_shape[2], forwards)
    (expected,) = _copied([_base(x)], pairs)

    @jax.jit
    def moved_then_reshaped(cache, src, dst):
        base = _base(cache)
        pages = (_read_blocks(base, src), _read_blocks(base, src))
        return _write_blocks((base, base), pages, dst)[0].reshape(read_back)

    result = moved_then_reshaped(x, pairs[:, 0], pairs[:, 1])
    np.testing.assert_array_equal(result, expected.reshape(read_back))


# The decode loop: tables it fills, slots it writes, outputs it stores step by step.

LOOP_BLOCKS, LOOP_BLOCK_SIZE, LOOP_STEPS = 16, 2, 5


def _numpy_loop(pool: allocator.BlockPool, tables: np.ndarray, positions, live, max_output,
                num_steps: int, block_size: int):
    """What the loop must do, in numpy: each step, each live row in order whose table
    holds the null block at its position takes the free queue's head. -> (tables,
    {(row, position): slot written}, the free queue left)."""
    queue, tables = allocator.free_queue(pool), tables.copy()
    slots = {}
    for step in range(num_steps):
        for row in np.flatnonzero(live & (step < max_output)):
            position = positions[row] + step
            entry = position // block_size
            if tables[row, entry] == 0:
                tables[row, entry] = queue.pop(0)
            slots[row, position] = tables[row, entry] * block_size + position % block_size
    return tables, slots, queue


def _loop_case():
    """Four rows (one of them padding) in a pool with a shuffled free queue: a row at a
    block's first slot, one in the middle of a block it holds, one ending early."""
    state, held = allocator.allocate(shuffled_state(LOOP_BLOCKS, seed=3), 2)
    tables = np.zeros((4, 6), np.int32)
    tables[1, :2] = held  # row 1 holds blocks for positions 0..3 and is at 3
    positions = np.array([4, 3, 0, 0])
    live = np.array([True, True, True, False])
    max_output = np.array([5, 5, 2, 5])
    return state.device, tables, positions, live, max_output


def _cache(num_blocks: int, block_size: int):
    """An empty one-layer cache (k, v) [1, 1, N, bs, 1]."""
    zeros = jnp.zeros((1, 1, num_blocks, block_size, 1), jnp.float32)
    return zeros, zeros


def test_decode_loop_tables_slots_and_outputs_match_numpy():
    pool, tables, positions, live, max_output = _loop_case()
    expected_tables, slots, queue = _numpy_loop(pool, tables, positions, live, max_output,
                                                LOOP_STEPS, LOOP_BLOCK_SIZE)
    inputs = loop_input(tables, positions, live, max_output)
    output, (k_cache, v_cache) = run_marking_loop(
        _cache(LOOP_BLOCKS, LOOP_BLOCK_SIZE), jax.tree.map(np.copy, pool), inputs,
        num_steps=LOOP_STEPS, block_size=LOOP_BLOCK_SIZE)

    assert not output.out_of_range
    np.testing.assert_array_equal(output.block_tables, expected_tables)
    assert allocator.free_queue(output.pool) == queue
    # Every slot holds what its row wrote at its position; no other block was written.
    keys = np.zeros(LOOP_BLOCKS * LOOP_BLOCK_SIZE)
    values = np.zeros(LOOP_BLOCKS * LOOP_BLOCK_SIZE)
    for (row, position), slot in slots.items():
        keys[slot], values[slot] = position + 1, row + 1
    real = slice(LOOP_BLOCK_SIZE, None)  # past the null block, which padding writes
    np.testing.assert_array_equal(np.asarray(k_cache).reshape(-1)[real], keys[real])
    np.testing.assert_array_equal(np.asarray(v_cache).reshape(-1)[real], values[real])
    # Outputs stored step by step ([B, S] columns), then read back as [B * S] rows.
    drawn = np.where(live, np.minimum(LOOP_STEPS, max_output), 0)
    np.testing.assert_array_equal(output.num_drawn, drawn)
    tokens = output.sampled.tokens.reshape(len(live), LOOP_STEPS)
    for row in range(len(live)):
        np.testing.assert_array_equal(tokens[row, : drawn[row]],
                                      np.arange(row + 1, row + 1 + drawn[row]))
