"""Paged attention over query tiles for GPUs (Pallas' Triton backend).

One program per (query tile, KV head, key split). It reads its tile's block
table row a chunk of `pages_per_chunk` page ids at a time and loads those pages
with one gather (`k_cache[head, page_ids]`), which Triton turns into pointer
arithmetic: within a page the `block_size * head_dim` elements of one head are
contiguous, so every warp reads whole 128-byte lines. Splitting the keys
(flash-decoding) keeps the GPU busy when batch * num_kv_heads is small.

Why Triton and not Mosaic GPU: in jax 0.10 through 0.12 `pl.pallas_call` with
`plgpu.CompilerParams` lowers through Triton on every CUDA GPU from Ampere
on and runs in plain interpret mode, whereas Mosaic GPU needs Hopper or newer and
its own kernel API. The Triton backend is deprecated from jax 0.11 (it warns) but
still lowers in 0.12.

Triton's constraints shape the knobs: tensor dimensions must be powers of two
(block_size, head_dim, pages_per_chunk, rows) and every matmul dimension at
least 16 (rows >= 16 and pages_per_chunk * block_size >= 16). Shared memory
bounds the chunk: Triton 3.9 compiling these kernels for sm_90 with two
pipeline stages needs about 104-144 KiB when a chunk of keys is 32 KiB
(decode, 64-row ragged tiles), twice that at 64 KiB, more than an A100 or H100
block may use. So chunks hold up to 32 KiB of keys and pipeline over two
stages; a single page bigger than that runs unpipelined, and pages over 64 KiB
are refused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import online_softmax
from kernels_pallas.quantization import EncodedPages, as_format
from kernels_pallas.tiles import QueryTiles

MIN_ROWS = 16
MIN_CHUNK = 16
PIPELINED_CHUNK_BYTES = 32 * 1024
MAX_CHUNK_BYTES = 64 * 1024


def default_pages_per_chunk(block_size: int, page_bytes: int, max_blocks: int) -> int:
    """Pages per loop step: keys within PIPELINED_CHUNK_BYTES, at least MIN_CHUNK
    tokens, and no more pages than a table row holds (all powers of two)."""
    within_budget = max(1, PIPELINED_CHUNK_BYTES // page_bytes)
    pages = min(1 << (within_budget.bit_length() - 1), pl.next_power_of_2(max_blocks))
    return max(pages, pl.cdiv(MIN_CHUNK, block_size))


def _kernel(
    seq_ref,
    first_pos_ref,
    num_tokens_ref,
    block_tables_ref,
    layer_ref,
    window_ref,
    q_ref,
    k_cache_ref,
    v_cache_ref,
    *refs,
    group: int,
    block_q: int,
    pages_per_chunk: int,
    num_splits: int,
    scale: float,
    soft_cap: float | None,
    value_format: jnp.dtype | None,
    scaled: bool,
):
    """One program: query tile x KV head x key split.

    seq_ref, first_pos_ref, num_tokens_ref: int32 [NT]  tile metadata (tiles.py)
    block_tables_ref:       int32 [B, max_blocks]
    layer_ref:              int32 [1]  the layer read
    window_ref:             int32 [1]  its sliding window (online_softmax.NO_WINDOW: none)
    q_ref:                  [rows, D]  this tile's query rows for this KV head
    k_cache_ref, v_cache_ref: [L, Hkv, num_blocks, block_size, D]  whole caches
    value_format: the format of encoded caches' values (stored as its bits), None
          for plain caches
    scaled: whether the caches are quantized (have scales)
    refs: if scaled, first the scales of both, f32 [L, Hkv, num_blocks, block_size];
          then the [rows, D] output, or with key splits this split's
          (row_max, row_sum, acc) f32 [rows, 1], [rows, 1], [rows, D].
    """
    scale_refs, out_refs = (refs[:2], refs[2:]) if scaled else ((None, None), refs)
    tile, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = seq_ref[tile]
    first_pos = first_pos_ref[tile]
    num_tokens = num_tokens_ref[tile]
    layer, window = layer_ref[0], window_ref[0]
    rows, head_dim = q_ref.shape
    num_blocks, block_size = k_cache_ref.shape[2], k_cache_ref.shape[3]
    chunk = pages_per_chunk * block_size
    kv_len = jnp.where(num_tokens > 0, first_pos + num_tokens, 0)
    kv_len = jnp.clip(kv_len, 0, block_tables_ref.shape[1] * block_size)
    kv_first = online_softmax.first_visible_key(first_pos, window)
    first_page = lax.div(kv_first, block_size)
    row_pos, row_valid = online_softmax.row_positions(first_pos, num_tokens, rows, group, block_q)
    q = q_ref[...]

    def read_chunk(ref, scales_ref, page_ids):
        """The chunk's keys or values [chunk, D] and their scales as score columns
        [1, chunk] (None if not quantized)."""
        pages = ref[layer, head, page_ids].reshape(chunk, head_dim)
        if value_format is not None:
            pages = as_format(pages, value_format)
        if scales_ref is None:
            return pages, None
        return pages, scales_ref[layer, head, page_ids].reshape(1, chunk)

    def visit_chunk(c, state):
        page_ids = block_tables_ref[seq, pl.ds(c * pages_per_chunk, pages_per_chunk)]
        # Pages before the window are read from the null block, never from their own.
        pages = c * pages_per_chunk + lax.broadcasted_iota(jnp.int32, (pages_per_chunk,), 0)
        page_ids = jnp.where(pages >= first_page, jnp.clip(page_ids, 0, num_blocks - 1), 0)
        (k, k_scales), (v, v_scales) = (
            read_chunk(ref, scales_ref, page_ids)
            for ref, scales_ref in zip((k_cache_ref, v_cache_ref), scale_refs, strict=True))
        return online_softmax.attend_chunk(
            state, q, k, v, c * chunk, kv_first, kv_len, row_pos, row_valid, window,
            scale=scale, soft_cap=soft_cap, k_scales=k_scales, v_scales=v_scales,
        )

    first, last = online_softmax.split_chunk_range(kv_first, kv_len, split, num_splits, chunk)
    state = lax.fori_loop(first, last, visit_chunk, online_softmax.initial_state(rows, head_dim))
    online_softmax.store(out_refs, state)


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
    """
    # Imported on use: a JAX without the Triton backend (deprecated from 0.11) still
    # runs the other kernels, and an engine falls back from this one to "xla".
    from jax.experimental.pallas import triton as pltriton

    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    chunk_bytes = pages_per_chunk * k_cache.shape[3] * head_dim * k_cache.dtype.itemsize
    num_stages = 2 if chunk_bytes <= PIPELINED_CHUNK_BYTES else 1
    encoded = isinstance(k_cache, EncodedPages)
    scaled = encoded and k_cache.scales is not None
    kernel = functools.partial(
        _kernel,
        group=group,
        block_q=block_q,
        pages_per_chunk=pages_per_chunk,
        num_splits=num_splits,
        scale=scale,
        soft_cap=soft_cap,
        value_format=k_cache.format if encoded else None,
        scaled=scaled,
    )
    caches = [k_cache.values, v_cache.values] if encoded else [k_cache, v_cache]
    if scaled:
        caches += [k_cache.scales, v_cache.scales]
    whole = pl.BlockSpec()
    q_spec = online_softmax.tile_spec(rows, head_dim)
    out_shape, out_specs = online_softmax.kernel_outputs(q_tiles, num_splits)
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=[whole] * 6 + [q_spec] + [whole] * len(caches),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_triton",
    )(tiles.seq, tiles.first_pos, tiles.num_tokens, block_tables, layer.reshape(1),
      window.reshape(1), q_tiles, *caches)
    return online_softmax.finish(out, num_splits, q_tiles.dtype)
