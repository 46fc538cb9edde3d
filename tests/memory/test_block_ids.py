"""The host's bounds checks of block ids and slots: every id outside the pool is found,
whatever its place or sign, and named with the pool's size in the error."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.memory.block_ids import (
    BlockIdOutOfRange,
    check_block_ids,
    check_slots,
    first_out_of_range,
)


@pytest.mark.parametrize("ids, limit, expected", [
    ([], 4, None),
    ([0, 3, 1], 4, None),
    ([0, 4, 1], 4, 4),
    ([[0, 1], [2, -1]], 4, -1),
    ([5, -2], 4, 5),               # the first in order, not the largest
    ([0], 0, 0),                   # an empty pool holds no id
])
def test_first_out_of_range(ids, limit, expected):
    assert first_out_of_range(np.array(ids, np.int32), limit) == expected


def test_an_id_past_the_pool_names_itself_and_the_pool():
    with pytest.raises(BlockIdOutOfRange,
                       match=r"^block id 97 is out of range for a pool of 64 blocks \(0\.\.63\)$"
                       ) as raised:
        check_block_ids(np.array([[1, 2], [97, 3]], np.int32), 64)
    assert (raised.value.value, raised.value.num_blocks) == (97, 64)
    assert isinstance(raised.value, IndexError)


def test_host_ids_and_an_empty_pool():
    with pytest.raises(BlockIdOutOfRange, match=r"^host block id -1 is out of range for a "
                       r"pool of 8 host blocks \(0\.\.7\)$"):
        check_block_ids(np.array([3, -1]), 8, "host")
    with pytest.raises(BlockIdOutOfRange, match=r"pool of 0 host blocks \(it has none\)"):
        check_block_ids(np.array([0]), 0, "host")
    check_block_ids(np.zeros((0, 2), np.int32), 0, "host")


def test_a_slot_names_its_block():
    check_slots(np.array([0, 255]), 64, 4)
    with pytest.raises(BlockIdOutOfRange, match=r"^slot 256 \(block id 64\) is out of range "
                       r"for a pool of 64 blocks of 4 slots \(0\.\.255\)$") as raised:
        check_slots(np.array([[3, 256]]), 64, 4)
    assert raised.value.value == 64
    with pytest.raises(BlockIdOutOfRange, match=r"^slot -1 \(block id -1\)"):
        check_slots(np.array([-1]), 64, 4)
