"""The device sampler against numpy definitions of greedy, top-k, top-p and temperature."""

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.sampler import sample
from jpaged.sampling_params import SamplingParams

VOCAB = 12


def _logits(rows, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, VOCAB)).astype(np.float32) * 2


def _draw(logits_row, temperature, top_k, top_p, num_draws):
    """num_draws samples of one row, each from its own seed."""
    rows = np.repeat(logits_row[None], num_draws, axis=0)
    out = sample(
        jnp.asarray(rows),
        jnp.full(num_draws, temperature, jnp.float32),
        jnp.full(num_draws, top_k, jnp.int32),
        jnp.full(num_draws, top_p, jnp.float32),
        jnp.arange(num_draws, dtype=jnp.uint32),
        jnp.zeros(num_draws, jnp.int32),
    )
    return np.asarray(out)


def _numpy_probs(logits_row, temperature, top_k, top_p):
    """The filtered distribution, written from the definitions."""
    z = logits_row.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros(VOCAB, bool)
    mass = 0.0
    for rank, token in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[token] = True
        mass += probs[token]
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def test_greedy_rows_take_the_argmax():
    logits = _logits(5)
    zeros = jnp.zeros(5)
    out = sample(jnp.asarray(logits), zeros, zeros.astype(jnp.int32), jnp.ones(5),
                 jnp.arange(5, dtype=jnp.uint32), zeros.astype(jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), logits.argmax(-1))


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (1.0, 5, 0.8)]
)
def test_sampled_frequencies_match_the_filtered_distribution(temperature, top_k, top_p):
    logits_row = _logits(1, seed=3)[0]
    num_draws = 20_000
    draws = _draw(logits_row, temperature, top_k, top_p, num_draws)
    expected = _numpy_probs(logits_row, temperature, top_k, top_p)
    observed = np.bincount(draws, minlength=VOCAB) / num_draws
    assert np.all(observed[expected == 0] == 0), "sampled a filtered-out token"
    np.testing.assert_allclose(observed, expected, atol=0.015)


def test_seeded_row_is_independent_of_its_batch():
    logits = _logits(4, seed=1)
    def run(rows):
        n = len(rows)
        return np.asarray(sample(
            jnp.asarray(logits[rows]), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n),
            jnp.asarray(np.array([7, 8, 9, 10], np.uint32)[rows]), jnp.full(n, 5, jnp.int32)))
    alone = run([2])
    in_batch = run([0, 1, 2, 3])
    reordered = run([3, 2])
    assert alone[0] == in_batch[2] == reordered[1]


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=2.5)
