"""Encoded KV pages: 1-byte values with one float32 scale per (token, KV head), and
2-byte floats stored as their bits.

An encoded cache holds, for keys and for values alike, an `EncodedPages`:

    values: [..., Hkv, num_blocks, block_size, D]  int8, or the bits of float8_e4m3fn,
                                                   float8_e5m2 (uint8), bfloat16 or
                                                   float16 (uint16)
    scales: [..., Hkv, num_blocks, block_size]     float32, for the 1-byte (quantized)
                                                   formats; None for 2-byte floats
    format: the values' dtype (static)

The scales are laid out like the pages with head_dim dropped, so one block id names
a page of values and its page of scales: every op that indexes blocks (copy-on-write
copies, swaps to and from the host, sharding by KV head) applies to both leaves
alike with `jax.tree.map`, and the scales can never be left behind.

Floats narrower than 4 bytes are stored as their bits because XLA's CPU backend
cannot compute in them: it runs a scatter into an fp8, bfloat16 or float16 array
(each step's write, each copy-on-write copy), and even a gather from one, by
converting the whole array to a wider float and back, a pass over the pool for
every layer of every step. An integer scatter or gather touches only the
rows it moves. Readers view the bits as the format after loading them
(`as_format`), a free bitcast.

An int8 cache holds keys and values in a rotated basis (`rotation`, applied by the
model): int8's steps are uniform, so a token whose absmax one outlier channel sets
(the keys of Llama- and Gemma-style models have such channels) loses its small
channels to rounding; rotated by an orthonormal Hadamard matrix, every channel
carries a share of the outlier and the absmax falls towards the token's norm over
sqrt(head_dim). fp8's steps are relative to each value, so its small channels keep
their precision unrotated.

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
import numpy as np
from jax import lax

# The largest magnitude each format stores: the absmax of a token maps onto it.
QMAX = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),  # 57,344
}
# The formats whose caches hold K and V rotated (module docstring).
ROTATED_FORMATS = frozenset({jnp.dtype(jnp.int8)})
SCALE_DTYPE = jnp.float32
# The dtype that holds each encoded format's values in a cache.
STORAGE_DTYPE = {
    jnp.dtype(jnp.int8): jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
    jnp.dtype(jnp.float8_e5m2): jnp.dtype(jnp.uint8),
    jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
    jnp.dtype(jnp.float16): jnp.dtype(jnp.uint16),
}


def is_encoded(dtype) -> bool:
    """Whether a cache of `dtype` is EncodedPages (quantized, or a 2-byte float)."""
    return jnp.dtype(dtype) in STORAGE_DTYPE


def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` holds scaled 1-byte values."""
    return jnp.dtype(dtype) in QMAX


def is_rotated(dtype) -> bool:
    """Whether a cache of `dtype` holds its keys and values in `rotation`'s basis."""
    return jnp.dtype(dtype) in ROTATED_FORMATS


def rotation(head_dim: int) -> np.ndarray:
    """R f32 [head_dim, head_dim], orthonormal: the normalized Walsh-Hadamard matrix of
    the largest power of two dividing head_dim, repeated along the diagonal (96 -> three
    blocks of 32). Rotating queries, keys and values by R changes no score,
    (q R)(k R)^T = q k^T, and attention's output comes back as (p V R) R^T = p V."""
    size = head_dim & -head_dim
    block = np.ones((1, 1))
    while len(block) < size:
        block = np.block([[block, block], [block, -block]])
    return np.kron(np.eye(head_dim // size), block / np.sqrt(size)).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EncodedPages:
    """The pages of an encoded cache (module docstring): `values` stored as
    STORAGE_DTYPE[format], and their `scales` (None unless the format is quantized).

    shape and ndim are the values', dtype is their format: what the ops check of a
    cache's layout.
    """

    values: jax.Array
    scales: jax.Array | None
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


# A cache's keys or values: plain pages in a float dtype, or encoded ones.
Pages = jax.Array | EncodedPages


def zeros(shape: tuple[int, ...], dtype) -> Pages:
    """A zeroed cache of pages [..., block_size, D] in `dtype`: plain pages of a 4-byte
    float, else EncodedPages (with scales if quantized)."""
    if not is_encoded(dtype):
        return jnp.zeros(shape, dtype)
    dtype = jnp.dtype(dtype)
    scales = jnp.zeros(shape[:-1], SCALE_DTYPE) if is_quantized(dtype) else None
    return EncodedPages(jnp.zeros(shape, STORAGE_DTYPE[dtype]), scales, dtype)


def encode(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """x [..., D] -> (values [..., D] stored as STORAGE_DTYPE[dtype], and scales f32
    [...] if dtype is quantized, else None)."""
    if is_quantized(dtype):
        return quantize(x, dtype)
    dtype = jnp.dtype(dtype)
    return lax.bitcast_convert_type(x.astype(dtype), STORAGE_DTYPE[dtype]), None


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


def dequantize(stored: jax.Array, scales: jax.Array | None, format,
               dtype=jnp.float32) -> jax.Array:
    """stored values [..., D] of `format`, scales [...] (or None) -> values * scales
    [..., D] in dtype (f32 math; without scales, the values themselves)."""
    values = as_format(stored, format).astype(jnp.float32)
    if scales is not None:
        values = values * scales[..., None]
    return values.astype(dtype)


def as_float(pages: Pages, dtype=jnp.float32) -> jax.Array:
    """A whole cache as plain pages in dtype: encoded ones decoded."""
    if isinstance(pages, EncodedPages):
        return dequantize(pages.values, pages.scales, pages.format, dtype)
    return pages.astype(dtype)
