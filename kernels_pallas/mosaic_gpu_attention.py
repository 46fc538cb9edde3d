"""Paged attention over query tiles for Hopper GPUs (Pallas' Mosaic GPU backend).

One CUDA block (one warpgroup) per (query tile, KV head, key split), named
("tile", "head", "split"). The tile's 64 query rows (tiles.py: the query heads of
one KV head, packed head-major, times the tile's tokens) are the M = 64 of every
warpgroup product, so decode packs a GQA group into one tile and ragged steps take
block_q = 64 // group tokens per tile.

Per chunk of `pages_per_chunk` pages (CHUNK_TOKENS keys) the kernel

1. reads the chunk's page ids from the block table in global memory, bounds-checks
   each against the pool, and starts one TMA copy per page of keys and of values
   into shared memory; `num_stages` chunk buffers form a ring, so the copies of
   the next chunks are in flight while this one is computed;
2. waits on the chunk's key barrier, computes S = Q K^T with `wgmma` (both operands
   in shared memory) into a `run_scoped` accumulator, and rescales the online softmax
   in registers (online_softmax.py's masks: past a row's position, before its
   window, padding rows);
3. stages P in shared memory as the 16-bit operand and computes P V with `wgmma`,
   after waiting on the value barrier.

Why this shape:

- Explicit TMA copies rather than `emit_pipeline`: a page's address comes from the
  block table, one copy per page (pages of a sequence are scattered), and the
  pipeline's BlockSpecs index whole blocks of one array.
- P goes through shared memory and each product has its own scoped accumulator,
  because Mosaic GPU's interpreter (what checks this kernel on the CPU) runs
  neither `wgmma` with a register operand nor `pl.run_state` accumulators. On a
  GPU this costs one 64 x CHUNK_TOKENS store and fence per chunk.
- Values are sanitized in shared memory only on a chunk that holds keys no row of
  the tile may see (the edges of the context or window): those slots may hold
  anything (NaN in a poisoned pool, stale data of a freed block), and 0 * NaN
  would reach the output through the second product even though P is 0 there.
- Block-table entries outside [0, num_blocks) are never copied from: the copy reads
  the null block instead and the tile's output becomes NaN, so a corrupt table
  shows in the result. (A TMA read past the pool would not fault: it returns zeros.)
- Key splits (flash-decoding) give long contexts more CUDA blocks than batch *
  num_kv_heads; each split writes its raw (max, sum, acc) state in float32 and
  online_softmax.combine_splits merges them in a small XLA step after the kernel.

What a decode step reads: every visited key and value page once, 2 * context *
head_dim * itemsize bytes per sequence and KV head, plus 64 * head_dim * itemsize
of queries per tile; the products are tiny (M = 64 rows of which `group` are real),
so decode is bound by that traffic against the device's HBM bandwidth (H100 SXM:
3.35 TB/s) and benchmarks.accelerator reports the fraction reached.

Quantized pages (int8, fp8 e4m3 and e5m2, quantization.py) travel as they are
stored: TMA copies each 1-byte page and its page of f32 per-token scales into the
ring (half the bytes of a 16-bit page, which is the point on a bandwidth-bound
decode). After the chunk's barrier the warpgroup converts the values, without their
scales, into a 16-bit operand buffer in shared memory: every int8 and fp8 value is
exact in float16 and bfloat16 (Hopper converts fp8 only to float16, so fp8 reaches
bfloat16 through it), so the products see the stored numbers. The scales then
multiply f32 tiles rather than pages: the key scales S's columns, the value scales
P's columns before P is rounded, as in the Triton kernel. Values pass through
registers anyway, so the slots no row may see are zeroed on the way on every chunk.
The products' dtype is the queries' if 16-bit, else float16 (compute_dtype): the
engine's float32 queries lose less to float16's 10 mantissa bits than to bfloat16's
7, and float16's range covers P times a value scale (at most the token's absmax).

Limits (checked in attention.py): 16-bit or quantized pages (queries of any float
dtype with quantized pages, of the pages' dtype otherwise); head_dim a multiple of 64
(one 128-byte swizzled row of a `wgmma` operand): 64 or 128; block_size a multiple of
8 (the shared-memory tile's rows) dividing CHUNK_TOKENS (a larger page's two stages
would not fit in shared memory: 352 KiB at 256 tokens and head_dim 128). float32
pages are refused rather than taken: `wgmma` reads float32 as tf32, which would
silently round a cache its owner chose for precision; the engine hands them to the
Triton kernel, or to the XLA loop.
Blackwell (sm_100) has no `wgmma`: attention.mosaic_gpu_support accepts compute
capability 9.x only, so the default there stays Triton; a `tcgen05` variant with
tensor-memory accumulators is future work.

Checked in Mosaic GPU interpret mode on the CPU (race detector on) and by lowering
for CUDA there; not yet compiled or run on a GPU. The interpreter does not
race-check `wgmma`'s shared-memory operands nor order asynchronous products, so a
missing barrier wait shows only where the warpgroup itself reads the buffer: the
quantized path's register reads of every key and value chunk, and the 16-bit path's
value sanitizing on edge chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import online_softmax
from kernels_pallas.quantization import EncodedPages, Pages, as_format, is_quantized
from kernels_pallas.reference import DEFAULT_MASK_VALUE
from kernels_pallas.tiles import QueryTiles

ROWS = 64  # the M of one warpgroup product
CHUNK_TOKENS = 128  # keys per loop step: the N of S = Q K^T (at most 256)
DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# 64-element (128-byte) swizzled rows; at 256 the query, output and two stages of
# 128-key chunks would not fit in shared memory.
HEAD_DIMS = (64, 128)
# Shared memory one CUDA block may use on Hopper (227 KiB), less room for
# barriers and the compiler's own.
SMEM_BYTES = 220 * 1024
MAX_STAGES = 4
_SWIZZLE = 128


def layout_error(dtype, block_size: int, head_dim: int) -> str | None:
    """Why this kernel cannot read pages of dtype, block_size and head_dim (None: it can)."""
    if jnp.dtype(dtype) not in DTYPES and not is_quantized(dtype):
        return (f"the Mosaic GPU kernel reads float16 or bfloat16 pages, or quantized int8 "
                f"and fp8 ones, got {jnp.dtype(dtype).name}")
    if head_dim not in HEAD_DIMS:
        return (f"the Mosaic GPU kernel needs head_dim in {HEAD_DIMS} (whole 128-byte "
                f"swizzled wgmma rows, and shared memory for the stages), got {head_dim}")
    if block_size % 8 or CHUNK_TOKENS % block_size:
        return (f"the Mosaic GPU kernel needs block_size a multiple of 8 that divides "
                f"{CHUNK_TOKENS} (two stages of larger pages exceed shared memory), got "
                f"{block_size}")
    return None


def compute_dtype(q_dtype, page_dtype) -> jnp.dtype:
    """The 16-bit dtype of both products' operands: the pages' own for 16-bit pages;
    for quantized ones the queries' if 16-bit, else float16, which holds every int8,
    e4m3 and e5m2 value exactly and has three more mantissa bits than bfloat16 for
    the queries and probabilities."""
    if jnp.dtype(page_dtype) in DTYPES:
        return jnp.dtype(page_dtype)
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype) in DTYPES else jnp.dtype(jnp.float16)


def pages_per_chunk(block_size: int) -> int:
    """Pages of one loop step: CHUNK_TOKENS keys, or one page if pages are larger."""
    return max(1, CHUNK_TOKENS // block_size)


def num_stages(chunk: int, head_dim: int, itemsize: int, quantized: bool = False) -> int:
    """Chunk buffers in the ring: as many as shared memory holds, 2 to MAX_STAGES.
    itemsize: the operands' (2); quantized pages' ring holds 1-byte values and their
    f32 scales, and their 16-bit keys and values take one more chunk each."""
    fixed = (2 * ROWS * head_dim + ROWS * chunk) * itemsize + ROWS * head_dim * 4
    per_stage = 2 * chunk * head_dim * itemsize
    if quantized:
        fixed += per_stage
        per_stage = 2 * chunk * (head_dim + 4)
    return max(2, min(MAX_STAGES, (SMEM_BYTES - fixed) // per_stage))


def _widened(values: jax.Array, dtype) -> jax.Array:
    """1-byte quantized values in the 16-bit dtype, exactly. Hopper converts fp8 only to
    float16 (which holds every e4m3 and e5m2 value), so fp8 reaches bfloat16 through it."""
    if jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float16)
    return values.astype(dtype)


def _kernel(
    seq_ref,
    first_pos_ref,
    num_tokens_ref,
    block_tables_ref,
    layer_ref,
    window_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    group: int,
    block_q: int,
    pages_per_chunk: int,
    stages: int,
    num_splits: int,
    scale: float,
    soft_cap: float | None,
    scaled: bool,
):
    """One CUDA block: query tile x KV head x key split.

    seq_ref, first_pos_ref, num_tokens_ref: int32 [NT]  tile metadata (tiles.py), GMEM
    block_tables_ref: int32 [B, max_blocks]  (GMEM)
    layer_ref, window_ref: int32 [1]  the layer read and its sliding window
    q_ref:            [NT, Hkv, 64, D]  (GMEM) query tiles
    k_ref, v_ref:     [L, Hkv, num_blocks, block_size, D]  (GMEM) whole caches, in q's
                      dtype or (scaled) 1-byte quantized values
    refs: if scaled, first the scales of both, f32 [L, Hkv, num_blocks, block_size];
          then the outputs, [NT, Hkv, 64, D] in q's dtype, or with key splits f32
          (max [S, NT, Hkv, 64], sum [S, NT, Hkv, 64], acc [S, NT, Hkv, 64, D]);
          then the scratch: q_smem [64, D], k_smem, v_smem [stages, chunk, D] in the
          pages' dtype, p_smem [64, chunk], o_smem [64, D] (q's dtype, or f32 with
          splits), stat_smem f32 [2, 64] (splits only); if scaled, k_scale_smem,
          v_scale_smem f32 [stages, chunk] and the 16-bit operands k_operand,
          v_operand [chunk, D]; last the barriers q_barrier [1], k_barriers,
          v_barriers [stages] (one arrival per copy).
    """
    scale_refs, refs = (refs[:2], refs[2:]) if scaled else ((None, None), refs)
    num_outs = 1 if num_splits == 1 else 3
    out_refs, scratch = refs[:num_outs], refs[num_outs:]
    q_smem, k_smem, v_smem, p_smem, o_smem = scratch[:5]
    stat_smem = scratch[5] if num_splits > 1 else None
    if scaled:
        k_scale_smem, v_scale_smem, k_operand, v_operand = scratch[-7:-3]
    q_barrier, k_barriers, v_barriers = scratch[-3:]
    tile, head, split = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("split")
    seq, first_pos, num_tokens = seq_ref[tile], first_pos_ref[tile], num_tokens_ref[tile]
    layer, window = layer_ref[0], window_ref[0]
    num_blocks, block_size, head_dim = k_ref.shape[2], k_ref.shape[3], k_ref.shape[4]
    max_blocks = block_tables_ref.shape[1]
    chunk = pages_per_chunk * block_size
    dtype = q_smem.dtype

    plgpu.copy_gmem_to_smem(q_ref.at[tile, head], q_smem, q_barrier.at[0])
    kv_len = jnp.where(num_tokens > 0, first_pos + num_tokens, 0)
    kv_len = jnp.clip(kv_len, 0, max_blocks * block_size)
    kv_first = online_softmax.first_visible_key(first_pos, window)
    first_page = lax.div(kv_first, block_size)
    num_pages = online_softmax.ceil_div(kv_len, block_size)
    first, last = online_softmax.split_chunk_range(kv_first, kv_len, split, num_splits, chunk)

    def table_entry(page):
        """(the page id to copy, whether the table's entry is out of range) of logical
        page `page`; pages outside [first_page, num_pages) read the null block."""
        entry = block_tables_ref[seq, jnp.minimum(page, max_blocks - 1)]
        visited = (page >= first_page) & (page < num_pages)
        out_of_range = visited & ((entry < 0) | (entry >= num_blocks))
        return jnp.where(visited & ~out_of_range, entry, 0), out_of_range

    def start_chunk(c):
        """Start the TMA copies of chunk c's key and value pages (and their scales) into
        its ring slot."""
        slot = lax.rem(c - first, stages)
        for j in range(pages_per_chunk):
            page_id, _ = table_entry(c * pages_per_chunk + j)
            rows = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, head, page_id], k_smem.at[slot, rows],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, head, page_id], v_smem.at[slot, rows],
                                    v_barriers.at[slot])
            if scaled:
                for scales_ref, scales_smem, barriers in (
                        (scale_refs[0], k_scale_smem, k_barriers),
                        (scale_refs[1], v_scale_smem, v_barriers)):
                    plgpu.copy_gmem_to_smem(scales_ref.at[layer, head, page_id],
                                            scales_smem.at[slot, rows], barriers.at[slot])

    for i in range(stages - 1):
        pl.when(first + i < last)(functools.partial(start_chunk, first + i))

    any_out_of_range = lax.fori_loop(
        first * pages_per_chunk, last * pages_per_chunk,
        lambda page, seen: seen | table_entry(page)[1], False)

    layout = plgpu.Layout.WGMMA
    row = plgpu.broadcasted_iota(jnp.int32, (ROWS, chunk), 0, layout=layout)
    column = plgpu.broadcasted_iota(jnp.int32, (ROWS, chunk), 1, layout=layout)
    token = jnp.bitwise_and(row, block_q - 1)
    row_pos = first_pos + token
    row_valid = (row < group * block_q) & (token < num_tokens)
    plgpu.barrier_wait(q_barrier.at[0])

    def score_columns(scales_smem, slot):
        """A chunk's f32 scales [chunk] as columns of the [64, chunk] scores."""
        scales = plgpu.load(scales_smem.at[slot], layout=layout.reduce(0))
        return lax.broadcast_in_dim(scales, (ROWS, chunk), [1])

    def visit_chunk(c, state):
        row_max, row_sum, acc = state
        slot = lax.rem(c - first, stages)
        pl.when(c + stages - 1 < last)(functools.partial(start_chunk, c + stages - 1))
        chunk_start = c * chunk

        def seen(values):
            """values [chunk, D] with the slots of keys no row may see zeroed."""
            value_pos = chunk_start + plgpu.broadcasted_iota(
                jnp.int32, (chunk, head_dim), 0, layout=layout)
            return jnp.where((value_pos >= kv_first) & (value_pos < kv_len), values, 0)

        plgpu.barrier_wait(k_barriers.at[slot])
        keys = k_smem.at[slot]
        if scaled:
            # 1-byte values are exact in the 16-bit dtype; their scales multiply the
            # f32 score columns below.
            k_operand[...] = _widened(k_smem[slot], dtype)
            plgpu.commit_smem()
            keys = k_operand

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, keys.T)
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((ROWS, chunk), jnp.float32))
        if scaled:
            scores = scores * score_columns(k_scale_smem, slot)
        scores = scores * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        key_pos = chunk_start + column
        visible = (key_pos <= row_pos) & (key_pos > row_pos - window) & row_valid
        scores = jnp.where(visible, scores, DEFAULT_MASK_VALUE)
        max_next = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp(row_max - max_next)
        probs = jnp.where(visible, jnp.exp(scores - lax.broadcast_in_dim(
            max_next, scores.shape, [0])), 0.0)
        row_sum = correction * row_sum + probs.sum(axis=1)

        plgpu.barrier_wait(v_barriers.at[slot])
        values = v_smem.at[slot]
        if scaled:
            # Every quantized chunk passes through registers anyway: zero the slots no
            # row may see (NaN fp8 values, stale data) on the way, and fold the value
            # scales into P's columns (unseen ones are NaN in a poisoned pool).
            v_operand[...] = seen(_widened(v_smem[slot], dtype))
            values = v_operand
            key_seen = (key_pos >= kv_first) & (key_pos < kv_len)
            probs = probs * jnp.where(key_seen, score_columns(v_scale_smem, slot), 0.0)
        else:
            @pl.when((chunk_start < kv_first) | (chunk_start + chunk > kv_len))
            def _():
                v_smem[slot] = seen(v_smem[slot])

        p_smem[...] = probs.astype(dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, values)
            return acc_ref[...]

        update = pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
        acc = lax.broadcast_in_dim(correction, acc.shape, [0]) * acc + update
        return max_next, row_sum, acc

    initial = (
        plgpu.layout_cast(jnp.full((ROWS,), DEFAULT_MASK_VALUE, jnp.float32), layout.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), layout.reduce(1)),
        plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), layout),
    )
    row_max, row_sum, acc = lax.fori_loop(first, last, visit_chunk, initial)
    # A table entry outside the pool poisons the tile's result rather than hiding.
    poison = jnp.where(any_out_of_range, jnp.float32(jnp.nan), jnp.float32(1.0))
    acc = acc * poison
    if num_splits == 1:
        (out_ref,) = out_refs
        denominator = jnp.where(row_sum == 0.0, 1.0, row_sum)
        o_smem[...] = (acc / lax.broadcast_in_dim(denominator, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[tile, head])
    else:
        max_ref, sum_ref, acc_ref = out_refs
        o_smem[...] = acc
        stat_smem[0] = row_max
        stat_smem[1] = row_sum
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, acc_ref.at[split, tile, head])
        plgpu.copy_smem_to_gmem(stat_smem.at[0], max_ref.at[split, tile, head])
        plgpu.copy_smem_to_gmem(stat_smem.at[1], sum_ref.at[split, tile, head])
    plgpu.wait_smem_to_gmem(0)


