"""Writing this step's K/V into the paged cache.

New rows are scattered at (block, offset) = divmod(slot, block_size) of the
page layout (reference.write_kv_reference). Inside a jitted step that donates
the cache, XLA performs the scatter in place: it touches only the T * Hkv rows
written, never the pool. The indices address the 4-D cache directly rather than
a flattened [Hkv, num_blocks * block_size, D] view: with one new token XLA turns
the scatter into a dynamic-update-slice, and through the reshape that slice lost
its in-place buffer, so every layer copied its whole cache (seconds per step on
CPU at a few thousand blocks).

The alternative is a Pallas kernel whose outputs alias the caches
(`input_output_aliases`), one program per token; benchmarks/kernels.py times
one against this scatter. On CPU (kernel interpreted, 8 KV heads of 128,
4096 blocks of 16) neither wins throughout: the kernel took 10 / 12-17 / 47-50
/ 283 us for 1 / 8 / 64 / 256 tokens, the scatter 46 / 11-12 / 56-80 /
304-319 us. A kernel that must store head by head (Triton blocks are powers of
two, and 3 KV heads are not) took twice as long from 8 tokens on. With no clear
winner the scatter stays: one fused op on every backend, no per-backend kernel
to keep. If the benchmark shows the kernel ahead on an accelerator, switch there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.quantization import STORAGE_DTYPE, EncodedPages, is_quantized
from kernels_pallas.reference import write_kv_reference


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Store new keys and values at their cache slots.

    k_cache, v_cache: [Hkv, num_blocks, block_size, D], or the stacked cache of
                      every layer [L, Hkv, num_blocks, block_size, D]; plain, or
                      EncodedPages whose scales are laid out alike without D
    k, v:             [T, Hkv, D], cast to the cache dtype (quantized: scaled per
                      token and KV head, the scale stored beside the values)
    slot_mapping:     int32 [T], flat slot block * block_size + offset; padding
                      tokens point into the null block 0. Slots past the pool
                      are dropped.
    layer:            int32 scalar, the layer written in a stacked cache; None
                      for a one-layer cache.
    returns the updated (k_cache, v_cache); donate the caches to update in place.
    """
    check_cache_shapes(k_cache, v_cache, layer)
    if slot_mapping.ndim != 1 or slot_mapping.dtype != jnp.int32:
        raise TypeError(
            f"slot_mapping must be int32 [T], got {slot_mapping.dtype} {slot_mapping.shape}"
        )
    num_kv_heads, head_dim = k_cache.shape[-4], k_cache.shape[-1]
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(f"k and v must be [T, Hkv, D] = {expected}, got {k.shape} and {v.shape}")
    if slot_mapping.shape[0] == 1:
        # XLA rewrites a one-index scatter as a dynamic-update-slice, and when a
        # loop then reads the cache (the XLA attention does) it copies the whole
        # cache to keep the slice in place. Writing the one token twice keeps it
        # a scatter: the same value lands in the same slot.
        k, v, slot_mapping = (jnp.concatenate([x, x]) for x in (k, v, slot_mapping))
    return write_kv_reference(k_cache, v_cache, k, v, slot_mapping, layer)


def check_cache_shapes(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | None) -> None:
    """A one-layer cache (4-D, layer None) or a stacked one (5-D, an integer scalar layer)."""
    if layer is None:
        ndim, layout = 4, "[num_kv_heads, num_blocks, block_size, head_dim]"
    else:
        ndim = 5
        layout = "[num_layers, num_kv_heads, num_blocks, block_size, head_dim] (a layer given)"
    if k_cache.ndim != ndim or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be {layout}, got {k_cache.shape} and {v_cache.shape}"
        )
    encoded = [isinstance(cache, EncodedPages) for cache in (k_cache, v_cache)]
    if encoded[0] != encoded[1] or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must be of one kind and dtype, got "
                        f"{type(k_cache).__name__} {k_cache.dtype} and "
                        f"{type(v_cache).__name__} {v_cache.dtype}")
    for cache in (k_cache, v_cache):
        if not isinstance(cache, EncodedPages):
            continue
        scales = None if cache.scales is None else cache.scales.shape
        if scales != (cache.shape[:-1] if is_quantized(cache.format) else None):
            raise ValueError(f"{cache.format} pages {cache.shape} need scales "
                             f"{cache.shape[:-1] if is_quantized(cache.format) else None}, "
                             f"got {scales}")
        if cache.values.dtype != STORAGE_DTYPE.get(cache.format):
            raise TypeError(f"{cache.format} pages are stored as "
                            f"{STORAGE_DTYPE.get(cache.format)}, got {cache.values.dtype}")
    if layer is not None and (jnp.ndim(layer) != 0
                              or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise TypeError(f"layer must be an integer scalar, got {layer!r}")
