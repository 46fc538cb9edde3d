"""The runner's block data movement (copy-on-write copies, swaps) against numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.engine.runner import ModelRunner
from jpaged.memory.allocator import BlockOps
from jpaged.model.loader import load_model

NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE = 12, 6, 4


def _pairs(*pairs) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2)


@pytest.fixture
def runner(tiny_qwen2_dir):
    model, config, _ = load_model(tiny_qwen2_dir)
    runner = ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         num_host_blocks=NUM_HOST_BLOCKS)
    rng = np.random.default_rng(0)
    runner.kv_caches = [
        tuple(jnp.asarray(rng.standard_normal(k.shape), k.dtype) for k in layer)
        for layer in runner.kv_caches
    ]
    return runner


def _device(runner) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(k), np.array(v)) for k, v in runner.kv_caches]


def test_swap_out_swap_in_and_copies_move_whole_blocks(runner):
    device = _device(runner)
    runner.apply_block_ops(BlockOps(swap_out=_pairs((3, 1), (7, 4)), swap_in=_pairs(),
                                    copies=_pairs()))
    for (k, v), (hk, hv) in zip(device, runner.host_kv, strict=True):
        np.testing.assert_array_equal(hk[:, [1, 4]], k[:, [3, 7]])
        np.testing.assert_array_equal(hv[:, [1, 4]], v[:, [3, 7]])

    # Swap the pages back into other blocks, and copy-on-write two blocks, one
    # of them onto a block another copy reads: every source is read first.
    runner.apply_block_ops(BlockOps(swap_out=_pairs(), swap_in=_pairs((1, 9), (4, 2)),
                                    copies=_pairs((5, 10), (10, 11))))
    for (k, v), (new_k, new_v) in zip(device, _device(runner), strict=True):
        for old, new in ((k, new_k), (v, new_v)):
            expected = old.copy()
            expected[:, [9, 2]] = old[:, [3, 7]]
            expected[:, 10], expected[:, 11] = old[:, 5], old[:, 10]
            np.testing.assert_array_equal(new, expected)


def test_no_ops_leave_the_cache_alone(runner):
    device = _device(runner)
    runner.apply_block_ops(BlockOps(swap_out=_pairs(), swap_in=_pairs(), copies=_pairs()))
    for (k, v), (new_k, new_v) in zip(device, _device(runner), strict=True):
        np.testing.assert_array_equal(k, new_k)
        np.testing.assert_array_equal(v, new_v)
