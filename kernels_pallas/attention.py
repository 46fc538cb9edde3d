"""Public paged-attention ops: argument checks, tiling, and backend dispatch.

Both ops cut the queries into tiles (tiles.py) and hand them to one of five
implementations, picked by `jax.default_backend()` unless forced:

    "tpu"        Mosaic kernel, scalar-prefetched tables, double-buffered page DMAs
    "mosaic_gpu" Mosaic GPU kernel for Hopper: TMA page copies, warpgroup products
    "triton"     Triton kernel for GPUs; also the kernel interpreted on CPU
    "xla"        the same tiles and online softmax as an XLA loop, used on CPU
    "reference"  the pure-JAX definition (reference.py), the tests' oracle

`interpret=True` runs the chosen kernel in Pallas' interpret mode (on CPU the
default choice becomes "triton"); a `pltpu.InterpretParams` selects the TPU
kernel under TPU interpret mode, which also simulates DMAs and semaphores, and
Mosaic GPU's `InterpretGPUParams` (jax >= 0.12) the Mosaic GPU kernel under GPU
interpret mode (threads, barriers and TMA copies simulated; `interpret=True` with
implementation="mosaic_gpu" takes its defaults).

On a GPU the default is "mosaic_gpu" where `mosaic_gpu_support` finds a Hopper
GPU (sm_90) and a jax with Mosaic GPU, and "triton" elsewhere.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import (
    mosaic_gpu_attention,
    online_softmax,
    reference,
    tiles,
    tpu_attention,
    triton_attention,
    xla_attention,
)
from kernels_pallas.quantization import QMAX, is_quantized
from kernels_pallas.write_kv import check_cache_shapes

Implementation = Literal["tpu", "mosaic_gpu", "triton", "xla", "reference"]
IMPLEMENTATIONS = ("tpu", "mosaic_gpu", "triton", "xla", "reference")
# Where a device's default kernel that cannot run here (a layout it does not take, a
# compile that fails) hands over; the XLA loop runs everywhere.
FALLBACKS = {"mosaic_gpu": "triton", "tpu": "xla", "triton": "xla"}
# Keys per loop step of the XLA implementation: on CPU, 64 beat 32 and 128 for
# mixed steps and came within noise of 32 for decode.
XLA_CHUNK_TOKENS = 64
# What one query tile costs the XLA implementation beyond its rows' arithmetic
# (its page gathers and per-tile matmul calls), in query rows: measured on CPU,
# a tile of r rows costs about as much as r + 16 rows of a large tile.
XLA_TILE_COST_ROWS = 16
# On CPU a sequence with at least XLA_LONG_QUERY new tokens in a step (a prefill
# chunk) gets tiles of XLA_LONG_BLOCK_Q tokens that read XLA_LONG_CHUNK_TOKENS keys per
# loop step, and the step's other sequences (decode rows, short chunks) the small tiles
# their few tokens want: one tile size for both wastes rows on the decode rows or loop
# steps on the prefill chunk, whose keys at long contexts outnumber its rows.
XLA_LONG_QUERY = 128
XLA_LONG_BLOCK_Q = 128
XLA_LONG_CHUNK_TOKENS = 256
# Only steps of at least XLA_LONG_STEP_TOKENS tokens (the CPU default budget's step)
# get the second tiling: each step shape that has it compiles a second loop, and the
# token buckets from 128 to 224 would add four of them to warm-up for chunks that long
# prompts' prefills (whole 256-token steps) rarely make.
XLA_LONG_STEP_TOKENS = 256
# Kernel programs a decode step should have before key splitting stops paying:
# a few per streaming multiprocessor of a large GPU.
TRITON_TARGET_PROGRAMS = 512


def gpu_interpret_params(interpret):
    """interpret as Mosaic GPU's InterpretGPUParams if it is one, else None."""
    params_type = getattr(plgpu, "InterpretGPUParams", None)
    return interpret if params_type and isinstance(interpret, params_type) else None


