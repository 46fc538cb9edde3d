"""Block ids and slots checked where they enter a device update.

On the device an id outside the pool does not fail: `dynamic_update_slice` clamps it
onto the pool's last block, a scatter in mode "drop" skips it, a gather clamps it, and
on the host numpy reads a negative id from the end. Another JAX serving engine lost
KV state that way without an error (tpu-inference issue 2366). Such an id means the
allocator's state or a block table is corrupt: an internal invariant broken, not a bad
request. So the ids are checked on the host before a block op or a step takes them
(`jpaged.worker.model_runner`), and the decode loop, which chooses its blocks on the device,
carries a flag the host reads back (`jpaged.worker.decode_loop`); both raise
`BlockIdOutOfRange`, which the engine does not recover from.

Each check is one reduction over an array of a step's size (a few microseconds), never
over the pool.
"""

from __future__ import annotations

import numpy as np


class BlockIdOutOfRange(IndexError):
    """A block id, slot or block-table entry outside the KV pool it indexes.

    An IndexError, as numpy's own out-of-bounds index is; a class of its own so that
    the engine tells a broken invariant (its state is corrupt: the error leaves
    `LLMEngine.step`) from a failed step it recovers from. `value` is the offending
    block id (None where no id is to blame: a decode loop's row past its table),
    `num_blocks` the pool's size.
    """

    def __init__(self, message: str, value: int | None, num_blocks: int):
        super().__init__(message)
        self.value = value
        self.num_blocks = num_blocks


# The unsigned dtype of each signed integer dtype's size.
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _id_range(num_blocks: int) -> str:
    return f"0..{num_blocks - 1}" if num_blocks else "it has none"


def first_out_of_range(ids: np.ndarray, limit: int) -> int | None:
    """The first entry of `ids` (a signed integer array, any shape) outside 0..limit-1,
    or None."""
    ids = np.asarray(ids)
    if ids.size == 0:
        return None
    # Read as unsigned, a negative id is larger than any pool: one maximum checks both
    # ends, the cheapest test for the common case of every id in range.
    if np.maximum.reduce(ids.view(_UNSIGNED[ids.itemsize]), axis=None) < limit:
        return None
    flat = ids.reshape(-1)
    return int(flat[np.argmax((flat < 0) | (flat >= limit))])


def check_block_ids(ids: np.ndarray, num_blocks: int, pool: str = "") -> None:
    """Raise BlockIdOutOfRange unless every entry of `ids` (int [...]) is a block of a
    pool of num_blocks blocks. pool: the pool's name in the message ("host", or ""
    for the device's)."""
    bad = first_out_of_range(ids, num_blocks)
    if bad is not None:
        kind = f"{pool} block" if pool else "block"
        raise BlockIdOutOfRange(
            f"{kind} id {bad} is out of range for a pool of {num_blocks} {kind}s "
            f"({_id_range(num_blocks)})", bad, num_blocks)


def check_slots(slots: np.ndarray, num_blocks: int, block_size: int) -> None:
    """Raise BlockIdOutOfRange unless every entry of `slots` (int [...], flat slots
    block * block_size + offset) lies in a pool of num_blocks blocks."""
    bad = first_out_of_range(slots, num_blocks * block_size)
    if bad is not None:
        raise BlockIdOutOfRange(
            f"slot {bad} (block id {bad // block_size}) is out of range for a pool of "
            f"{num_blocks} blocks of {block_size} slots "
            f"({_id_range(num_blocks * block_size)})", bad // block_size, num_blocks)
