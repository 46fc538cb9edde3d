"""Token selection on device: greedy, temperature, top-k and top-p, per row.

Each row draws from its own key, fold_in(PRNGKey(seed), step), where step is
the number of tokens the sequence has generated so far: a seeded request gets
the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.sampling_params import SamplingParams


def _filter(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask to -inf every logit outside each row's top-k and top-p sets. [B, V] -> [B, V]."""
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = scaled.shape[-1]
    kth = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab) - 1
    kth_logit = jnp.take_along_axis(sorted_logits, kth[:, None], axis=-1)
    # Nucleus: keep the smallest prefix of sorted tokens whose mass reaches top_p.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    nucleus_size = jnp.sum(mass_before < top_p[:, None], axis=-1)
    nucleus_logit = jnp.take_along_axis(sorted_logits, (nucleus_size - 1)[:, None], axis=-1)
    return jnp.where(scaled >= jnp.maximum(kth_logit, nucleus_logit), scaled, -jnp.inf)


def _draw(logits, temperature, top_k, top_p, seeds, steps) -> jax.Array:
    """A token per row from its temperature-scaled, filtered distribution. -> int32 [B]."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # The vocabulary sort costs more than the rest of sampling: skip it when no row filters.
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    filtered = jax.lax.cond(needs_filter, _filter, lambda s, k, p: s, scaled, top_k, top_p)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


@jax.jit
def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
) -> jax.Array:
    """Pick one token per row.

    logits:      f32 [B, V]
    temperature: f32 [B]     0 means greedy
    top_k:       int32 [B]   0 means no top-k filter
    top_p:       f32 [B]     1 means no nucleus filter
    seeds:       uint32 [B]
    steps:       int32 [B]   tokens generated so far by each row
    returns      int32 [B]
    """
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    any_sampled = jnp.any(temperature > 0)
    sampled = jax.lax.cond(
        any_sampled,
        _draw,
        lambda *args: greedy_tokens,
        logits, temperature, top_k, top_p, seeds, steps,
    )
    return jnp.where(temperature > 0, sampled, greedy_tokens)


def sampling_arrays(
    params: list[SamplingParams], seeds: list[int], steps: list[int], num_rows: int
) -> tuple[np.ndarray, ...]:
    """Host-side per-row arrays for `sample`, padded to num_rows (padding rows are greedy).

    returns temperature f32 [R], top_k int32 [R], top_p f32 [R], seeds uint32 [R], steps int32 [R].
    """
    pad = num_rows - len(params)
    temperature = np.array([p.temperature for p in params] + [0.0] * pad, np.float32)
    top_k = np.array([p.top_k for p in params] + [0] * pad, np.int32)
    top_p = np.array([p.top_p for p in params] + [1.0] * pad, np.float32)
    seed_arr = np.array(list(seeds) + [0] * pad, np.uint32)
    step_arr = np.array(list(steps) + [0] * pad, np.int32)
    return temperature, top_k, top_p, seed_arr, step_arr
