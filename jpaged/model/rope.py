"""Rotary position embeddings: the frequencies (with Llama 3.1's or linear scaling, and
Gemma 3's local RoPE of sliding layers) and the rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.model.config import LinearRopeScaling, LlamaConfig


def _default_frequencies(theta: float, head_dim: int) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (1.0 / np.float32(theta) ** exponents).astype(np.float32)


def layer_rope_frequencies(config: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """(inverse frequencies f32 [K, head_dim // 2] of the model's K RoPEs, each layer's
    RoPE int32 [num_layers]). K is 1 but for local_rope_theta: then sliding layers take
    the second, plain RoPE of that base."""
    layers = np.zeros(config.num_layers, np.int32)
    if config.local_rope_theta is None:
        return rope_inverse_frequencies(config)[None], layers
    local = _default_frequencies(config.local_rope_theta, config.head_dim)
    sliding = np.asarray([w is not None for w in config.layer_windows])
    return np.stack([rope_inverse_frequencies(config), local]), np.where(sliding, 1, 0).astype(
        np.int32)


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 [head_dim // 2]: the angle per position of each rotated pair.

    With llama3 scaling, wavelengths longer than the original context divided by
    low_freq_factor are slowed down by `factor`, those shorter than it divided by
    high_freq_factor are kept, and the band between interpolates smoothly. Linear
    scaling divides every frequency by its factor.
    """
    inv_freq = _default_frequencies(config.rope_theta, config.head_dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
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
    """positions int32 [T], inv_freq f32 [..., D/2] -> (cos, sin), each f32 [..., T, D/2]."""
    angles = (positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[..., None, :])
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
