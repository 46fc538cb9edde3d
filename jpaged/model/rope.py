"""Rotary position embeddings: the frequencies (with Llama 3.1's, linear or Phi-3's
LongRoPE scaling, and Gemma 3's local RoPE of sliding layers), the step's tables and
the rotation (of the first rotary_dim dimensions of a head)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.model.config import LinearRopeScaling, LlamaConfig, LongRopeScaling


def _default_frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (1.0 / np.float32(theta) ** exponents).astype(np.float32)


def layer_ropes(config: LlamaConfig) -> np.ndarray:
    """int32 [num_layers]: each layer's RoPE, an index into rope_tables' first axis: 0 but
    for the sliding layers of a model with local_rope_theta, 1."""
    if config.local_rope_theta is None:
        return np.zeros(config.num_layers, np.int32)
    return np.asarray([w is not None for w in config.layer_windows], np.int32)


def rope_tables(config: LlamaConfig, metadata: AttentionMetadata
                ) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each f32 [K, T, rotary_dim // 2], of the step's tokens for each of the
    model's K RoPEs (layer_ropes). With LongRoPE each token takes the long factors when its
    sequence, after this step, is longer than original_max_position_embeddings (as
    transformers decides by a forward call's largest position): per sequence, never
    per batch."""
    positions = metadata.positions
    inv_freqs = [rope_inverse_frequencies(config)]
    if config.local_rope_theta is not None:
        inv_freqs.append(_default_frequencies(config.local_rope_theta, config.rotary_dim))
    cos, sin = rotary_tables(positions, np.stack(inv_freqs))
    scaling = config.rope_scaling
    if not isinstance(scaling, LongRopeScaling):
        return cos, sin
    long_cos, long_sin = rotary_tables(positions, long_rope_frequencies(config)[None])
    owner = jnp.searchsorted(metadata.query_start_loc, jnp.arange(positions.shape[0]),
                             side="right") - 1
    owner = jnp.clip(owner, 0, metadata.context_lens.shape[0] - 1)
    long = (metadata.context_lens[owner] > scaling.original_max_position_embeddings)[:, None]
    factor = scaling.attention_factor
    return (factor * jnp.where(long, long_cos, cos), factor * jnp.where(long, long_sin, sin))


def long_rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 [rotary_dim // 2]: LongRoPE's frequencies for long sequences."""
    inv_freq = _default_frequencies(config.rope_theta, config.rotary_dim)
    return (inv_freq / np.asarray(config.rope_scaling.long_factor, np.float32)).astype(
        np.float32)


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 [rotary_dim // 2]: the angle per position of each rotated pair.

    With llama3 scaling, wavelengths longer than the original context divided by
    low_freq_factor are slowed down by `factor`, those shorter than it divided by
    high_freq_factor are kept, and the band between interpolates smoothly. Linear
    scaling divides every frequency by its factor; LongRoPE's short factors divide
    each its own.
    """
    inv_freq = _default_frequencies(config.rope_theta, config.rotary_dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if isinstance(scaling, LongRopeScaling):
        return (inv_freq / np.asarray(scaling.short_factor, np.float32)).astype(np.float32)
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
    """Rotate-half RoPE of the first R dimensions: x [T, H, D], cos/sin f32 [T, R/2]
    -> [T, H, D] in x.dtype; dimensions R.. pass unturned (partial rotary).

    Pairs are (i, i + R/2), Hugging Face's layout (GGUF's interleaved layout is
    converted at load time).
    """
    rotary = 2 * cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    first, second = jnp.split(x[..., :rotary].astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary:]], axis=-1)
