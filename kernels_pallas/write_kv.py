"""Writing this step's K/V into the paged cache.

New rows are scattered at (block, offset) = divmod(slot, block_size) of the
page layout. Inside a jitted step that donates the cache, XLA performs the
scatter in place: it touches only the T * Hkv rows written, never the pool.
The indices address the 4-D cache directly rather than a flattened
[Hkv, num_blocks * block_size, D] view: with one new token XLA turns the
scatter into a dynamic-update-slice, and through the reshape that slice lost
its in-place buffer, so every layer copied its whole cache (seconds per step on
CPU at a few thousand blocks).

A Pallas kernel with `input_output_aliases` can make the same in-place writes
(one program per token); benchmarks/kernels.py times it against this scatter.
The scatter is kept: it is one fused op on every backend with no per-backend
kernel to maintain, and it is the faster of the two wherever the benchmark
has run (on CPU, where the kernel is interpreted). Replace it if the kernel
wins on an accelerator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Store new keys and values at their cache slots.

    k_cache, v_cache: [Hkv, num_blocks, block_size, D]
    k, v:             [T, Hkv, D], cast to the cache dtype
    slot_mapping:     int32 [T], flat slot block * block_size + offset; padding
                      tokens point into the null block 0. Slots outside the
                      pool are dropped.
    returns the updated (k_cache, v_cache); donate the caches to update in place.
    """
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_kv_heads, num_blocks, block_size, head_dim], "
            f"got {k_cache.shape} and {v_cache.shape}"
        )
    if slot_mapping.ndim != 1 or slot_mapping.dtype != jnp.int32:
        raise TypeError(
            f"slot_mapping must be int32 [T], got {slot_mapping.dtype} {slot_mapping.shape}"
        )
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if k.shape != expected or v.shape != expected:
        raise ValueError(f"k and v must be [T, Hkv, D] = {expected}, got {k.shape} and {v.shape}")
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size

    def scatter(cache, new):
        rows = new.swapaxes(0, 1).astype(cache.dtype)
        return cache.at[:, blocks, offsets].set(rows, mode="drop")

    return scatter(k_cache, k), scatter(v_cache, v)
