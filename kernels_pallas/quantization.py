"""Quantized KV pages: 1-byte values with one float32 scale per (token, KV head).

A quantized cache holds, for keys and for values alike, a `QuantizedPages`:

    values: [..., Hkv, num_blocks, block_size, D]  int8, or the bits of float8_e4m3fn
                                                   or float8_e5m2 as uint8
    scales: [..., Hkv, num_blocks, block_size]     float32
    format: the values' dtype (static)

The scales are laid out like the pages with head_dim dropped, so one block id names
a page of values and its page of scales: every op that indexes blocks (copy-on-write
copies, swaps to and from the host, sharding by KV head) applies to both leaves
alike with `jax.tree.map`, and the scales can never be left behind.

fp8 values are stored as their bits because XLA's CPU backend cannot compute in
fp8: it runs a scatter into an fp8 array (each step's write, each copy-on-write
copy) by converting the whole array to float16 and back, a pass over the pool for
every layer of every step. A uint8 scatter touches only the rows written. Readers
view the bits as the format after loading them (`as_format`), a free bitcast.

A token's scale is computed when it is written (symmetric absmax over head_dim):
scale = max|x| / QMAX, values = x / scale rounded (int8) or cast (fp8) after clipping
to +-QMAX. Reading dequantizes to values * scale. The error of one element is at
most half a quantization step: scale / 2 for int8; for fp8, half the spacing of the
format near the value (a relative 2**-4 for e4m3's 3 mantissa bits, 2**-3 for
e5m2's 2), so at most max|x| * 2**-4 (e4m3) or max|x| * 2**-3 (e5m2), plus fp8's
flush of the smallest values (below 2**-9 * scale for e4m3) to subnormals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax import lax

# The largest magnitude each format stores: the absmax of a token maps onto it.
QMAX = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),  # 57,344
}
SCALE_DTYPE = jnp.float32
# The dtype that holds each format's values in a cache.
STORAGE_DTYPE = {
    jnp.dtype(jnp.int8): jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
    jnp.dtype(jnp.float8_e5m2): jnp.dtype(jnp.uint8),
}


def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` holds scaled 1-byte values."""
    return jnp.dtype(dtype) in QMAX


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """The pages of a quantized cache (module docstring): `values` stored as
    STORAGE_DTYPE[format], and their `scales`.

    shape and ndim are the values', dtype is their format: what the ops check of a
    cache's layout.
    """

    values: jax.Array
    scales: jax.Array
    format: jnp.dtype = field(metadata={"static": True})

    def __post_init__(self):
        # jnp.int8 and jnp.dtype(jnp.int8) must name one format (it is a static key).
        object.__setattr__(self, "format", jnp.dtype(self.format))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self) -> jnp.dtype:
        return self.format


# A cache's keys or values: plain pages in a float dtype, or quantized ones.
Pages = jax.Array | QuantizedPages


def zeros(shape: tuple[int, ...], dtype) -> Pages:
    """A zeroed cache of pages [..., block_size, D] in `dtype` (scales too, if quantized)."""
    if not is_quantized(dtype):
        return jnp.zeros(shape, dtype)
    dtype = jnp.dtype(dtype)
    return QuantizedPages(jnp.zeros(shape, STORAGE_DTYPE[dtype]),
                          jnp.zeros(shape[:-1], SCALE_DTYPE), dtype)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] stored as STORAGE_DTYPE[dtype], scales f32 [...]):
    symmetric absmax per row. A row of zeros gets scale 0 and values 0."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    x = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / qmax
    scaled = x / jnp.where(scales == 0.0, 1.0, scales)[..., None]
    scaled = jnp.clip(scaled, -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return lax.bitcast_convert_type(scaled.astype(dtype), STORAGE_DTYPE[dtype]), scales


def as_format(stored: jax.Array, format) -> jax.Array:
    """Stored values (STORAGE_DTYPE[format]) viewed as their format, bit for bit."""
    format = jnp.dtype(format)
    return stored if stored.dtype == format else lax.bitcast_convert_type(stored, format)


def dequantize(stored: jax.Array, scales: jax.Array, format, dtype=jnp.float32) -> jax.Array:
    """stored values [..., D] of `format`, scales [...] -> values * scales [..., D] in
    dtype (f32 math)."""
    values = as_format(stored, format).astype(jnp.float32)
    return (values * scales[..., None]).astype(dtype)


def as_float(pages: Pages, dtype=jnp.float32) -> jax.Array:
    """A whole cache as plain pages in dtype: quantized ones dequantized."""
    if isinstance(pages, QuantizedPages):
        return dequantize(pages.values, pages.scales, pages.format, dtype)
    return pages.astype(dtype)
