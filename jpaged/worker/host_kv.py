"""The host pool of KV blocks, block-major: one block's K and V of every layer, with their
scales, as one contiguous row of bytes.

The device cache is layer-major (each leaf [L, Hkv, N, block_size, ...]: a block is
strided through every layer's pages), which suits the kernels. The host pool holds
whole blocks that move one at a time (a swapped-out sequence's, a prefix block
stored to the host tier or loaded back), so it keeps each block in one row:

    blocks: uint8 [num_blocks, block_bytes]

Row b is the bytes of each leaf of the cache (jax.tree.leaves order: K's values, K's
scales if quantized, then V's) for block b, every leaf laid out [L, Hkv, block_size,
...] in C order. A block's copy to the host (or from it) is then one contiguous
region, what a DMA engine moves fastest and what another process or a file could
take whole. With tensor parallelism the row holds every device's KV heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class HostKV:
    """A host pool of `num_blocks` blocks of a cache whose leaves have `leaf_layouts`:
    (shape, dtype) of each device leaf, the block axis third ([L, Hkv, N, ...])."""

    def __init__(self, leaf_layouts: Sequence[tuple[tuple[int, ...], np.dtype]],
                 num_blocks: int):
        # Each leaf's block shape [L, Hkv, block_size, ...], dtype and byte columns.
        self._leaves = []
        offset = 0
        for shape, dtype in leaf_layouts:
            block_shape = (*shape[:2], *shape[3:])
            width = int(np.prod(block_shape)) * np.dtype(dtype).itemsize
            self._leaves.append((block_shape, np.dtype(dtype), slice(offset, offset + width)))
            offset += width
        self.block_bytes = offset
        self.blocks = np.zeros((num_blocks, self.block_bytes), np.uint8)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def write(self, host_blocks: np.ndarray, leaves: Sequence[np.ndarray]) -> None:
        """Store device blocks into rows `host_blocks` (int [K], distinct). leaves: each
        leaf's K blocks, [L, Hkv, K, ...] as the device gathers them."""
        for (_, dtype, columns), pages in zip(self._leaves, leaves, strict=True):
            block_major = np.moveaxis(np.asarray(pages, dtype), 2, 0)
            self.blocks[host_blocks, columns] = block_major.reshape(len(host_blocks), -1).view(
                np.uint8)

    def read(self, host_blocks: np.ndarray) -> list[np.ndarray]:
        """Rows `host_blocks` (int [K]) as each leaf's K blocks, [L, Hkv, K, ...]: what
        the device scatters into its cache."""
        rows = self.blocks[host_blocks]
        return [np.moveaxis(np.ascontiguousarray(rows[:, columns]).view(dtype).reshape(
                    len(host_blocks), *block_shape), 0, 2)
                for block_shape, dtype, columns in self._leaves]
