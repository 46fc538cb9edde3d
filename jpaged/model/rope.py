"""Rotary position embeddings: the frequencies (with Llama 3.1's scaling) and the rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.model.config import LlamaConfig


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 [head_dim // 2]: the angle per position of each rotated pair.

    With llama3 scaling, wavelengths longer than the original context divided by
    low_freq_factor are slowed down by `factor`, those shorter than it divided by
    high_freq_factor are kept, and the band between interpolates smoothly.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    inv_freq = 1.0 / np.float32(config.rope_theta) ** exponents
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor,
                      interpolated)
    scaled = np.where(wavelen < original / scaling.high_freq_factor, inv_freq, scaled)
    return scaled.astype(np.float32)


def rotary_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions int32 [T], inv_freq f32 [D/2] -> (cos, sin), each f32 [T, D/2]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE: x [T, H, D], cos/sin f32 [T, D/2] -> [T, H, D] in x.dtype.

    Pairs are (i, i + D/2), Hugging Face's layout (GGUF's interleaved layout is
    converted at load time).
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
