"""A sequence's block table: its physical blocks in logical order."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class BlockTable:
    """The physical blocks of one sequence in logical order, in a growable int32 buffer.

    Only the BlockManager edits it. Readers index and iterate it (Python ints),
    compare it with any sequence of ints, or take `array`, a read-only int32
    view that stays valid until the manager next edits the table; the numpy
    buffer lets the batch builder copy whole tables without touching each entry.
    """

    __slots__ = ("_buffer", "_readonly", "_size")

    def __init__(self, blocks: list[int] | np.ndarray = ()):
        self._size = len(blocks)
        self._set_buffer(np.zeros(max(8, 2 * self._size), np.int32))
        self._buffer[: self._size] = blocks

    def _set_buffer(self, buffer: np.ndarray) -> None:
        self._buffer = buffer
        # Views of a read-only view are read-only: `array` need not set flags each call.
        self._readonly = buffer.view()
        self._readonly.flags.writeable = False

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.array[index].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockTable | list | tuple) and self.tolist() == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"

    @property
    def array(self) -> np.ndarray:
        """int32 [len(self)], read-only."""
        return self._readonly[: self._size]

    def prefix(self, num_entries: int) -> np.ndarray:
        """int32 [num_entries], read-only: the first entries, in one view (no `array` first)."""
        assert num_entries <= self._size, (num_entries, self._size)
        return self._readonly[:num_entries]

    def tolist(self) -> list[int]:
        return self._buffer[: self._size].tolist()

    def block(self, index: int) -> int:
        """Entry `index` (0 <= index < len), without bounds checks beyond the buffer's."""
        return self._buffer.item(index)

    def replace(self, index: int, block: int) -> None:
        self._buffer[index] = block

    def extend(self, blocks: list[int]) -> None:
        new_size = self._size + len(blocks)
        if new_size > len(self._buffer):
            grown = np.zeros(max(2 * len(self._buffer), new_size), np.int32)
            grown[: self._size] = self._buffer[: self._size]
            self._set_buffer(grown)
        self._buffer[self._size : new_size] = blocks
        self._size = new_size

    def copy(self) -> BlockTable:
        return BlockTable(self._buffer[: self._size])
