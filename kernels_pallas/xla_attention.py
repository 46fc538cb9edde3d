"""Paged attention over query tiles in plain XLA, for CPUs.

The same work split as the Pallas kernels (tiles.py) and the same online
softmax (online_softmax.py), as one loop that XLA compiles for the host. It
exists because the reference gathers every key of the longest sequence once
per query token, and XLA's CPU gather is slow: here a prefill chunk of
block_q tokens shares one gather.

A GPU or TPU kernel instance stops at its own tile's last page, but one XLA
loop step over all tiles would run every tile, padding included, to the
longest context in the batch. So the tiles are sorted longest first and cut
into small groups, and the loop walks a work list of (group, key chunk)
items: each group runs from the first chunk any of its tiles' sliding windows
reach to the length of its longest tile, and every tile's softmax state is
carried through the loop in place. The work follows the pages in use, whatever
the spread of lengths in the batch; pages before a tile's window are read from
the null block, never from their own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import online_softmax
from kernels_pallas.quantization import EncodedPages, as_format
from kernels_pallas.tiles import QueryTiles

# Tiles per loop step. On CPU, decode and mixed steps ran fastest with 2:
# 1 pays more loop steps, 4 and 8 more keys of shorter tiles in a group.
TILES_PER_GROUP = 2


def tile_attention(
    q_tiles: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    window: jax.Array,
    block_tables: jax.Array,
    tiles: QueryTiles,
    *,
    group: int,
    block_q: int,
    scale: float,
    soft_cap: float | None,
    pages_per_chunk: int,
    num_splits: int,
    interpret: bool,
) -> jax.Array:
    """Attention of every query tile through its sequence's block table.

    q_tiles:      [NT, Hkv, rows, D]  (layout: tiles.py)
    k/v_cache:    [L, Hkv, num_blocks, block_size, D], plain or EncodedPages
    layer:        int32 scalar, the layer read
    window:       int32 scalar, its sliding window (online_softmax.NO_WINDOW: none)
    block_tables: int32 [B, max_blocks], max_blocks a multiple of pages_per_chunk
    tiles:        QueryTiles of NT tiles
    returns       [NT, Hkv, rows, D] in q_tiles.dtype.
    (num_splits and interpret have no meaning here.)
    """
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    chunk = pages_per_chunk * k_cache.shape[3]
    size = min(TILES_PER_GROUP, num_tiles)
    num_groups = -(-num_tiles // size)

    # Keys each tile reads: none for an empty tile, whatever its first_pos holds
    # (ragged_tiles gives the tiles past the last sequence's far positions, and
    # they would walk pages for nothing).
    tile_kv_len = jnp.where(tiles.num_tokens > 0, tiles.first_pos + tiles.num_tokens, 0)
    # Longest first, padded with empty tiles to whole groups.
    order = jnp.argsort(-tile_kv_len)

    def sort(x):
        return jnp.pad(x[order], [(0, num_groups * size - num_tiles)] + [(0, 0)] * (x.ndim - 1))

    first_pos, num_tokens, kv_len = sort(tiles.first_pos), sort(tiles.num_tokens), sort(tile_kv_len)
    kv_first = online_softmax.first_visible_key(first_pos, window)
    row_pos, row_valid = jax.vmap(
        lambda first, count: online_softmax.row_positions(first, count, rows, group, block_q)
    )(first_pos, num_tokens)
    # Pages before a tile's window point at the null block.
    tables = sort(block_tables[tiles.seq])
    page_index = jnp.arange(tables.shape[1], dtype=jnp.int32)
    tables = jnp.where(page_index >= (kv_first // k_cache.shape[3])[:, None], tables, 0)
    q_sorted = sort(q_tiles)
    # A group's first tile is its longest; its chunks start where its earliest window does.
    in_groups = jnp.where(kv_len > 0, kv_first, kv_len.max()).reshape(num_groups, size)
    group_first = in_groups.min(axis=1) // chunk
    group_chunks = jnp.maximum(online_softmax.ceil_div(kv_len[::size], chunk) - group_first, 0)
    group_ends = jnp.cumsum(group_chunks)

    # Fold one chunk of keys into each tile of a group, for every KV head of the tile.
    attend_one = functools.partial(online_softmax.attend_chunk, window=window, scale=scale,
                                   soft_cap=soft_cap)
    attend = jax.vmap(
        jax.vmap(attend_one, in_axes=(0, 0, 0, 0, None, None, None, None, None)),
        in_axes=(0, 0, 0, 0, None, 0, 0, 0, 0),
    )

    # Pages as rows of a 2-D view of every layer: XLA's CPU gather copies whole
    # contiguous rows several times faster than [Hkv, block_size, D] slices of
    # the cache, and the view is free (no slice of the layer is materialised).
    # Quantized pages gather their rows of scales with the same ids.
    num_layers, num_blocks = k_cache.shape[0], k_cache.shape[2]
    k_rows, v_rows = (
        jax.tree.map(lambda x: x.reshape(num_layers * num_kv_heads * num_blocks, -1), c)
        for c in (k_cache, v_cache)
    )
    head_ids = layer * num_kv_heads + jnp.arange(num_kv_heads, dtype=jnp.int32)
    head_offsets = head_ids[None, :, None] * num_blocks

    def gather_chunk(rows_, row_ids):
        """The chunk's keys or values [size, Hkv, chunk, D] and, if quantized, their
        scales as score columns [size, Hkv, 1, chunk] (else None)."""
        if isinstance(rows_, EncodedPages):
            scales = (None if rows_.scales is None
                      else rows_.scales[row_ids].reshape(size, num_kv_heads, 1, chunk))
            values = as_format(rows_.values[row_ids], rows_.format)
            return values.reshape(size, num_kv_heads, chunk, -1), scales
        return rows_[row_ids].reshape(size, num_kv_heads, chunk, -1), None

    def body(item, state):
        group_id = jnp.searchsorted(group_ends, item, side="right").astype(jnp.int32)
        index = group_first[group_id] + item - (group_ends[group_id] - group_chunks[group_id])

        def mine(x):
            return lax.dynamic_slice_in_dim(x, group_id * size, size)

        pages = lax.dynamic_slice_in_dim(mine(tables), index * pages_per_chunk, pages_per_chunk, 1)
        # Tile-major row ids, so the gathered chunk needs no transpose.
        row_ids = (pages[:, None] + head_offsets).reshape(-1)
        (k, k_scales), (v, v_scales) = (gather_chunk(rows_, row_ids) for rows_ in (k_rows, v_rows))
        folded = attend(jax.tree.map(mine, state), mine(q_sorted), k, v, index * chunk,
                        mine(kv_first), mine(kv_len), mine(row_pos), mine(row_valid),
                        k_scales=k_scales, v_scales=v_scales)
        return jax.tree.map(
            lambda all_, new: lax.dynamic_update_slice_in_dim(all_, new, group_id * size, 0),
            state, folded,
        )

    state = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (num_groups * size, num_kv_heads, *x.shape)),
        online_softmax.initial_state(rows, head_dim),
    )
    state = lax.fori_loop(0, group_ends[-1], body, state)
    out = jax.vmap(jax.vmap(lambda s: online_softmax.normalize(s, q_tiles.dtype)))(state)
    return out[jnp.argsort(order)]
