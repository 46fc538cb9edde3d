"""Paged attention over query tiles for TPUs (Pallas' Mosaic backend).

One grid step per (query tile, KV head, key split). The tile metadata and the
flattened block tables arrive by scalar prefetch, so they sit in SMEM before the
step starts and page ids are plain scalar loads. The KV cache stays in HBM
(`memory_space=ANY`); the step copies `pages_per_chunk` pages at a time into a
VMEM buffer with one DMA per page (pages of a sequence are scattered over the
pool, so one copy cannot cover two). Two buffers alternate: while the MXU works
on chunk c, the DMAs of chunk c + 1 are in flight. Pages past the sequence's
last one are never copied; their buffer rows hold stale data, which the online
softmax masks (online_softmax.py).

Page ids and lengths are clamped into range before any DMA, so a malformed
block table reads a wrong page, never outside the pool.

Mosaic tiles the last two dimensions of VMEM arrays by (8, 128) for 32-bit
types and (16, 128) for 16-bit ones; a chunk [pages_per_chunk, block_size, D]
reshapes to [chunk, D] for free only when block_size is a multiple of that
sublane count, hence the block_size rule of this variant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import online_softmax
from kernels_pallas.quantization import EncodedPages, as_format
from kernels_pallas.tiles import QueryTiles

MIN_ROWS = 8
DEFAULT_CHUNK_TOKENS = 512


def sublane_count(dtype: jnp.dtype) -> int:
    """Rows of one Mosaic (sublane, lane) tile for dtype: 8 for 32-bit, 16 for 16-bit."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def _kernel(
    seq_ref,
    first_pos_ref,
    num_tokens_ref,
    block_tables_ref,
    layer_ref,
    window_ref,
    q_ref,
    k_hbm_ref,
    v_hbm_ref,
    *refs,
    group: int,
    block_q: int,
    pages_per_chunk: int,
    pages_per_seq: int,
    num_splits: int,
    scale: float,
    soft_cap: float | None,
    value_format: jnp.dtype | None,
    scaled: bool,
):
    """One grid step: query tile x KV head x key split.

    Scalar prefetch (SMEM):
      seq_ref, first_pos_ref, num_tokens_ref: int32 [NT]  tile metadata (tiles.py)
      block_tables_ref:  int32 [B * pages_per_seq]  the tables, row-major
      layer_ref:         int32 [1]  the layer read
      window_ref:        int32 [1]  its sliding window (online_softmax.NO_WINDOW: none)
    q_ref:               [rows, D]  (VMEM) this tile's query rows for this KV head
    k_hbm_ref, v_hbm_ref: [L, Hkv, num_blocks, block_size, D]  (HBM) whole caches
    value_format: the format of encoded caches' values (stored as its bits), None
      for plain caches
    scaled: whether the caches are quantized (have scales)
    refs: if scaled, first their scales f32 [L, Hkv, num_blocks, block_size] (HBM);
      then the outputs as in the Triton kernel, then the scratch
      k_buf, v_buf: [2, pages_per_chunk, block_size, D]  (VMEM) two chunk buffers
      if scaled, k_scale_buf, v_scale_buf: [2, pages_per_chunk, block_size] (VMEM)
      sems:         DMA semaphores [2 or 4 (keys, values, their scales), 2 (buffer)].
    """
    if scaled:
        (k_scales_hbm, v_scales_hbm, *out_refs, k_buf, v_buf, k_scale_buf, v_scale_buf,
         sems) = refs
        sources = (k_hbm_ref, v_hbm_ref, k_scales_hbm, v_scales_hbm)
        buffers = (k_buf, v_buf, k_scale_buf, v_scale_buf)
    else:
        *out_refs, k_buf, v_buf, sems = refs
        sources, buffers = (k_hbm_ref, v_hbm_ref), (k_buf, v_buf)
    tile, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = seq_ref[tile]
    first_pos = first_pos_ref[tile]
    num_tokens = num_tokens_ref[tile]
    layer, window = layer_ref[0], window_ref[0]
    rows, head_dim = q_ref.shape
    num_blocks, block_size = k_hbm_ref.shape[2], k_hbm_ref.shape[3]
    chunk = pages_per_chunk * block_size
    kv_len = jnp.where(num_tokens > 0, first_pos + num_tokens, 0)
    kv_len = jnp.clip(kv_len, 0, pages_per_seq * block_size)
    kv_first = online_softmax.first_visible_key(first_pos, window)
    first_page, num_pages = lax.div(kv_first, block_size), online_softmax.ceil_div(
        kv_len, block_size)

    def page_copies(c, slot, j):
        """K and V copies (and their scales') of page j of chunk c into buffer slot."""
        page = c * pages_per_chunk + j
        page_id = jnp.clip(block_tables_ref[seq * pages_per_seq + page], 0, num_blocks - 1)
        return tuple(
            pltpu.make_async_copy(source.at[layer, head, page_id], buffer.at[slot, j],
                                  sems.at[kind, slot])
            for kind, (source, buffer) in enumerate(zip(sources, buffers, strict=True))
        )

    def for_each_page(c, slot, action):
        """Start or wait the copies of chunk c's pages that hold keys some row sees (pages
        before the window are never copied)."""
        low = jnp.clip(first_page - c * pages_per_chunk, 0, pages_per_chunk)
        high = jnp.clip(num_pages - c * pages_per_chunk, 0, pages_per_chunk)

        def one_page(j, carry):
            for copy in page_copies(c, slot, j):
                getattr(copy, action)()
            return carry

        lax.fori_loop(low, high, one_page, 0)

    row_pos, row_valid = online_softmax.row_positions(first_pos, num_tokens, rows, group, block_q)
    q = q_ref[...]
    first, last = online_softmax.split_chunk_range(kv_first, kv_len, split, num_splits, chunk)

    def visit_chunk(c, state):
        slot = lax.rem(c - first, 2)

        @pl.when(c + 1 < last)
        def _():
            for_each_page(c + 1, 1 - slot, "start")

        for_each_page(c, slot, "wait")
        k = k_buf[slot].reshape(chunk, head_dim)
        v = v_buf[slot].reshape(chunk, head_dim)
        k_scales = v_scales = None
        if value_format is not None:
            k, v = as_format(k, value_format), as_format(v, value_format)
        if scaled:
            k_scales, v_scales = (buffer[slot].reshape(1, chunk)
                                  for buffer in (k_scale_buf, v_scale_buf))
        return online_softmax.attend_chunk(
            state, q, k, v, c * chunk, kv_first, kv_len, row_pos, row_valid, window,
            scale=scale, soft_cap=soft_cap, k_scales=k_scales, v_scales=v_scales,
        )

    @pl.when(first < last)
    def _():
        for_each_page(first, 0, "start")

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
    interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
    """Attention of every query tile through its sequence's block table.

    q_tiles:      [NT, Hkv, rows, D]  (layout: tiles.py)
    k/v_cache:    [L, Hkv, num_blocks, block_size, D], block_size a multiple of
                  sublane_count(dtype) (32 for 1-byte pages); plain or EncodedPages
    layer:        int32 scalar, the layer read
    window:       int32 scalar, its sliding window (online_softmax.NO_WINDOW: none)
    block_tables: int32 [B, max_blocks], max_blocks a multiple of pages_per_chunk
    tiles:        QueryTiles of NT tiles
    returns       [NT, Hkv, rows, D] in q_tiles.dtype.
    """
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    block_size = k_cache.shape[3]
    pages_per_seq = block_tables.shape[1]
    encoded = isinstance(k_cache, EncodedPages)
    scaled = encoded and k_cache.scales is not None
    kernel = functools.partial(
        _kernel,
        group=group,
        block_q=block_q,
        pages_per_chunk=pages_per_chunk,
        pages_per_seq=pages_per_seq,
        num_splits=num_splits,
        scale=scale,
        soft_cap=soft_cap,
        value_format=k_cache.format if encoded else None,
        scaled=scaled,
    )
    q_spec = online_softmax.tile_spec(rows, head_dim)
    out_shape, out_specs = online_softmax.kernel_outputs(q_tiles, num_splits)
    caches = [k_cache.values, v_cache.values] if encoded else [k_cache, v_cache]
    page_buffer = pltpu.VMEM((2, pages_per_chunk, block_size, head_dim), caches[0].dtype)
    buffers = [page_buffer, page_buffer]
    if scaled:
        scale_buffer = pltpu.VMEM((2, pages_per_chunk, block_size), k_cache.scales.dtype)
        caches += [k_cache.scales, v_cache.scales]
        buffers += [scale_buffer, scale_buffer]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_tiles, num_kv_heads, num_splits),
        in_specs=[q_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * len(caches),
        out_specs=out_specs,
        scratch_shapes=[*buffers, pltpu.SemaphoreType.DMA((len(caches), 2))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")
        ),
        interpret=interpret,
        name="paged_attention_tpu",
    )(
        tiles.seq,
        tiles.first_pos,
        tiles.num_tokens,
        block_tables.reshape(-1),
        layer.reshape(1),
        window.reshape(1),
        q_tiles,
        *caches,
    )
    return online_softmax.finish(out, num_splits, q_tiles.dtype)
