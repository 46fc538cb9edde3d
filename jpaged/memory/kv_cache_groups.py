"""KV cache groups: how the layers of a model share the blocks of one pool.

A block id names one page of `layers_per_block` layer buffers. Layers that attend
alike (all global, or all sliding by the same window) form groups of that many, and
every group has its own block table per sequence: a block belongs to one group's table
at a time, and the layer at buffer position `slot` of that group reads and writes
page `slot` of it. A windowed group's table gives back the blocks its window left, so
its layers hold about W tokens of a sequence while the global groups hold all of them.

The group size is the smallest count of layers of one kind, so no kind's layers are
spread over more buffers than it needs (Gemma 3 270M: 3 global and 15 sliding layers
make 6 groups of 3). A kind whose count the size does not divide leaves its last
group's spare buffers unused. A model whose layers all attend alike is one group of
all of them: the layout of a paged cache without groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jpaged.config import CacheConfig
from jpaged.memory.sliding_window_tables import tables_type


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroups:
    """windows:          the sliding window of each group's layers (None: global).
    layer_groups:     each layer's group.
    layer_slots:      each layer's buffer position in its group's blocks.
    layers_per_block: buffers per block (the cache's leading axis).
    """

    windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    layers_per_block: int

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...], *, free_windows: bool = True
           ) -> KVCacheGroups:
        """The groups of a model whose layer i slides by layer_windows[i] (None: global).

        free_windows=False keeps every block of every layer: one group of all the
        layers and no window on its table (the layers still attend within theirs).
        """
        kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
        if not free_windows or len(kinds) == 1:
            window = kinds[0] if free_windows else None
            num_layers = len(layer_windows)
            return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
        size = min(layer_windows.count(kind) for kind in kinds)
        windows: list[int | None] = []
        groups, slots = [0] * len(layer_windows), [0] * len(layer_windows)
        for kind in kinds:
            layers = [i for i, w in enumerate(layer_windows) if w == kind]
            first_group = len(windows)
            windows += [kind] * _cdiv(len(layers), size)
            for j, layer in enumerate(layers):
                groups[layer], slots[layer] = first_group + j // size, j % size
        return cls(tuple(windows), tuple(groups), tuple(slots), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def seq_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """The most blocks, over all groups, that a sequence of `num_tokens` holds at once
        when a step computes at most `chunk_tokens` of its tokens: each group's bound,
        which its group-table type sets (every block of a global group, at most
        cdiv(W - 1 + chunk_tokens, block_size) + 1 of a windowed one)."""
        shape = CacheConfig(block_size=block_size, max_num_batched_tokens=chunk_tokens)
        configs = [replace(shape, sliding_window=window) for window in self.windows]
        return sum(tables_type(config).max_blocks(config, num_tokens) for config in configs)
