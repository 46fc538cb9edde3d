"""An out-of-range block id, slot or table entry fails where it would enter a device
update, instead of being clamped or dropped there (tpu-inference issue 2366).

Entries: the runner's block ops (copies, swap-out and swap-in, each side of each pair),
a step's slot mapping and block tables, the decode loop's input tables, and the blocks
the loop takes from a pool on the device, which a sticky flag reports. Each raises
BlockIdOutOfRange naming the id and the pool, before anything moves; in the engine
the error ends the step's requests and then leaves `LLMEngine.step`, never recovered
from as an ordinary failed step is.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.engine.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.memory import allocator
from jpaged.memory.allocator import BlockOps
from jpaged.memory.block_ids import BlockIdOutOfRange
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.worker import step_runner
from tests.plugins.tiny_runner import (
    host_pages,
    loop_input,
    run_marking_loop,
    shuffled_state,
    tiny_runner,
    with_marking_loop,
)

NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE = 64, 8, 4
POOL = r"for a pool of 64 blocks \(0\.\.63\)"
HOST_POOL = r"for a pool of 8 host blocks \(0\.\.7\)"


def _pairs(*pairs) -> np.ndarray:
    return np.array(pairs, np.int32).reshape(-1, 2)


@pytest.fixture(scope="module")
def runner():
    return tiny_runner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                       num_host_blocks=NUM_HOST_BLOCKS)


def _snapshot(runner) -> list[np.ndarray]:
    return [np.array(leaf) for leaf in jax.tree.leaves(runner.kv_cache)] + host_pages(runner)


# name -> (the ops' bad pairs, the id named, whether the host pool holds it)
BAD_OPS = {
    "copy_destination": (dict(copies=_pairs((1, 2), (3, 97))), 97, False),
    "copy_source": (dict(copies=_pairs((-1, 2))), -1, False),
    "swap_out_device": (dict(swap_out=_pairs((64, 0))), 64, False),
    "swap_out_host": (dict(swap_out=_pairs((1, 8))), 8, True),
    "swap_in_host": (dict(swap_in=_pairs((-2, 1))), -2, True),
    "swap_in_device": (dict(swap_in=_pairs((0, 70))), 70, False),
}


@pytest.mark.parametrize("name", BAD_OPS)
def test_block_ops_out_of_range_raise_and_move_nothing(runner, name):
    fields, bad, host = BAD_OPS[name]
    message = (rf"^host block id {bad} is out of range {HOST_POOL}$" if host
               else rf"^block id {bad} is out of range {POOL}$")
    ops = BlockOps(**(dict(swap_out=_pairs(), swap_in=_pairs(), copies=_pairs()) | fields))
    before = _snapshot(runner)
    with pytest.raises(BlockIdOutOfRange, match=message):
        runner.apply_block_ops(ops)
    for old, new in zip(before, _snapshot(runner), strict=True):
        np.testing.assert_array_equal(old, new)


def _bad_metadata(runner, field: str, value: int):
    """A padding step's inputs (8 tokens, 4 rows of 2 blocks) with one entry of `field`
    set to value."""
    input_ids, metadata = runner._padding_inputs(8, 4, 2)
    array = getattr(metadata, field).copy()
    array.reshape(-1)[-1] = value
    return input_ids, metadata._replace(**{field: array})


@pytest.mark.parametrize("field, value, message", [
    ("slot_mapping", NUM_BLOCKS * BLOCK_SIZE,
     r"^slot 256 \(block id 64\) is out of range for a pool of 64 blocks of 4 slots \(0\.\.255\)$"),
    ("slot_mapping", -1, r"^slot -1 \(block id -1\)"),
    ("block_tables", NUM_BLOCKS, rf"^block id 64 is out of range {POOL}$"),
    ("block_tables", -5, rf"^block id -5 is out of range {POOL}$"),
])
def test_step_inputs_out_of_range_raise_before_the_step(runner, field, value, message):
    input_ids, metadata = _bad_metadata(runner, field, value)
    before = _snapshot(runner)
    with pytest.raises(BlockIdOutOfRange, match=message):
        runner.advance(input_ids, metadata, decode_only=True)
    assert not runner.kv_cache_lost()  # the donating step never ran
    for old, new in zip(before, _snapshot(runner), strict=True):
        np.testing.assert_array_equal(old, new)


def _loop_rows(tables=None):
    """Two live rows at position 4 of block size 4: the loop's first iteration takes a
    block for each."""
    tables = np.array([[5, 0], [6, 0]], np.int32) if tables is None else tables
    return loop_input(tables, positions=[4, 4], live=[True, True], max_output=[4, 4])


def test_loop_input_tables_out_of_range_raise_before_the_loop(runner):
    pool = allocator.create(NUM_BLOCKS, 0).device
    with pytest.raises(BlockIdOutOfRange, match=rf"^block id 99 is out of range {POOL}$"):
        runner.decode_loop(pool, _loop_rows(np.array([[5, 0], [99, 0]], np.int32)),
                           num_steps=4, num_top=1)


def _corrupt(pool: allocator.BlockPool, head: int) -> allocator.BlockPool:
    """A copy of `pool` whose free queue starts at `head`."""
    pool = jax.tree.map(np.copy, pool)
    pool.next_free[pool.num_blocks] = head
    return pool


def _empty_cache(num_blocks: int, block_size: int):
    zeros = np.zeros((1, 1, num_blocks, block_size, 1), np.float32)
    return zeros, zeros


@pytest.mark.parametrize("head", [97, -3, 16])
def test_the_loop_flags_a_block_outside_the_pool_and_writes_nothing_more(head):
    """A pool of 16 blocks whose queue hands out `head` (16: one past the last). The
    loop's first iteration needs it, sets the flag, runs as padding (the null block
    only) and ends."""
    pool = _corrupt(shuffled_state(16).device, head)
    output, (k_cache, _) = run_marking_loop(_empty_cache(16, BLOCK_SIZE), pool,
                                            _loop_rows(), num_steps=4, block_size=BLOCK_SIZE)
    assert output.out_of_range
    assert (output.num_drawn <= 1).all()
    assert not np.asarray(k_cache)[:, :, 1:].any()  # nothing past the null block written


def test_the_loop_flags_a_table_entry_outside_the_pool():
    """The host checks the tables it sends; one that a device pool corrupted is caught
    on the device too."""
    pool = shuffled_state(16).device
    output, _ = run_marking_loop(_empty_cache(16, BLOCK_SIZE), pool,
                                 _loop_rows(np.array([[5, 0], [40, 0]], np.int32)),
                                 num_steps=4, block_size=BLOCK_SIZE)
    assert output.out_of_range


def test_the_loop_flags_a_position_past_its_table():
    """A live row whose next position lies past its table (two entries of 4 slots, row 1
    at position 8) would write into its last entry's block at a clamped index."""
    pool = shuffled_state(16).device
    inputs = loop_input(np.array([[5, 0], [6, 7]], np.int32), positions=[3, 8],
                        live=[True, True], max_output=[4, 4])
    output, _ = run_marking_loop(_empty_cache(16, BLOCK_SIZE), pool, inputs, num_steps=4,
                                 block_size=BLOCK_SIZE)
    assert output.out_of_range


