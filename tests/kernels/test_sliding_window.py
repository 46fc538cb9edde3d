"""Sliding-window paged attention: the reference against a dense numpy definition, and
every kernel against the reference on a pool where everything a windowed read must not
touch is NaN (unowned slots, and every block wholly before its sequence's windows).

A window W lets the query at position p see keys j with p - W < j <= p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from tests.kernels.test_kernels import F32, RaggedBatch, assert_close, make_pool
from tests.plugins.kernels import kernel_interpret

BLOCK_SIZE = 8
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 64
# Windows smaller than a block, of one block, between blocks, and past every context.
WINDOWS = [1, 5, BLOCK_SIZE, 21, 1000]
BATCH = RaggedBatch(  # (cached prefix, new tokens)
    prefix_and_new=((0, 37), (2 * BLOCK_SIZE + 5, 1), (0, 0), (BLOCK_SIZE + 3, 19),
                    (40, 9), (0, 1)),
    padding_tokens=3,
)


def numpy_attention(q, k, v, positions, window, scale, soft_cap=None):
    """Dense attention of queries at `positions` over keys 0..len(k)-1, float64.
    q [Tq, Hq, D], k/v [S, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,shd->hqs", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    key_pos = np.arange(k.shape[0])[None, :]
    visible = (key_pos <= positions[:, None]) & (key_pos > positions[:, None] - window)
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqs,shd->qhd", probs, v)


def sequence_kv(pool, row: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's first `length` keys and values from its pages, [S, Hkv, D] float64."""
    pages = np.asarray(pool.block_tables[row])
    k = np.asarray(pool.k, np.float64)[:, pages].reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    v = np.asarray(pool.v, np.float64)[:, pages].reshape(NUM_KV_HEADS, -1, HEAD_DIM)
    return k[:, :length].transpose(1, 0, 2), v[:, :length].transpose(1, 0, 2)


def poison_outside_windows(pool, first_positions, window: int):
    """The pool's NaN-poisoned K/V, with every block wholly before position
    first_position - window + 1 of its sequence poisoned too."""
    k, v = np.array(pool.k_nan), np.array(pool.v_nan)
    for row, first in enumerate(first_positions):
        lowest = max(first - window + 1, 0)
        for logical in range(lowest // BLOCK_SIZE):
            block = int(pool.block_tables[row, logical])
            k[:, block], v[:, block] = np.nan, np.nan
    return jnp.asarray(k), jnp.asarray(v)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(21)
    pool = make_pool(rng, BATCH.context_lens, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                     block_size=BLOCK_SIZE, dtype=F32)
    q = jnp.asarray(rng.standard_normal((BATCH.num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM)),
                    F32)
    return pool, q, jnp.asarray(BATCH.query_start_loc, jnp.int32)


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_equals_dense_windowed_attention(batch, window):
    pool, q, query_start_loc = batch
    ragged = np.asarray(kp.ragged_paged_attention_reference(
        q, pool.k, pool.v, pool.block_tables, pool.context_lens, query_start_loc,
        sliding_window=window, scale=0.2, soft_cap=3.0))
    decode = np.asarray(kp.paged_decode_attention_reference(
        q[: len(BATCH.context_lens)], pool.k, pool.v, pool.block_tables, pool.context_lens,
        sliding_window=window))
    starts = BATCH.query_start_loc
    for row, (prefix, new) in enumerate(BATCH.prefix_and_new):
        length = prefix + new
        if length == 0:
            continue
        k, v = sequence_kv(pool, row, length)
        rows = slice(starts[row], starts[row] + new)
        positions = np.arange(prefix, length)
        np.testing.assert_allclose(ragged[rows], numpy_attention(
            np.asarray(q[rows], np.float64), k, v, positions, window, 0.2, 3.0), atol=1e-5)
        np.testing.assert_allclose(decode[row], numpy_attention(
            np.asarray(q[row : row + 1], np.float64), k, v, np.array([length - 1]), window,
            HEAD_DIM**-0.5)[0], atol=1e-5)


# (implementation, block_q or None, key splits)
KERNELS = [("xla", None, 1), ("xla", 1, 1), ("triton", 8, 1), ("triton", None, 2),
           ("tpu", 8, 1), ("tpu", None, 2)]


@pytest.mark.parametrize("implementation,block_q,splits", KERNELS)
def test_windowed_kernels_match_the_reference_without_reading_outside(batch, implementation,
                                                                      block_q, splits):
    pool, q, query_start_loc = batch
    interpret = kernel_interpret(implementation)
    first_new = [prefix for prefix, _ in BATCH.prefix_and_new]
    last = [max(prefix + new - 1, 0) for prefix, new in BATCH.prefix_and_new]
    decode_q = q[: len(BATCH.context_lens)]
    for window in WINDOWS:
        knobs = dict(sliding_window=jnp.int32(window), soft_cap=4.0)
        expected = kp.ragged_paged_attention_reference(
            q, pool.k, pool.v, pool.block_tables, pool.context_lens, query_start_loc, **knobs)
        k, v = poison_outside_windows(pool, first_new, window)
        out = kp.ragged_paged_attention(
            q, k, v, pool.block_tables, pool.context_lens, query_start_loc,
            implementation=implementation, interpret=interpret, block_q=block_q,
            num_kv_splits=splits, **knobs)
        assert_close(out, expected, F32)
        expected = kp.paged_decode_attention_reference(
            decode_q, pool.k, pool.v, pool.block_tables, pool.context_lens, **knobs)
        k, v = poison_outside_windows(pool, last, window)
        out = kp.paged_decode_attention(
            decode_q, k, v, pool.block_tables, pool.context_lens,
            implementation=implementation, interpret=interpret, num_kv_splits=splits, **knobs)
        assert_close(out, expected, F32)


def test_the_window_is_traced_so_one_compile_serves_every_window(batch):
    """A scanned model gives each layer its own window: a traced value, not a static one."""
    pool, q, query_start_loc = batch
    compiled = jax.jit(lambda window: kp.ragged_paged_attention(
        q, pool.k, pool.v, pool.block_tables, pool.context_lens, query_start_loc,
        sliding_window=window, implementation="xla")).lower(jnp.int32(0)).compile()
    for window in WINDOWS:
        assert_close(compiled(jnp.int32(window)), kp.ragged_paged_attention_reference(
            q, pool.k, pool.v, pool.block_tables, pool.context_lens, query_start_loc,
            sliding_window=window), F32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_window_visits_only_the_chunks_holding_visible_keys(num_splits):
    """The kernels' loop bounds: the chunks of keys [first_visible_key, kv_len), dealt to the
    splits without overlap, so a windowed read's work follows min(context, W)."""
    from kernels_pallas import online_softmax

    chunk = 16
    for first_pos, window, kv_len in [(0, 1000, 1), (40, 5, 41), (100, 16, 110), (99, 1, 100),
                                      (7, 8, 30), (200, 2**31 - 1, 250)]:
        kv_first = int(online_softmax.first_visible_key(jnp.int32(first_pos), jnp.int32(window)))
        assert kv_first == max(first_pos - window + 1, 0)
        visited = []
        for split in range(num_splits):
            first, last = online_softmax.split_chunk_range(
                jnp.int32(kv_first), jnp.int32(kv_len), jnp.int32(split), num_splits, chunk)
            visited += range(int(first), int(last))
        needed = sorted({position // chunk for position in range(kv_first, kv_len)})
        assert visited == needed, (first_pos, window, kv_len)
