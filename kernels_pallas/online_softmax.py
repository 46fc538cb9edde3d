"""Online softmax over chunks of keys: the arithmetic every kernel shares.

A kernel instance owns `rows` query rows (one query tile for one KV head) and
visits the keys chunk by chunk, keeping flash-attention state in f32:

    row_max [rows, 1]  running max of the scores
    row_sum [rows, 1]  running sum of exp(score - row_max)
    acc     [rows, D]  running sum of exp(score - row_max) * v

State is 2-D so that Mosaic keeps it in vector registers; the same jnp code
lowers through Triton. Masking is NaN-proof: keys a row does not see (past its
position, or before its sliding window) get MASK_VALUE before the max and
probability exactly 0 after it, and values no row of the tile sees are zeroed
before the second matmul (0 * NaN would be NaN), so whatever sits in unused slots
of a page never reaches the output.

A sliding window W lets the query at position p see keys j with p - W < j <= p
(transformers' and vLLM's definition); NO_WINDOW sees every key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.reference import DEFAULT_MASK_VALUE

AttentionState = tuple[jax.Array, jax.Array, jax.Array]
# The window of a layer without one: larger than any context, and p - NO_WINDOW
# does not overflow int32 for any position p >= 0.
NO_WINDOW = 2**31 - 1


def initial_state(rows: int, head_dim: int) -> AttentionState:
    """(row_max, row_sum, acc) before any key: f32 [rows, 1], [rows, 1], [rows, head_dim]."""
    return (
        jnp.full((rows, 1), DEFAULT_MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def row_positions(
    first_pos: jax.Array, num_tokens: jax.Array, rows: int, group: int, block_q: int
) -> tuple[jax.Array, jax.Array]:
    """Sequence position and validity of each query row of a tile (layout: tiles.py).

    first_pos, num_tokens: int32 scalars of the tile.
    returns (position int32 [rows, 1], valid bool [rows, 1]).
    """
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    token = jnp.bitwise_and(row, block_q - 1)
    valid = (row < group * block_q) & (token < num_tokens)
    return first_pos + token, valid


def first_visible_key(first_pos: jax.Array, window: jax.Array) -> jax.Array:
    """The lowest key position any row of a tile starting at first_pos sees. int32."""
    return jnp.maximum(first_pos - window + 1, 0)


def attend_chunk(
    state: AttentionState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_start: jax.Array,
    kv_first: jax.Array,
    kv_len: jax.Array,
    row_pos: jax.Array,
    row_valid: jax.Array,
    window: jax.Array,
    *,
    scale: float,
    soft_cap: float | None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> AttentionState:
    """Fold one chunk of keys into the state.

    q:         [rows, D]    query rows (dtype of the cache, or any float with scales)
    k, v:      [chunk, D]   keys/values of positions kv_start .. kv_start + chunk - 1,
                            plain or the 1-byte values of quantized pages
    kv_start:  int32 scalar, position of the chunk's first key
    kv_first, kv_len: int32 scalars, the keys [kv_first, kv_len) some row may see
    row_pos:   int32 [rows, 1] position of each query row (it sees keys <= it)
    row_valid: bool  [rows, 1]
    window:    int32 scalar, the sliding window (NO_WINDOW for none)
    k_scales, v_scales: f32 [1, chunk], the scales of quantized k and v (None: plain)

    Quantized values enter the matmuls as q's dtype, which holds every int8 and fp8
    value exactly; their scales then multiply the score columns (keys) and the
    probability columns (values) in f32: the dequantization happens on the [rows,
    chunk] tiles, never on [chunk, D] pages.
    """
    max_prev, sum_prev, acc_prev = state
    chunk = k.shape[0]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    # f32 inputs keep full f32 products: TPU and Triton would otherwise use bf16
    # passes or TF32 for f32 matmuls.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    scores = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    if k_scales is not None:
        scores = scores * k_scales
    scores = scores * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = kv_start + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    visible = (key_pos <= row_pos) & (key_pos > row_pos - window) & row_valid
    scores = jnp.where(visible, scores, DEFAULT_MASK_VALUE)

    max_next = jnp.maximum(max_prev, scores.max(axis=1, keepdims=True))
    correction = jnp.exp(max_prev - max_next)
    probs = jnp.where(visible, jnp.exp(scores - max_next), 0.0)
    sum_next = correction * sum_prev + probs.sum(axis=1, keepdims=True)

    value_pos = kv_start + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    v = jnp.where((value_pos >= kv_first) & (value_pos < kv_len), v, jnp.zeros_like(v))
    weights = probs
    if v_scales is not None:
        seen = (key_pos >= kv_first) & (key_pos < kv_len)
        weights = probs * jnp.where(seen, v_scales, 0.0)
    pv = lax.dot_general(
        weights.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return max_next, sum_next, correction * acc_prev + pv


def store(out_refs, state: AttentionState) -> None:
    """Write a kernel instance's result: the normalized [rows, D] output into its one
    output ref, or, with key splits, the raw state into three refs for combine_splits."""
    if len(out_refs) == 1:
        (out_ref,) = out_refs
        out_ref[...] = normalize(state, out_ref.dtype)
    else:
        for ref, value in zip(out_refs, state, strict=True):
            ref[...] = value


def tile_spec(rows: int, head_dim: int) -> pl.BlockSpec:
    """The [rows, D] block of one tile and KV head on a (tile, head, split) grid; extra
    index-map arguments (scalar-prefetched refs) are ignored."""
    return pl.BlockSpec((None, None, rows, head_dim), lambda t, h, s, *_: (t, h, 0, 0))


def kernel_outputs(q_tiles: jax.Array, num_splits: int):
    """(out_shape, out_specs) of a kernel over a (tile, head, split) grid, matching
    `store`: the normalized output like q_tiles, or with key splits the raw state
    of every split, f32 [S, NT, Hkv, rows, 1 | 1 | D], for `finish`."""
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    if num_splits == 1:
        return jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype), tile_spec(rows, head_dim)
    split_shape = (num_splits, num_tiles, num_kv_heads, rows)
    widths = (1, 1, head_dim)
    out_shape = [jax.ShapeDtypeStruct((*split_shape, w), jnp.float32) for w in widths]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, w), lambda t, h, s, *_: (s, t, h, 0, 0))
        for w in widths
    ]
    return out_shape, out_specs


def finish(out, num_splits: int, dtype: jnp.dtype) -> jax.Array:
    """A kernel's result from `kernel_outputs`' buffers: [NT, Hkv, rows, D] in dtype."""
    return out if num_splits == 1 else combine_splits(tuple(out), dtype)


def normalize(state: AttentionState, dtype: jnp.dtype) -> jax.Array:
    """acc / row_sum as [rows, D] in dtype; rows that saw no key give 0."""
    _, row_sum, acc = state
    return _divide(acc, row_sum).astype(dtype)


def combine_splits(split_states: AttentionState, dtype: jnp.dtype) -> jax.Array:
    """Merge the states of S key splits (flash-decoding), outside the kernel.

    split_states: (row_max, row_sum, acc), f32 [S, ..., 1], [S, ..., 1], [S, ..., D]
    returns [..., D] in dtype.
    """
    row_max, row_sum, acc = split_states
    weight = jnp.exp(row_max - row_max.max(axis=0))
    return _divide((weight * acc).sum(axis=0), (weight * row_sum).sum(axis=0)).astype(dtype)


def _divide(acc: jax.Array, row_sum: jax.Array) -> jax.Array:
    """acc / row_sum, with 0 where row_sum is 0 (no key was visible)."""
    return acc / jnp.where(row_sum == 0.0, 1.0, row_sum)


def split_chunk_range(
    kv_first: jax.Array, kv_len: jax.Array, split: jax.Array, num_splits: int, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """Chunks [first, last) holding keys [kv_first, kv_len) that key split `split` visits.

    Chunk c holds key positions c * chunk .. (c + 1) * chunk - 1; the chunks are
    dealt out in contiguous runs, so last <= first for splits with no work.
    """
    begin, end = lax.div(kv_first, chunk), ceil_div(kv_len, chunk)
    per_split = ceil_div(jnp.maximum(end - begin, 0), num_splits)
    first = begin + split * per_split
    return first, jnp.minimum(first + per_split, end)


def ceil_div(a: jax.Array, b: int) -> jax.Array:
    """ceil(a / b) for non-negative int32 a, as one truncating division.

    jnp's `//` rounds towards -inf through a sign op that Mosaic cannot lower
    without knowing the chip.
    """
    return lax.div(a + (b - 1), b)
