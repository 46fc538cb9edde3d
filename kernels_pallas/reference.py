"""Pure-JAX definitions of paged attention: gather the pages, then attend.

These are the oracles the Pallas kernels are tested against. KV cache layout:

    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]     (one layer)
                   or [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
                      with an int32 scalar `layer` naming the layer to use;
                      plain arrays or EncodedPages (quantization.py), whose pages
                      are decoded to f32 as they are gathered

Flat slot `s` is block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.quantization import EncodedPages, Pages, dequantize, encode

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Full f32 products on every backend (TPUs and GPUs would otherwise round f32 matmuls).
HIGHEST = jax.lax.Precision.HIGHEST


def write_kv_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V into the cache (slots past the pool are dropped).

    k_cache, v_cache: [Hkv, num_blocks, block_size, D], or [L, Hkv, num_blocks,
                      block_size, D] with `layer` (int32 scalar) the layer written;
                      plain or EncodedPages (a quantized format scales each
                      token per KV head; a 2-byte float stores its bits)
    k, v:             [T, Hkv, D]
    slot_mapping:     int32 [T]
    returns the updated (k_cache, v_cache).
    """
    block_size = k_cache.shape[-2]
    # Index the cache's own axes: a scatter through a flattened view can lose its
    # in-place buffer once XLA turns a one-token write into a dynamic-update-slice.
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size

    def scatter_array(cache, new):
        if layer is None:
            return cache.at[:, blocks, offsets].set(new.swapaxes(0, 1), mode="drop")
        # Index arrays apart from one another put the token axis first: [T, Hkv, ...].
        return cache.at[layer, :, blocks, offsets].set(new, mode="drop")

    def scatter(cache: Pages, new) -> Pages:
        if isinstance(cache, EncodedPages):
            values, scales = encode(new, cache.format)
            if scales is not None:
                scales = scatter_array(cache.scales, scales)
            return EncodedPages(scatter_array(cache.values, values), scales, cache.format)
        return scatter_array(cache, new.astype(cache.dtype))

    return scatter(k_cache, k), scatter(v_cache, v)


def as_layered(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | None):
    """A one-layer cache [Hkv, N, bs, D] as layer 0 of [1, Hkv, N, bs, D]; a stacked
    cache [L, Hkv, N, bs, D] as it is. -> (k_cache, v_cache, layer int32 scalar)."""
    if layer is None:
        return (*(jax.tree.map(lambda x: x[None], c) for c in (k_cache, v_cache)),
                jnp.int32(0))
    return k_cache, v_cache, jnp.asarray(layer, jnp.int32)


def _gather_sequence(cache: Pages, layer: jax.Array, block_table: jax.Array) -> jax.Array:
    """cache [L, Hkv, N, bs, D], block_table [max_blocks] -> [Hkv, max_blocks * bs, D]
    (encoded pages decoded to f32)."""
    # Index arrays apart from one another put the table axis first: [max_blocks, Hkv, bs, ...].
    pages = jax.tree.map(lambda x: x[layer, :, block_table].swapaxes(0, 1), cache)
    if isinstance(pages, EncodedPages):
        pages = dequantize(pages.values, pages.scales, pages.format)
    return pages.reshape(cache.shape[1], -1, cache.shape[-1])


def _visible(key_pos: jax.Array, pos: jax.Array, sliding_window) -> jax.Array:
    """Keys the query at position pos sees: causal, and within its window if any."""
    visible = key_pos <= pos
    if sliding_window is None:
        return visible
    return visible & (key_pos > pos - sliding_window)


def _attend(q, k, v, mask, scale, soft_cap):
    """q [Q, Hq, D], k/v [Hkv, S, D], mask [Q, S] -> [Q, Hq, D] (f32 math)."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[0]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(q.shape[0], num_kv_heads, group, q.shape[-1])
    scores = jnp.einsum("qhgd,hsd->hgqs", qg, k.astype(jnp.float32), precision=HIGHEST) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[None, None], scores, DEFAULT_MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(-1)[None, None, :, None], probs, 0.0)
    # Slots no query sees may hold anything, NaN included: 0 * NaN would leak.
    v = jnp.where(mask.any(0)[None, :, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("hgqs,hsd->qhgd", probs, v, precision=HIGHEST)
    return out.reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("soft_cap",))
def paged_decode_attention_reference(
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
) -> jax.Array:
    """One query token per sequence.

    q:            [B, Hq, D]   (Hq a multiple of Hkv)
    k/v_cache:    [Hkv, num_blocks, block_size, D], or [L, ...] of those with `layer`
    block_tables: int32 [B, max_blocks]
    context_lens: int32 [B]    0 for padding rows (their output is 0)
    layer:        int32 scalar, the layer of a stacked cache (None for a one-layer cache)
    sliding_window: int32 scalar W: the token at position p sees keys p - W < j <= p
                  (None: every key)
    returns       [B, Hq, D] in q.dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_cache, v_cache, layer = as_layered(k_cache, v_cache, layer)

    def one(q_row, table, length):
        k = _gather_sequence(k_cache, layer, table)
        v = _gather_sequence(v_cache, layer, table)
        mask = _visible(jnp.arange(k.shape[1]), length - 1, sliding_window)[None, :]
        return _attend(q_row[None], k, v, mask, scale, soft_cap)[0]

    return jax.vmap(one)(q, block_tables, context_lens).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("soft_cap",))
def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Causal attention for a flat run of new tokens from several sequences.

    Sequence i owns tokens query_start_loc[i]:query_start_loc[i+1] of q; they
    sit at the last q_len positions of its context_lens[i] cached tokens (their
    K/V are already written) and each attends to every cached position up to
    its own.

    q:               [T, Hq, D]
    k/v_cache:       [Hkv, num_blocks, block_size, D], or [L, ...] of those with `layer`
    block_tables:    int32 [B, max_blocks]
    context_lens:    int32 [B]
    query_start_loc: int32 [B + 1]
    layer:           int32 scalar, the layer of a stacked cache (None for a one-layer cache)
    sliding_window:  as paged_decode_attention_reference
    returns          [T, Hq, D] in q.dtype; tokens owned by no sequence get 0.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_cache, v_cache, layer = as_layered(k_cache, v_cache, layer)
    num_tokens = q.shape[0]
    token_ids = jnp.arange(num_tokens)
    # Owner sequence of each token, and its position within that sequence.
    owner = jnp.searchsorted(query_start_loc, token_ids, side="right") - 1
    owner = jnp.clip(owner, 0, context_lens.shape[0] - 1)
    owned = (token_ids >= query_start_loc[owner]) & (token_ids < query_start_loc[owner + 1])
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    q_pos = context_lens[owner] - q_lens[owner] + (token_ids - query_start_loc[owner])

    def one(q_row, table, pos, valid):
        k = _gather_sequence(k_cache, layer, table)
        v = _gather_sequence(v_cache, layer, table)
        mask = (_visible(jnp.arange(k.shape[1]), pos, sliding_window) & valid)[None, :]
        return _attend(q_row[None], k, v, mask, scale, soft_cap)[0]

    out = jax.vmap(one)(q, block_tables[owner], q_pos, owned)
    return out.astype(q.dtype)
