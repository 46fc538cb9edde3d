"""Extension points of the worker: the block-operation phases (the prefix cache's host
tier stores and loads blocks in the host pool, as swaps do) and the warm-up of the
sampler's masked variants (structured outputs' token masks).

Block moves are checked against numpy copies of the pools moved by the phases'
definitions, the host pool read by its documented block-major layout; warm-up by
counting XLA's compilations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes, StepShapes
from jpaged.engine.stats import num_compilations
from jpaged.memory.allocator import BlockOps
from jpaged.memory.block_ids import BlockIdOutOfRange
from jpaged.worker import warmup
from jpaged.worker.model_runner import BLOCK_OP_PHASES
from jpaged.worker.sampling_rows import SamplingRow, pack_token_mask, sampling_tensors
from tests.plugins.tiny_runner import VOCAB_SIZE, host_pages, tiny_runner

NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE = 12, 6, 4
# Each phase's pools, as the BlockOps docstring defines them.
POOLS = {"swap_out": ("device", "host"), "store": ("device", "host"),
         "swap_in": ("host", "device"), "load": ("host", "device"),
         "copies": ("device", "device")}
ORDER = ("swap_out", "store", "swap_in", "load", "copies")


def _pairs(*pairs) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2)


@pytest.fixture(params=[jnp.float32, jnp.int8], ids=["float32", "int8"])
def runner(request):
    """A runner whose device cache (pages, and the scales of an int8 cache) holds random
    values, with a host pool."""
    return tiny_runner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                       num_host_blocks=NUM_HOST_BLOCKS, kv_dtype=request.param)


def _pools(runner) -> dict[str, list[np.ndarray]]:
    """Copies of every leaf of each pool: k and v [layers, kv heads, blocks, block_size,
    head_dim], each followed by its scales [layers, kv heads, blocks, block_size] if
    quantized."""
    return {"device": [np.array(leaf) for leaf in jax.tree.leaves(runner.kv_cache)],
            "host": host_pages(runner)}


def np_apply(pools: dict[str, list[np.ndarray]], ops: BlockOps) -> dict[str, list[np.ndarray]]:
    """The ops on numpy copies of the pools, phase after phase in ORDER; within a phase
    every source is read before any destination is written."""
    pools = {name: [leaf.copy() for leaf in leaves] for name, leaves in pools.items()}
    for name in ORDER:
        source, destination = POOLS[name]
        pairs = getattr(ops, name)
        for src, dst in zip(pools[source], pools[destination], strict=True):
            dst[:, :, pairs[:, 1]] = src[:, :, pairs[:, 0]].copy()
    return pools


def assert_pools_equal(got, expected):
    for name in expected:
        for old, new in zip(expected[name], got[name], strict=True):
            np.testing.assert_array_equal(new, old, err_msg=name)


def test_the_phase_table_is_the_documented_order_of_pools():
    assert tuple(phase.name for phase in BLOCK_OP_PHASES) == ORDER
    for phase in BLOCK_OP_PHASES:
        assert (phase.source, phase.destination) == POOLS[phase.name]
    assert all(len(getattr(BlockOps.none(), name)) == 0 for name in ORDER)


def test_a_store_then_a_load_round_trips_blocks_bit_for_bit(runner):
    stored = _pools(runner)
    runner.apply_block_ops(dataclasses.replace(BlockOps.none(),
                                               store=_pairs((3, 0), (7, 5), (10, 2))))
    expected = np_apply(stored, dataclasses.replace(BlockOps.none(),
                                                    store=_pairs((3, 0), (7, 5), (10, 2))))
    assert_pools_equal(_pools(runner), expected)
    # The device blocks change (a copy over them), then the tier's pages come back to
    # other blocks and to their own.
    runner.apply_block_ops(BlockOps(_pairs(), _pairs(), copies=_pairs((1, 3), (2, 7))))
    runner.apply_block_ops(dataclasses.replace(BlockOps.none(),
                                               load=_pairs((0, 3), (5, 9), (2, 11))))
    got = _pools(runner)
    for old, new in zip(stored["device"], got["device"], strict=True):
        np.testing.assert_array_equal(new[:, :, [3, 9, 11]], old[:, :, [3, 7, 10]])
        np.testing.assert_array_equal(new[:, :, 7], old[:, :, 2])  # the copy's
    assert_pools_equal({"host": got["host"]}, {"host": expected["host"]})


def test_phases_apply_in_table_order(runner):
    """Each phase reads what the phase before it wrote: a swap-in of the block the
    swap-out filled, a load of the page the store filled, a copy of the block the load
    filled; and the store reads a block before the swap-in overwrites it."""
    ops = BlockOps(swap_out=_pairs((4, 1)), store=_pairs((5, 3)), swap_in=_pairs((1, 5)),
                   load=_pairs((3, 6)), copies=_pairs((6, 8), (2, 9)))
    before = _pools(runner)
    runner.apply_block_ops(ops)
    assert_pools_equal(_pools(runner), np_apply(before, ops))
    for old, new in zip(before["device"], _pools(runner)["device"], strict=True):
        np.testing.assert_array_equal(new[:, :, [5, 6, 8, 9]], old[:, :, [4, 5, 5, 2]])


HOST_POOL = r"for a pool of 6 host blocks \(0\.\.5\)"
DEVICE_POOL = r"for a pool of 12 blocks \(0\.\.11\)"
BAD_OPS = {  # name -> (the bad phase's pairs, the message)
    "store_destination": (dict(store=_pairs((1, 0), (2, 6))),
                          rf"^host block id 6 is out of range {HOST_POOL}$"),
    "store_source": (dict(store=_pairs((12, 0))),
                     rf"^block id 12 is out of range {DEVICE_POOL}$"),
    "load_source": (dict(load=_pairs((-1, 2))),
                    rf"^host block id -1 is out of range {HOST_POOL}$"),
    "load_destination": (dict(load=_pairs((0, -3))),
                         rf"^block id -3 is out of range {DEVICE_POOL}$"),
}


@pytest.mark.parametrize("name", BAD_OPS)
def test_an_id_outside_its_pool_raises_before_anything_moves(runner, name):
    fields, message = BAD_OPS[name]
    # Valid ops of every other phase, earlier and later in the table, move nothing either.
    ops = BlockOps(**(dict(swap_out=_pairs((1, 1)), store=_pairs((2, 2)),
                           swap_in=_pairs((0, 3)), load=_pairs((1, 4)),
                           copies=_pairs((5, 6))) | fields))
    before = _pools(runner)
    with pytest.raises(BlockIdOutOfRange, match=message):
        runner.apply_block_ops(ops)
    assert_pools_equal(_pools(runner), before)


def test_a_runner_without_a_host_pool_refuses_a_store():
    runner = tiny_runner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    with pytest.raises(BlockIdOutOfRange, match=r"pool of 0 host blocks \(it has none\)"):
        runner.apply_block_ops(dataclasses.replace(BlockOps.none(), store=_pairs((1, 0))))


def test_empty_phases_move_nothing(runner):
    before = _pools(runner)
    runner.apply_block_ops(BlockOps.none())
    runner.apply_block_ops(BlockOps(_pairs(), _pairs(), _pairs(), store=_pairs(),
                                    load=_pairs()))
    assert_pools_equal(_pools(runner), before)
    # A store alone moves its blocks and nothing else.
    ops = dataclasses.replace(BlockOps.none(), store=_pairs((4, 1)))
    runner.apply_block_ops(ops)
    assert_pools_equal(_pools(runner), np_apply(before, ops))


# ---- warm-up of the sampler's masked variants --------------------------------------------

NUM_TOP = 2


def _masked_variants(allowed: np.ndarray, verifying: bool) -> list[SamplingRow]:
    """Greedy, drawing and penalised rows with a token mask, and with proposals too."""
    mask = pack_token_mask(allowed)
    rows = [SamplingRow.greedy(position=3, allowed_tokens=mask),
            SamplingRow.greedy(position=3, temperature=0.7, top_p=0.9, seed=5,
                               allowed_tokens=mask),
            SamplingRow.greedy(position=3, temperature=1.0, presence_penalty=0.5,
                               output_token_ids=[1], allowed_tokens=mask)]
    if verifying:
        rows += [dataclasses.replace(r, proposal=2) for r in rows]
    return rows


@pytest.mark.full  # some fifteen sampler variants to compile
def test_warmup_leaves_nothing_to_compile_for_masked_sampling(no_compilation_cache):
    """The sampler's variants serve rows with and without token masks alike."""
    runner = tiny_runner(num_blocks=16, block_size=4)
    shapes = StepShapes(BucketSizes(1, 1, 2), max_num_seqs=2, max_num_batched_tokens=4,
                        max_blocks_per_seq=2, num_speculative_tokens=1)
    allowed = np.arange(VOCAB_SIZE) % 3 == 0

    def sample_masked(num_draws: int, verifying: bool) -> None:
        """The draws of a step of the largest row bucket (its logits' gathers are warm),
        on logits laid out as a step's are (zeros made with jnp would compile their own
        fill)."""
        logits = runner.on_device(np.zeros((shapes.max_rows, VOCAB_SIZE), np.float32))
        padded = shapes.sampler_rows(num_draws)
        for variant in _masked_variants(allowed, verifying):
            tensors = sampling_tensors([variant] * num_draws, padded, VOCAB_SIZE)
            sampled = runner.sample(logits, np.zeros(padded, np.int32), tensors, NUM_TOP)
            assert allowed[sampled.tokens].all()

    warmup.run(warmup.step_calls(runner, shapes, VOCAB_SIZE, NUM_TOP))
    before = num_compilations()
    for num_draws in range(1, shapes.max_rows * 2 + 1):  # with one proposal a row
        for verifying in (False, True):
            sample_masked(num_draws, verifying)
    assert num_compilations() == before