def mosaic_gpu_support() -> str | None:
    """Why the Mosaic GPU kernel cannot run on this process's default device (None: it
    can): it needs a Hopper GPU (compute capability 9.x, sm_90a) and a jax whose Pallas
    has Mosaic GPU."""
    if not hasattr(plgpu, "kernel"):
        return f"jax {jax.__version__} has no Pallas Mosaic GPU kernels (plgpu.kernel)"
    if jax.default_backend() != "gpu":
        return f"the Mosaic GPU kernel needs a GPU, this process runs on {jax.default_backend()}"
    capability = getattr(jax.devices()[0], "compute_capability", "unknown")
    if not str(capability).startswith("9"):
        return (f"the Mosaic GPU kernel is written for Hopper (compute capability 9.0, "
                f"wgmma), this GPU has {capability}")
    return None


def default_implementation(interpret) -> Implementation:
    """The implementation for this process's default backend (interpret: as the ops')."""
    if isinstance(interpret, pltpu.InterpretParams):
        return "tpu"
    if gpu_interpret_params(interpret) is not None:
        return "mosaic_gpu"
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend == "gpu" and not interpret and mosaic_gpu_support() is None:
        return "mosaic_gpu"
    if backend == "gpu" or interpret:
        return "triton"
    return "xla"


def default_block_size(implementation: Implementation, dtype) -> int:
    """Tokens per KV block an engine takes by default: 16, or on the TPU kernel at least
    one Mosaic tile of sublanes (32 for 1-byte pages)."""
    if implementation == "tpu":
        return max(16, tpu_attention.sublane_count(dtype))
    return 16


def pallas_implementation(interpret) -> Implementation:
    """The Pallas kernel for this process's default backend: "tpu" on a TPU (or under
    TPU interpret mode), "mosaic_gpu" where default_implementation picks it, else
    "triton"."""
    if isinstance(interpret, pltpu.InterpretParams) or jax.default_backend() == "tpu":
        return "tpu"
    if default_implementation(interpret) == "mosaic_gpu":
        return "mosaic_gpu"
    return "triton"


def _check_common(q, k_cache, v_cache, block_tables, context_lens, layer, implementation,
                  knobs):
    """Checks both ops share (shapes as in their docstrings); raises before any work."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    check_cache_shapes(k_cache, v_cache, layer)
    # Quantized pages (with scales) take queries of any float dtype; the others are
    # read into q's dtype, never narrowed.
    widest = q.dtype if is_quantized(k_cache.dtype) else jnp.promote_types(q.dtype,
                                                                            k_cache.dtype)
    if not jnp.issubdtype(q.dtype, jnp.floating) or widest != q.dtype:
        raise TypeError(
            "q must be a floating dtype at least as wide as unquantized caches (pages are "
            f"read into q's dtype, never narrowed); got q {q.dtype}, caches {k_cache.dtype}"
        )
    num_kv_heads, head_dim = k_cache.shape[-4], k_cache.shape[-1]
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {q.shape[-1]} != cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_q_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    batch = context_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or context_lens.ndim != 1:
        raise ValueError(
            f"block_tables must be [B, max_blocks] and context_lens [B], got "
            f"{block_tables.shape} and {context_lens.shape}"
        )
    for name, array in (("block_tables", block_tables), ("context_lens", context_lens)):
        if array.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {array.dtype}")
    for name, value in knobs.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def check_cache_layout(implementation: Implementation, dtype, block_size: int,
                       head_dim: int) -> None:
    """What a kernel needs of the KV cache layout, whatever the tiling; ValueError
    naming the limit. Engines call it at start, before compiling anything.

    dtype: the pages' dtype, floating or one of quantization.QMAX's (1-byte pages,
    whose float32 scales ride beside them)."""
    if not (jnp.issubdtype(dtype, jnp.floating) or is_quantized(dtype)):
        raise ValueError(f"the KV cache dtype must be floating or one of "
                         f"{sorted(d.name for d in QMAX)}, got {jnp.dtype(dtype).name}")
    if implementation == "triton":
        for name, value in (("block_size", block_size), ("head_dim", head_dim)):
            if value & (value - 1):
                raise ValueError(f"the Triton kernel needs {name} a power of two, got {value}")
        page_bytes = block_size * head_dim * jnp.dtype(dtype).itemsize
        if page_bytes > triton_attention.MAX_CHUNK_BYTES:
            raise ValueError(
                f"the Triton kernel reads at most {triton_attention.MAX_CHUNK_BYTES} bytes of "
                f"keys per step, and one page (block_size * head_dim * itemsize = "
                f"{block_size} * {head_dim} * {jnp.dtype(dtype).itemsize}) holds {page_bytes}"
            )
    if implementation == "mosaic_gpu" and (
            error := mosaic_gpu_attention.layout_error(dtype, block_size, head_dim)):
        raise ValueError(error)
    if implementation == "tpu" and block_size % tpu_attention.sublane_count(dtype):
        raise ValueError(
            f"the TPU kernel needs block_size a multiple of "
            f"{tpu_attention.sublane_count(dtype)} for {jnp.dtype(dtype).name}, got {block_size}"
        )


def _check_kernel_shapes(implementation, dtype, block_size, head_dim, pages_per_chunk, block_q,
                         group=1):
    """What each kernel's tiling needs of the static shapes (module docstrings say why)."""
    if block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    check_cache_layout(implementation, dtype, block_size, head_dim)
    if implementation == "mosaic_gpu":
        _check_mosaic_gpu_tiling(group, block_q, pages_per_chunk * block_size)
    if implementation == "triton":
        if pages_per_chunk & (pages_per_chunk - 1):
            raise ValueError(
                f"the Triton kernel needs pages_per_chunk a power of two, got {pages_per_chunk}")
        if pages_per_chunk * block_size < triton_attention.MIN_CHUNK:
            raise ValueError(
                f"the Triton kernel needs pages_per_chunk * block_size >= "
                f"{triton_attention.MIN_CHUNK}, got {pages_per_chunk} * {block_size}"
            )
        chunk_bytes = pages_per_chunk * block_size * head_dim * jnp.dtype(dtype).itemsize
        if chunk_bytes > triton_attention.MAX_CHUNK_BYTES:
            raise ValueError(
                f"the Triton kernel reads at most {triton_attention.MAX_CHUNK_BYTES} bytes of keys "
                f"per step, got pages_per_chunk * block_size * head_dim * itemsize = {chunk_bytes}"
            )