def test_a_healthy_loop_raises_no_flag():
    output, _ = run_marking_loop(_empty_cache(16, BLOCK_SIZE), shuffled_state(16).device,
                                 _loop_rows(), num_steps=4, block_size=BLOCK_SIZE)
    assert not output.out_of_range and (output.num_drawn == 4).all()


@pytest.fixture(scope="module")
def marking_runner():
    return with_marking_loop(tiny_runner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))


def test_the_runner_turns_the_loop_flag_into_the_error(marking_runner):
    pool = _corrupt(shuffled_state(NUM_BLOCKS).device, 97)
    with pytest.raises(BlockIdOutOfRange,
                       match=rf"^decode loop: block id 97 is out of range {POOL}$"):
        marking_runner.decode_loop(pool, _loop_rows(), num_steps=4, num_top=1)


def test_the_runner_names_a_row_past_its_table(marking_runner):
    inputs = loop_input(np.array([[5, 0], [6, 7]], np.int32), positions=[3, 8],
                        live=[True, True], max_output=[4, 4])
    with pytest.raises(BlockIdOutOfRange, match=r"^decode loop: a row's position passed its "
                       r"block table \(a pool of 64 blocks\)$") as raised:
        marking_runner.decode_loop(shuffled_state(NUM_BLOCKS).device, inputs, num_steps=4,
                                   num_top=1)
    assert raised.value.value is None


# In the engine: the error ends the step's requests and leaves LLMEngine.step.

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _engine(loaded, **kwargs) -> LLMEngine:
    config = dict(block_size=BLOCK_SIZE, num_blocks=40, max_num_seqs=2,
                  max_num_batched_tokens=16, max_model_len=32,
                  buckets=BucketSizes(min_num_tokens=8, min_num_seqs=2, min_blocks_per_seq=2),
                  persistent_compilation_cache=False)
    return LLMEngine(EngineConfig(model="tiny", **(config | kwargs)), loaded=loaded)


def test_an_out_of_range_slot_leaves_the_engine_step(loaded, monkeypatch):
    engine = _engine(loaded)
    engine.add_request("0", {"prompt_token_ids": [3, 4, 5]}, GREEDY)
    built = step_runner.build_model_input

    def corrupted(*args, **kwargs):
        model_input = built(*args, **kwargs)
        slots = model_input.metadata.slot_mapping.copy()
        slots[0, 0] = 40 * BLOCK_SIZE + 1
        return dataclasses.replace(
            model_input, metadata=model_input.metadata._replace(slot_mapping=slots))

    monkeypatch.setattr(step_runner, "build_model_input", corrupted)
    with pytest.raises(BlockIdOutOfRange, match=r"^slot 161 \(block id 40\) is out of range"):
        engine.step()
    assert isinstance(engine.last_step_error, BlockIdOutOfRange)
    assert not engine.has_unfinished_requests()  # the step's request ended (with "error")


def test_the_decode_loop_flag_leaves_the_engine_step(loaded, monkeypatch):
    engine = _engine(loaded, num_decode_steps=4)
    engine.add_request("0", {"prompt_token_ids": [3, 4, 5]}, GREEDY)
    engine.step()  # the prompt, on the host's path
    runner = engine.runner
    loop = runner.decode_loop

    def from_a_corrupt_pool(pool, inputs, **kwargs):
        return loop(_corrupt(pool, 97), inputs, **kwargs)

    monkeypatch.setattr(runner, "decode_loop", from_a_corrupt_pool)
    with pytest.raises(BlockIdOutOfRange,
                       match=r"^decode loop: block id 97 is out of range for a pool of 40 "):
        engine.step()
    assert isinstance(engine.last_step_error, BlockIdOutOfRange)
    engine.check_invariants()  # the host's blocks are as before the loop, less the request