def _transforms(dtype, head_dim: int) -> tuple:
    """A shared-memory tile of rows of head_dim elements: swizzled 128-byte rows of
    (8, 128 bytes) tiles, or the row's own width for 64-byte rows of 1-byte pages."""
    swizzle = min(_SWIZZLE, head_dim * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def tile_attention(
    q_tiles: jax.Array,
    k_cache: Pages,
    v_cache: Pages,
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
    interpret,
) -> jax.Array:
    """Attention of every query tile through its sequence's block table.

    q_tiles:      [NT, Hkv, 64, D]  float16 or bfloat16 (layout: tiles.py): the
                  compute_dtype of the pages
    k/v_cache:    [L, Hkv, num_blocks, block_size, D], plain in q_tiles' dtype or
                  EncodedPages (2-byte floats as bits, or quantized with their f32
                  scales [L, Hkv, num_blocks, block_size]); layout_error says which shapes
    layer:        int32 scalar, the layer read
    window:       int32 scalar, its sliding window (online_softmax.NO_WINDOW: none)
    block_tables: int32 [B, max_blocks], max_blocks a multiple of pages_per_chunk
    tiles:        QueryTiles of NT tiles
    interpret:    False, or Mosaic GPU's InterpretGPUParams to run on the CPU
    returns       [NT, Hkv, 64, D] in q_tiles.dtype.
    """
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    assert rows == ROWS, rows
    dtype = q_tiles.dtype
    scales = []
    if isinstance(k_cache, EncodedPages):
        scales = [k_cache.scales, v_cache.scales] if k_cache.scales is not None else []
        k_cache, v_cache = (as_format(pages.values, pages.format) for pages in (k_cache, v_cache))
    scaled = bool(scales)
    chunk = pages_per_chunk * k_cache.shape[3]
    stages = num_stages(chunk, head_dim, dtype.itemsize, scaled)
    kernel = functools.partial(
        _kernel, group=group, block_q=block_q, pages_per_chunk=pages_per_chunk,
        stages=stages, num_splits=num_splits, scale=scale, soft_cap=soft_cap, scaled=scaled,
    )
    transforms = _transforms(dtype, head_dim)
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct(q_tiles.shape, dtype)
        outputs = [plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms)]
    else:
        stat = jax.ShapeDtypeStruct((num_splits, num_tiles, num_kv_heads, ROWS), jnp.float32)
        out_type = (stat, stat, jax.ShapeDtypeStruct((num_splits, *q_tiles.shape), jnp.float32))
        outputs = [plgpu.SMEM((ROWS, head_dim), jnp.float32),
                   plgpu.SMEM((2, ROWS), jnp.float32)]
    ring = plgpu.SMEM((stages, chunk, head_dim), k_cache.dtype,
                      transforms=_transforms(k_cache.dtype, head_dim))
    operand = plgpu.SMEM((chunk, head_dim), dtype, transforms=transforms)
    scale_ring = plgpu.SMEM((stages, chunk), jnp.float32)
    # Each page's copy arrives once on its chunk's barrier, and so does its scales'.
    arrivals = pages_per_chunk * (2 if scaled else 1)
    scratch = [
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
        ring,
        ring,
        plgpu.SMEM((ROWS, chunk), dtype, transforms=transforms),
        *outputs,
        *([scale_ring, scale_ring, operand, operand] if scaled else []),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
    ]
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_tiles, num_kv_heads, num_splits),
        grid_names=("tile", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )(tiles.seq, tiles.first_pos, tiles.num_tokens, block_tables, layer.reshape(1),
      window.reshape(1), q_tiles, k_cache, v_cache, *scales)
    if num_splits == 1:
        return out
    row_max, row_sum, acc = out
    return online_softmax.combine_splits((row_max[..., None], row_sum[..., None], acc), dtype)
