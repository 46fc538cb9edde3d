"""Paged attention over query tiles in plain XLA, for CPUs.

The same work split as the Pallas kernels (tiles.py) and the same online
softmax (online_softmax.py), written as loops over key chunks that XLA
compiles for the host. It exists because the reference gathers every key of
the longest sequence once per query token, and XLA's CPU gather is slow: here
a prefill chunk of block_q tokens shares one gather.

A kernel instance on a GPU or TPU stops at its own tile's last page; one XLA
loop over all tiles would run every tile, padding included, to the longest
context of the batch. So the tiles are sorted longest first and the loop runs
in levels: all tiles up to the median tile's length, then the longer half up
to its median, and so on, the last level to the longest. With lengths spread
evenly that does about 2/3 of the single loop's work; with equal lengths, the
same work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import online_softmax
from kernels_pallas.tiles import QueryTiles

# Loop levels: all tiles, the longer half, the longest quarter.
NUM_LEVELS = 3


def tile_attention(
    q_tiles: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
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
    k/v_cache:    [Hkv, num_blocks, block_size, D]
    block_tables: int32 [B, max_blocks], max_blocks a multiple of pages_per_chunk
    tiles:        QueryTiles of NT tiles
    returns       [NT, Hkv, rows, D] in q_tiles.dtype.
    (num_splits and interpret have no meaning here.)
    """
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    chunk = pages_per_chunk * k_cache.shape[2]
    kv_len = tiles.first_pos + tiles.num_tokens
    order = jnp.argsort(-kv_len)
    kv_len = kv_len[order]
    num_chunks = online_softmax.ceil_div(kv_len, chunk)
    row_pos, row_valid = jax.vmap(
        lambda first, count: online_softmax.row_positions(first, count, rows, group, block_q)
    )(tiles.first_pos[order], tiles.num_tokens[order])
    tables, q_sorted = block_tables[tiles.seq[order]], q_tiles[order]

    # Fold one chunk of every tile's keys, for every KV head of the tile.
    attend_one = functools.partial(online_softmax.attend_chunk, scale=scale, soft_cap=soft_cap)
    attend = jax.vmap(
        jax.vmap(attend_one, in_axes=(0, 0, 0, 0, None, None, None, None)),
        in_axes=(0, 0, 0, 0, None, 0, 0, 0),
    )

    # Pages as rows of a 2-D view: XLA's CPU gather copies whole contiguous rows
    # several times faster than [Hkv, block_size, D] slices of the 4-D cache.
    num_blocks = k_cache.shape[1]
    k_rows, v_rows = (c.reshape(num_kv_heads * num_blocks, -1) for c in (k_cache, v_cache))
    head_offsets = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None] * num_blocks

    def level_body(size):
        """One chunk for the `size` longest tiles."""

        def body(index, state):
            pages = lax.dynamic_slice_in_dim(
                tables[:size], index * pages_per_chunk, pages_per_chunk, 1
            )
            # Tile-major row ids, so the gathered chunk needs no transpose.
            row_ids = (pages[:, None] + head_offsets).reshape(-1)
            k, v = (
                rows_[row_ids].reshape(size, num_kv_heads, chunk, head_dim)
                for rows_ in (k_rows, v_rows)
            )
            return attend(state, q_sorted[:size], k, v, index * chunk, kv_len[:size],
                          row_pos[:size], row_valid[:size])

        return body

    state = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (num_tiles, num_kv_heads, *x.shape)),
        online_softmax.initial_state(rows, head_dim),
    )
    sizes = level_sizes(num_tiles)
    done = jnp.int32(0)
    for level, size in enumerate(sizes):
        # Tiles past the next level's size have no chunks left after this level.
        until = num_chunks[sizes[level + 1]] if level + 1 < len(sizes) else num_chunks[0]
        part = lax.fori_loop(done, until, level_body(size), jax.tree.map(lambda x: x[:size], state))
        state = jax.tree.map(lambda x, p: x.at[:size].set(p), state, part)
        done = jnp.maximum(done, until)
    out = jax.vmap(jax.vmap(lambda s: online_softmax.normalize(s, q_tiles.dtype)))(state)
    return out[jnp.argsort(order)]


def level_sizes(num_tiles: int) -> list[int]:
    """Tiles each loop level runs: NT, then halving, NUM_LEVELS at most, never below 1."""
    sizes = [num_tiles]
    while len(sizes) < NUM_LEVELS and sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 2))
    return sizes