def _check_mosaic_gpu_tiling(group: int, block_q: int, chunk: int) -> None:
    """A tile is the M = 64 rows of one warpgroup product, and a chunk of keys the N of
    S = Q K^T: a multiple of 64 (the rows of P's swizzled tile) up to 256."""
    rows, chunk_limit = mosaic_gpu_attention.ROWS, 256
    if pl.next_power_of_2(group) * block_q > rows:
        raise ValueError(f"the Mosaic GPU kernel packs a tile's query heads and tokens into "
                         f"{rows} rows: next_power_of_2(group) * block_q = "
                         f"{pl.next_power_of_2(group)} * {block_q} is too many")
    if chunk % 64 or chunk > chunk_limit:
        raise ValueError(f"the Mosaic GPU kernel needs pages_per_chunk * block_size a "
                         f"multiple of 64 up to {chunk_limit}, got {chunk}")


def _default_pages_per_chunk(implementation, dtype, block_size, head_dim, max_blocks) -> int:
    """Pages per kernel loop step, capped by the pages a table row holds."""
    if implementation == "tpu":
        return max(1, min(tpu_attention.DEFAULT_CHUNK_TOKENS // block_size, max_blocks))
    if implementation == "xla":
        return max(1, min(XLA_CHUNK_TOKENS // block_size, max_blocks))
    if implementation == "mosaic_gpu":
        return mosaic_gpu_attention.pages_per_chunk(block_size)
    page_bytes = block_size * head_dim * jnp.dtype(dtype).itemsize
    return triton_attention.default_pages_per_chunk(block_size, page_bytes, max_blocks)


def _default_num_kv_splits(implementation: str, num_programs: int, max_chunks: int) -> int:
    """Key splits for decode: only the GPU gains, when batch * heads leaves SMs idle."""
    if implementation not in ("triton", "mosaic_gpu"):
        return 1
    splits = 1
    while num_programs * splits < TRITON_TARGET_PROGRAMS and splits * 2 <= max_chunks:
        splits *= 2
    return splits


def _attend_tiles(
    implementation: str,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    window: jax.Array,
    block_tables: jax.Array,
    query_tiles: tiles.QueryTiles,
    *,
    block_q: int,
    pages_per_chunk: int,
    **kernel_knobs,
) -> jax.Array:
    """Lay q out tile by tile, run the kernel, and put the outputs back per token.

    q: [T, Hq, D]; k/v_cache: [L, Hkv, num_blocks, block_size, D]; layer, window:
    int32 scalars; block_tables: int32 [B, max_blocks]; query_tiles: tiles of block_q
    tokens. Returns [T, Hq, D] in q.dtype.
    """
    num_kv_heads = k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    rows = _tile_rows(implementation, group, block_q)
    q_tiles = tiles.gather_query_tiles(q, query_tiles, num_kv_heads, block_q, rows)
    if implementation == "mosaic_gpu":
        # Both warpgroup products take 16-bit operands of one dtype: wider queries are
        # rounded to it, and the output widened back.
        q_tiles = q_tiles.astype(mosaic_gpu_attention.compute_dtype(q.dtype, k_cache.dtype))
    # Whole chunks of table entries: the kernels read block_tables a chunk at a time.
    max_blocks = block_tables.shape[1]
    padding = pl.cdiv(max_blocks, pages_per_chunk) * pages_per_chunk - max_blocks
    block_tables = jnp.pad(block_tables, ((0, 0), (0, padding)))
    module = {"tpu": tpu_attention, "mosaic_gpu": mosaic_gpu_attention,
              "triton": triton_attention, "xla": xla_attention}[implementation]
    if implementation == "mosaic_gpu":
        kernel_knobs["interpret"] = _mosaic_gpu_interpret(kernel_knobs["interpret"])
    out_tiles = module.tile_attention(
        q_tiles,
        k_cache,
        v_cache,
        layer,
        window,
        block_tables,
        query_tiles,
        group=group,
        block_q=block_q,
        pages_per_chunk=pages_per_chunk,
        **kernel_knobs,
    )
    return tiles.scatter_output_tiles(out_tiles.astype(q.dtype), query_tiles, q.shape[0], group,
                                      block_q)


def _mosaic_gpu_interpret(interpret):
    """The Mosaic GPU kernel's interpret argument: False, or InterpretGPUParams
    (interpret=True takes their defaults)."""
    if not interpret:
        return False
    if (params := gpu_interpret_params(interpret)) is not None:
        return params
    if not hasattr(plgpu, "InterpretGPUParams"):
        raise ValueError(f"interpreting the Mosaic GPU kernel needs jax >= 0.12 (Mosaic GPU "
                         f"interpret mode), this is jax {jax.__version__}")
    return plgpu.InterpretGPUParams()


def _window(sliding_window: jax.Array | int | None) -> jax.Array:
    """The window as the kernels take it: an int32 scalar, NO_WINDOW for none."""
    if sliding_window is None:
        return jnp.int32(online_softmax.NO_WINDOW)
    return jnp.asarray(sliding_window, jnp.int32).reshape(())


def _tile_rows(implementation: str, group: int, block_q: int) -> int:
    """Query rows of a tile: the kernels want a power of two of at least their
    minimum; XLA loops take any count, so padding would only add work."""
    if implementation == "xla":
        return group * block_q
    min_rows = {"tpu": tpu_attention.MIN_ROWS, "mosaic_gpu": mosaic_gpu_attention.ROWS}.get(
        implementation, triton_attention.MIN_ROWS)
    return tiles.tile_rows(group, block_q, min_rows)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "implementation",
        "interpret",
        "pages_per_chunk",
        "num_kv_splits",
    ),
)
def paged_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    layer: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    implementation: Implementation | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    pages_per_chunk: int | None = None,
    num_kv_splits: int | None = None,
) -> jax.Array:
    """Attention of one new token per sequence to its paged KV cache.

    q:            [B, Hq, D]   (Hq a multiple of Hkv), a floating dtype at least as
                  wide as an unquantized cache's (a bfloat16 cache is read into
                  float32 queries' dtype), any floating dtype with quantized caches
    k/v_cache:    [Hkv, num_blocks, block_size, D], or the stacked cache of every
                  layer [L, Hkv, num_blocks, block_size, D] with `layer`; plain, or
                  EncodedPages (decoded to q.dtype a chunk at a time in the
                  kernel; quantized pages' scales multiply the f32 scores and
                  probabilities)
    block_tables: int32 [B, max_blocks]  physical block of each logical block
    context_lens: int32 [B]    cached tokens including this one; 0 for padding
                  rows, whose output is 0
    layer:        int32 scalar (traced or not), the layer of a stacked cache to
                  read; None for a one-layer cache
    sliding_window: int32 scalar (traced or not) W >= 1: the query at position p
                  sees the keys p - W < j <= p, and pages wholly before them are not
                  read; None sees every key
    scale:        score scale, default D ** -0.5
    soft_cap:     if set, scores become soft_cap * tanh(scores / soft_cap)
    implementation, interpret: see the module docstring.
    pages_per_chunk: pages each kernel loop iteration reads (kernels only).
    num_kv_splits:   key splits per sequence, merged afterwards (kernels only).
    returns       [B, Hq, D] in q.dtype.
    """
    if q.ndim != 3 or q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"q must be [B, Hq, D] with B = {context_lens.shape[0]}, got {q.shape}")
    knobs = {"pages_per_chunk": pages_per_chunk, "num_kv_splits": num_kv_splits}
    _check_common(q, k_cache, v_cache, block_tables, context_lens, layer, implementation, knobs)
    implementation = implementation or default_implementation(interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_cache, v_cache, layer = reference.as_layered(k_cache, v_cache, layer)
    window = _window(sliding_window)
    if implementation == "reference":
        return reference.paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, context_lens, layer=layer, sliding_window=window,
            scale=scale, soft_cap=soft_cap,
        )
    _, num_kv_heads, _, block_size, head_dim = k_cache.shape
    max_blocks = block_tables.shape[1]
    pages_per_chunk = pages_per_chunk or _default_pages_per_chunk(
        implementation, k_cache.dtype, block_size, head_dim, max_blocks
    )
    _check_kernel_shapes(implementation, k_cache.dtype, block_size, head_dim, pages_per_chunk, 1,
                         q.shape[1] // num_kv_heads)
    num_kv_splits = num_kv_splits or _default_num_kv_splits(
        implementation, q.shape[0] * num_kv_heads, pl.cdiv(max_blocks, pages_per_chunk)
    )
    return _attend_tiles(
        implementation,
        q,
        k_cache,
        v_cache,
        layer,
        window,
        block_tables,
        tiles.decode_tiles(context_lens),
        block_q=1,
        scale=scale,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
        num_splits=num_kv_splits,
        interpret=interpret,
    )


def _default_block_q(implementation: str, group: int, num_tokens: int, num_seqs: int) -> int:
    """Tokens per tile: fill about one MXU pass (TPU) or a 64-row tile (GPU).

    On CPU (XLA) a large tile is wasted on a sequence with one new token, and a
    mixed step has many: take the size that minimizes the static tile count
    times each tile's cost, so decode-heavy steps get small tiles and
    prefill-heavy ones large tiles.
    """
    target_rows = 128 if implementation == "tpu" else 64
    largest = min(max(1, target_rows // pl.next_power_of_2(group)), pl.next_power_of_2(num_tokens))
    if implementation != "xla":
        return largest
    return min(
        (2**i for i in range(largest.bit_length())),
        key=lambda block_q: tiles.num_ragged_tiles(num_tokens, num_seqs, block_q)
        * (XLA_TILE_COST_ROWS + group * block_q),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "implementation",
        "interpret",
        "block_q",
        "pages_per_chunk",
        "num_kv_splits",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    layer: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    implementation: Implementation | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    block_q: int | None = None,
    pages_per_chunk: int | None = None,
    num_kv_splits: int = 1,
) -> jax.Array:
    """Causal attention of a flat run of new tokens from several sequences.

    Sequence i owns tokens query_start_loc[i]:query_start_loc[i + 1]; they sit
    at the last q_len positions of its context_lens[i] cached tokens (their K/V
    are already written) and each sees every cached position up to its own.
    Prefill, chunked prefill, decode and any mix of them are this one op.

    q:               [T, Hq, D]  (Hq a multiple of Hkv), dtype as in paged_decode_attention
    k/v_cache:       [Hkv, num_blocks, block_size, D], or [L, ...] of those with
                     `layer`; plain or EncodedPages, as paged_decode_attention
    block_tables:    int32 [B, max_blocks]
    context_lens:    int32 [B]
    query_start_loc: int32 [B + 1], non-decreasing, query_start_loc[-1] <= T
    layer, sliding_window, scale, soft_cap, implementation, interpret: as
                     paged_decode_attention.
    block_q:         tokens per query tile, a power of two (kernels only). The XLA
                     loop, given neither block_q nor pages_per_chunk, tiles prefill
                     chunks and the other sequences apart (XLA_LONG_QUERY).
    pages_per_chunk, num_kv_splits: as paged_decode_attention.
    returns          [T, Hq, D] in q.dtype; tokens owned by no sequence get 0.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got {q.shape}")
    if query_start_loc.shape != (context_lens.shape[0] + 1,):
        raise ValueError(
            f"query_start_loc must be [B + 1] = [{context_lens.shape[0] + 1}], "
            f"got {query_start_loc.shape}"
        )
    if query_start_loc.dtype != jnp.int32:
        raise TypeError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    knobs = {"block_q": block_q, "pages_per_chunk": pages_per_chunk, "num_kv_splits": num_kv_splits}
    _check_common(q, k_cache, v_cache, block_tables, context_lens, layer, implementation, knobs)
    implementation = implementation or default_implementation(interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_cache, v_cache, layer = reference.as_layered(k_cache, v_cache, layer)
    window = _window(sliding_window)
    if implementation == "reference":
        return reference.ragged_paged_attention_reference(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            query_start_loc,
            layer=layer,
            sliding_window=window,
            scale=scale,
            soft_cap=soft_cap,
        )
    num_tokens, num_q_heads, _ = q.shape
    _, num_kv_heads, _, block_size, head_dim = k_cache.shape
    group = num_q_heads // num_kv_heads
    if implementation == "xla" and block_q is None and pages_per_chunk is None:
        return _xla_ragged(q, k_cache, v_cache, layer, window, block_tables, context_lens,
                           query_start_loc, scale=scale, soft_cap=soft_cap)
    block_q = block_q or _default_block_q(
        implementation, group, num_tokens, context_lens.shape[0]
    )
    pages_per_chunk = pages_per_chunk or _default_pages_per_chunk(
        implementation, k_cache.dtype, block_size, head_dim, block_tables.shape[1]
    )
    _check_kernel_shapes(implementation, k_cache.dtype, block_size, head_dim, pages_per_chunk,
                         block_q, group)
    return _attend_tiles(
        implementation,
        q,
        k_cache,
        v_cache,
        layer,
        window,
        block_tables,
        tiles.ragged_tiles(context_lens, query_start_loc, num_tokens, block_q),
        block_q=block_q,
        scale=scale,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
        num_splits=num_kv_splits,
        interpret=interpret,
    )


def _xla_ragged(q, k_cache, v_cache, layer, window, block_tables, context_lens,
                query_start_loc, *, scale, soft_cap) -> jax.Array:
    """The XLA loop's ragged attention, prefill chunks (XLA_LONG_QUERY new tokens or
    more, in steps of XLA_LONG_STEP_TOKENS or more) apart from the rest: two tilings of
    one token run, each token in one of them, so the two outputs add up."""
    num_tokens, num_q_heads, _ = q.shape
    _, num_kv_heads, _, block_size, head_dim = k_cache.shape
    group = num_q_heads // num_kv_heads
    batch = context_lens.shape[0]
    long_step = num_tokens >= XLA_LONG_STEP_TOKENS
    long = ((query_start_loc[1:] - query_start_loc[:-1] >= XLA_LONG_QUERY) if long_step
            else jnp.zeros(batch, bool))
    # (sequences, tokens per tile, static tile count, keys per loop step)
    parts = [(~long, _default_block_q("xla", group, num_tokens, batch), None,
              XLA_CHUNK_TOKENS)]
    if long_step:
        long_block_q = min(XLA_LONG_BLOCK_Q, pl.next_power_of_2(num_tokens))
        # At most num_tokens // XLA_LONG_QUERY sequences have that many new tokens.
        num_tiles = num_tokens // long_block_q + num_tokens // XLA_LONG_QUERY
        parts.append((long, long_block_q, num_tiles, XLA_LONG_CHUNK_TOKENS))
    out = 0
    for keep, block_q, num_tiles, chunk_tokens in parts:
        pages_per_chunk = max(1, min(chunk_tokens // block_size, block_tables.shape[1]))
        _check_kernel_shapes("xla", k_cache.dtype, block_size, head_dim, pages_per_chunk,
                             block_q)
        query_tiles = tiles.ragged_tiles(context_lens, query_start_loc, num_tokens, block_q,
                                         keep, num_tiles)
        out = out + _attend_tiles(
            "xla", q, k_cache, v_cache, layer, window, block_tables, query_tiles,
            block_q=block_q, scale=scale, soft_cap=soft_cap, pages_per_chunk=pages_per_chunk,
            num_splits=1, interpret=False)
    return out
