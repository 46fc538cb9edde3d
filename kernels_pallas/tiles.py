"""Query tiles: the unit of work of every paged-attention kernel here.

A tile holds up to `block_q` consecutive new tokens of one sequence, for the
`group = Hq // Hkv` query heads that share one KV head. A kernel instance takes
one tile and one KV head, walks that sequence's pages through its block table
and attends causally. Decode is the case `block_q = 1`: one tile per sequence.

Inside a tile the query rows are head-major, row `r = g * block_q + j` is query
head `g` of the tile's token `j`, and rows are padded to a power of two. With
`block_q` a power of two the kernel finds a row's token as `r & (block_q - 1)`,
a bit mask both Triton and Mosaic lower on vectors (integer division by a
group of 3 would not be).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QueryTiles:
    """Where each of NT tiles sits (empty tiles have num_tokens 0).

    seq:         int32 [NT]  sequence the tile belongs to.
    first_pos:   int32 [NT]  position in that sequence of the tile's first token.
    num_tokens:  int32 [NT]  tokens of the tile that exist (<= block_q).
    first_token: int32 [NT]  index of the tile's first token in the flat run.
    """

    seq: jax.Array
    first_pos: jax.Array
    num_tokens: jax.Array
    first_token: jax.Array

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


def tile_rows(group: int, block_q: int, min_rows: int) -> int:
    """Query rows of one tile: group * block_q padded to a power of two >= min_rows."""
    return max(min_rows, pl.next_power_of_2(group * block_q))


def decode_tiles(context_lens: jax.Array) -> QueryTiles:
    """One tile per sequence holding its last token (none for length-0 rows).

    context_lens: int32 [B]
    """
    batch = context_lens.shape[0]
    has_token = context_lens > 0
    return QueryTiles(
        seq=jnp.arange(batch, dtype=jnp.int32),
        first_pos=jnp.maximum(context_lens - 1, 0),
        num_tokens=has_token.astype(jnp.int32),
        first_token=jnp.arange(batch, dtype=jnp.int32),
    )


def num_ragged_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static tile count of a ragged run: sum_i ceil(q_len_i / block_q) <= T // block_q + B,
    and never more than T since every real tile holds a token."""
    return max(1, min(num_tokens, num_tokens // block_q + num_seqs))


def ragged_tiles(
    context_lens: jax.Array, query_start_loc: jax.Array, num_tokens: int, block_q: int,
    keep: jax.Array | None = None, num_tiles: int | None = None,
) -> QueryTiles:
    """Cut each sequence's new tokens into tiles of block_q.

    context_lens:    int32 [B]
    query_start_loc: int32 [B + 1]
    num_tokens:      T, the (padded) length of the flat token run.
    keep:            bool [B], the sequences to cut (None: all); the others get no tile.
    num_tiles:       the static tile count, enough for the kept sequences (None:
                     num_ragged_tiles(T, B, block_q), enough for any).
    """
    batch = context_lens.shape[0]
    num_tiles = num_tiles or num_ragged_tiles(num_tokens, batch, block_q)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if keep is not None:
        q_lens = jnp.where(keep, q_lens, 0)
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    tiles_end = jnp.cumsum(tiles_per_seq)
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(tiles_end, tile_ids, side="right").astype(jnp.int32)
    real = seq < batch
    seq = jnp.minimum(seq, batch - 1)
    offset_in_seq = (tile_ids - (tiles_end[seq] - tiles_per_seq[seq])) * block_q
    remaining = q_lens[seq] - offset_in_seq
    return QueryTiles(
        seq=seq,
        first_pos=context_lens[seq] - q_lens[seq] + offset_in_seq,
        num_tokens=jnp.where(real, jnp.clip(remaining, 0, block_q), 0).astype(jnp.int32),
        first_token=query_start_loc[seq] + offset_in_seq,
    )


def gather_query_tiles(
    q: jax.Array, tiles: QueryTiles, num_kv_heads: int, block_q: int, rows: int
) -> jax.Array:
    """Lay the queries out tile by tile.

    q: [T, Hq, D] -> [NT, Hkv, rows, D]; rows past group * block_q are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    token_ids = tiles.first_token[:, None] + jnp.arange(block_q)
    picked = jnp.take(q, token_ids, axis=0, mode="clip")  # [NT, block_q, Hq, D]
    picked = picked.reshape(tiles.num_tiles, block_q, num_kv_heads, group, head_dim)
    picked = picked.transpose(0, 2, 3, 1, 4).reshape(
        tiles.num_tiles, num_kv_heads, group * block_q, head_dim
    )
    return jnp.pad(picked, ((0, 0), (0, 0), (0, rows - group * block_q), (0, 0)))


def scatter_output_tiles(
    out_tiles: jax.Array, tiles: QueryTiles, num_tokens: int, group: int, block_q: int
) -> jax.Array:
    """Inverse of gather_query_tiles; tokens no tile holds get 0.

    out_tiles: [NT, Hkv, rows, D] -> [T, Hq, D]
    """
    num_tiles, num_kv_heads, _, head_dim = out_tiles.shape
    per_token = out_tiles[:, :, : group * block_q].reshape(
        num_tiles, num_kv_heads, group, block_q, head_dim
    )
    per_token = per_token.transpose(0, 3, 1, 2, 4).reshape(
        num_tiles * block_q, num_kv_heads * group, head_dim
    )
    offsets = jnp.arange(block_q)
    token_ids = tiles.first_token[:, None] + offsets
    token_ids = jnp.where(offsets < tiles.num_tokens[:, None], token_ids, num_tokens)
    out = jnp.zeros((num_tokens, num_kv_heads * group, head_dim), out_tiles.dtype)
    return out.at[token_ids.reshape(-1)].set(per_token, mode="drop")
