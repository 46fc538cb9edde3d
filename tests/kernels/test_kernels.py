"""Paged-attention kernels in plain interpret mode (compiled under JPAGED_TEST_COMPILED=1,
see tests/plugins/kernels.py) against the pure-JAX reference.

Every kernel run reads a NaN-poisoned pool (every slot that no sequence owns,
the null block included, is NaN) while the reference reads the clean pool, so
each case checks both the maths and that nothing outside a sequence's own
slots is read. The cases cover the issue's sweep (dtype, block size, GQA ratio,
head_dim, ragged lengths, key splits) without taking their full product: each
parametrization is a separate compilation.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import kernels_pallas as kp
from kernels_pallas import tiles
from kernels_pallas.attention import _default_block_q
from tests.plugins.kernels import kernel_interpret

F32, BF16 = jnp.float32, jnp.bfloat16

@dataclass(frozen=True)
class PagedPool:
    """A pool and the tables of a batch that lives in it.

    k, v:         [Hkv, num_blocks, block_size, D] in the test dtype
    k_nan, v_nan: the same with every slot no sequence owns set to NaN
    block_tables: int32 [B, max_blocks], distinct random blocks, padding 0
    context_lens: int32 [B]
    """

    k: jax.Array
    v: jax.Array
    k_nan: jax.Array
    v_nan: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array

def make_pool(rng, context_lens, *, num_kv_heads, head_dim, block_size, dtype) -> PagedPool:
    """Each sequence's blocks come from a random permutation of blocks 1..N-1; a few
    blocks stay free and every table row has at least one padding column."""
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(blocks_needed) + 3
    tables = np.zeros((len(context_lens), max(blocks_needed) + 1), np.int32)
    owned = np.zeros((num_blocks, block_size), bool)
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    for row, (length, count) in enumerate(zip(context_lens, blocks_needed, strict=True)):
        for logical in range(count):
            block = next(free)
            tables[row, logical] = block
            used = min(block_size, length - logical * block_size)
            owned[block, :used] = True
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    unowned = ~owned[None, :, :, None]
    return PagedPool(
        k=jnp.asarray(k, dtype),
        v=jnp.asarray(v, dtype),
        k_nan=jnp.asarray(np.where(unowned, np.nan, k), dtype),
        v_nan=jnp.asarray(np.where(unowned, np.nan, v), dtype),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(np.asarray(context_lens, np.int32)),
    )

def tolerance(dtype) -> float:
    """Max abs error against the f32 reference: 1e-5 in f32, 2e-2 in bf16."""
    return 1e-5 if jnp.dtype(dtype) == F32 else 2e-2

def assert_close(out, expected, dtype):
    out = np.asarray(out.astype(F32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(expected), atol=tolerance(dtype), rtol=0)

def decode_lengths(block_size: int) -> list[int]:
    """Padding row, one token, exactly one block, a non-multiple, several chunks."""
    return [0, 1, block_size, 2 * block_size + 3, 3 * block_size + 150]

def f32(x):
    return x.astype(F32)

# (implementation, dtype, block_size, gqa ratio, num_kv_heads, head_dim, key splits,
#  pages per chunk); None picks the op's default.
DECODE_CASES = [
    ("triton", F32, 1, 1, 2, 64, None, None),
    ("triton", BF16, 1, 4, 1, 128, 1, 32),
    ("triton", F32, 8, 3, 2, 128, None, None),
    ("triton", BF16, 8, 8, 1, 64, None, 2),
    ("triton", F32, 16, 8, 2, 128, 1, 1),
    ("triton", BF16, 16, 1, 2, 64, None, None),
    ("triton", F32, 32, 4, 1, 64, None, None),
    ("triton", BF16, 32, 3, 2, 128, 1, 4),
    ("triton", F32, 64, 3, 1, 64, None, 1),
    ("triton", BF16, 64, 1, 2, 128, None, None),
    ("triton", F32, 128, 8, 1, 128, None, None),
    ("triton", BF16, 128, 4, 2, 64, 1, 1),
    ("tpu", F32, 8, 1, 2, 128, None, 2),
    ("tpu", BF16, 16, 3, 1, 64, 2, None),
    ("tpu", F32, 32, 4, 2, 64, None, 2),
    ("tpu", BF16, 64, 8, 1, 128, None, 1),
    ("tpu", F32, 128, 3, 1, 128, 2, None),
    ("tpu", BF16, 128, 1, 2, 64, None, 1),
    ("xla", F32, 1, 4, 1, 64, None, 4),
    ("xla", BF16, 8, 3, 2, 128, None, None),
    ("xla", F32, 16, 8, 2, 64, None, 1),
    ("xla", BF16, 64, 1, 1, 128, None, None),
    ("xla", F32, 128, 3, 2, 128, None, None),
]

@pytest.mark.parametrize(
    "implementation,dtype,block_size,group,num_kv_heads,head_dim,splits,pages_per_chunk",
    DECODE_CASES,
)
def test_decode_matches_reference(
    implementation, dtype, block_size, group, num_kv_heads, head_dim, splits, pages_per_chunk
):
    rng = np.random.default_rng(block_size * 31 + group * 7 + head_dim)
    pool = make_pool(
        rng,
        decode_lengths(block_size),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    batch = len(decode_lengths(block_size))
    q = jnp.asarray(rng.standard_normal((batch, num_kv_heads * group, head_dim)), dtype)
    expected = kp.paged_decode_attention_reference(
        f32(q), f32(pool.k), f32(pool.v), pool.block_tables, pool.context_lens
    )
    out = kp.paged_decode_attention(
        q,
        pool.k_nan,
        pool.v_nan,
        pool.block_tables,
        pool.context_lens,
        implementation=implementation,
        interpret=kernel_interpret(implementation),
        num_kv_splits=splits,
        pages_per_chunk=pages_per_chunk,
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype)

@dataclass(frozen=True)
class RaggedBatch:
    """Per sequence (cached prefix, new tokens), plus padding tokens at the end."""

    prefix_and_new: tuple[tuple[int, int], ...]
    padding_tokens: int

    @property
    def context_lens(self) -> list[int]:
        return [prefix + new for prefix, new in self.prefix_and_new]

    @property
    def query_start_loc(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([new for _, new in self.prefix_and_new])])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1]) + self.padding_tokens

def mixed_batch(block_size: int) -> RaggedBatch:
    """Prefill, decode, padding sequence, chunked prefill after a cached prefix,
    a one-block prefill, a one-token prompt, then padding tokens."""
    return RaggedBatch(
        prefix_and_new=(
            (0, 37),
            (2 * block_size + 5, 1),
            (0, 0),
            (block_size + 3, 19),
            (0, block_size),
            (0, 1),
        ),
        padding_tokens=3,
    )

# (implementation, dtype, block_size, gqa ratio, num_kv_heads, head_dim, block_q, splits)
RAGGED_CASES = [
    ("triton", F32, 1, 4, 1, 64, 4, 1),
    ("triton", BF16, 1, 1, 2, 128, None, 1),
    ("triton", F32, 8, 1, 2, 128, 8, 2),
    ("triton", BF16, 8, 3, 1, 64, None, 1),
    ("triton", F32, 16, 3, 2, 64, 16, 1),
    ("triton", BF16, 16, 8, 1, 128, None, 2),
    ("triton", F32, 32, 8, 2, 64, 2, 1),
    ("triton", BF16, 64, 4, 1, 64, None, 1),
    ("triton", F32, 128, 1, 1, 128, None, 1),
    ("tpu", F32, 8, 4, 2, 128, None, 1),
    ("tpu", BF16, 16, 8, 1, 64, 4, 1),
    ("tpu", F32, 32, 1, 2, 64, 8, 2),
    ("tpu", BF16, 64, 3, 1, 128, None, 1),
    ("tpu", F32, 128, 3, 2, 64, None, 1),
    ("xla", F32, 1, 4, 1, 64, 4, 1),
    ("xla", BF16, 8, 3, 2, 128, None, 1),
    ("xla", F32, 16, 8, 1, 64, 16, 1),
    ("xla", BF16, 32, 1, 2, 128, 2, 1),
    ("xla", F32, 128, 3, 2, 64, None, 1),
    ("xla", F32, 16, 3, 1, 64, 1, 1),
    ("xla", F32, 8, 3, 2, 64, 8, 1),
]

@pytest.mark.parametrize(
    "implementation,dtype,block_size,group,num_kv_heads,head_dim,block_q,splits", RAGGED_CASES
)
def test_ragged_matches_reference(
    implementation, dtype, block_size, group, num_kv_heads, head_dim, block_q, splits
):
    rng = np.random.default_rng(block_size * 17 + group * 5 + head_dim)
    batch = mixed_batch(block_size)
    pool = make_pool(
        rng,
        batch.context_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, num_kv_heads * group, head_dim)), dtype)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    expected = kp.ragged_paged_attention_reference(
        f32(q), f32(pool.k), f32(pool.v), pool.block_tables, pool.context_lens, query_start_loc
    )
    out = kp.ragged_paged_attention(
        q,
        pool.k_nan,
        pool.v_nan,
        pool.block_tables,
        pool.context_lens,
        query_start_loc,
        implementation=implementation,
        interpret=kernel_interpret(implementation),
        block_q=block_q,
        num_kv_splits=splits,
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype)
    assert not np.asarray(out[-batch.padding_tokens :].astype(F32)).any()

def as_bits(pages: jax.Array) -> kp.EncodedPages:
    """Plain 2-byte float pages as the engine stores them: their bits."""
    return kp.EncodedPages(jax.lax.bitcast_convert_type(pages, jnp.uint16), None, pages.dtype)


@pytest.mark.parametrize("stored", [lambda pages: pages, as_bits], ids=["plain", "bits"])
@pytest.mark.parametrize("implementation", ["reference", "xla", "triton", "tpu"])
@pytest.mark.parametrize("q_dtype", [F32, BF16])
def test_bfloat16_pages_plain_or_as_bits(implementation, stored, q_dtype):
    """A bfloat16 cache, as an array or stored as its bits, under bfloat16 or float32
    queries: every backend against the float32 reference on the same pool widened
    (NaN-poisoned free slots included)."""
    rng = np.random.default_rng(12)
    batch = mixed_batch(16)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=BF16)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 64)), q_dtype)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    expected = kp.ragged_paged_attention_reference(
        f32(q), f32(pool.k), f32(pool.v), pool.block_tables, pool.context_lens,
        query_start_loc)
    out = kp.ragged_paged_attention(
        q, stored(pool.k_nan), stored(pool.v_nan), pool.block_tables, pool.context_lens,
        query_start_loc, implementation=implementation,
        interpret=kernel_interpret(implementation))
    assert out.dtype == q_dtype
    assert_close(out, expected, q_dtype)

@pytest.mark.parametrize("implementation", ["triton", "tpu", "xla"])
@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_scale_and_soft_cap(implementation, op):
    rng = np.random.default_rng(3)
    batch = mixed_batch(8)
    lengths = batch.context_lens if op == "ragged" else decode_lengths(8)
    pool = make_pool(rng, lengths, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    num_tokens = batch.num_tokens if op == "ragged" else len(lengths)
    # Large queries push the scores past the cap, so the cap changes the result.
    q = jnp.asarray(4.0 * rng.standard_normal((num_tokens, 4, 64)), F32)
    knobs = dict(scale=0.3, soft_cap=5.0)
    if op == "ragged":
        extra = (jnp.asarray(batch.query_start_loc, jnp.int32),)
        reference, kernel = kp.ragged_paged_attention_reference, kp.ragged_paged_attention
    else:
        extra = ()
        reference, kernel = kp.paged_decode_attention_reference, kp.paged_decode_attention
    tables = (pool.block_tables, pool.context_lens, *extra)
    expected = reference(q, pool.k, pool.v, *tables, **knobs)
    uncapped = reference(q, pool.k, pool.v, *tables, scale=0.3)
    assert np.abs(np.asarray(expected - uncapped)).max() > 1e-2
    out = kernel(
        q, pool.k_nan, pool.v_nan, *tables, implementation=implementation,
        interpret=kernel_interpret(implementation), **knobs
    )
    assert_close(out, expected, F32)

@pytest.mark.parametrize("implementation", ["reference", "triton", "tpu", "xla"])
def test_nan_poisoned_pool_changes_nothing(implementation):
    """Filling every unowned slot with NaN leaves the outputs finite and bit-identical."""
    rng = np.random.default_rng(11)
    batch = mixed_batch(16)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=F32)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 64)), F32)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    decode_q = q[: len(batch.context_lens)]
    for k, v in ((pool.k, pool.v), (pool.k_nan, pool.v_nan)):
        kwargs = dict(implementation=implementation,
                      interpret=implementation in ("triton", "tpu")
                      and kernel_interpret(implementation))
        ragged = kp.ragged_paged_attention(
            q, k, v, pool.block_tables, pool.context_lens, query_start_loc, **kwargs
        )
        decode = kp.paged_decode_attention(
            decode_q, k, v, pool.block_tables, pool.context_lens, **kwargs
        )
        if k is pool.k:
            clean_ragged, clean_decode = ragged, decode
    assert np.isfinite(np.asarray(ragged)).all() and np.isfinite(np.asarray(decode)).all()
    np.testing.assert_array_equal(np.asarray(ragged), np.asarray(clean_ragged))
    np.testing.assert_array_equal(np.asarray(decode), np.asarray(clean_decode))

def _stack_layers(pool_cache: jax.Array, layer: int, num_layers: int) -> jax.Array:
    """[L, Hkv, N, bs, D] with pool_cache as layer `layer` and NaN in every other layer."""
    nan = jnp.full_like(pool_cache, jnp.nan)
    return jnp.stack([pool_cache if i == layer else nan for i in range(num_layers)])

@pytest.mark.parametrize("implementation", ["reference", "triton", "tpu", "xla"])
def test_stacked_cache_reads_only_the_given_layer(implementation):
    """A stacked [layers, ...] cache, every other layer NaN, the layer a traced value:
    both ops equal the reference on that layer's own one-layer pool."""
    rng = np.random.default_rng(12)
    batch = mixed_batch(16)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=F32)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 64)), F32)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    decode_q = q[: len(batch.context_lens)]
    layer = 2
    k_stack, v_stack = (_stack_layers(c, layer, 3) for c in (pool.k_nan, pool.v_nan))
    knobs = dict(implementation=implementation,
                 interpret=implementation not in ("reference", "xla"))
    ragged = jax.jit(functools.partial(kp.ragged_paged_attention, **knobs))(
        q, k_stack, v_stack, pool.block_tables, pool.context_lens, query_start_loc,
        layer=jnp.int32(layer),
    )
    decode = jax.jit(functools.partial(kp.paged_decode_attention, **knobs))(
        decode_q, k_stack, v_stack, pool.block_tables, pool.context_lens, layer=jnp.int32(layer)
    )
    assert_close(ragged, kp.ragged_paged_attention_reference(
        q, pool.k, pool.v, pool.block_tables, pool.context_lens, query_start_loc), F32)
    assert_close(decode, kp.paged_decode_attention_reference(
        decode_q, pool.k, pool.v, pool.block_tables, pool.context_lens), F32)

def test_reference_agrees_with_dense_attention():
    """The reference itself against attention written out on contiguous K/V in numpy."""
    rng = np.random.default_rng(5)
    batch = mixed_batch(4)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=8, block_size=4, dtype=F32)
    q = rng.standard_normal((batch.num_tokens, 6, 8)).astype(np.float32)
    out = kp.ragged_paged_attention_reference(
        jnp.asarray(q),
        pool.k,
        pool.v,
        pool.block_tables,
        pool.context_lens,
        jnp.asarray(batch.query_start_loc, jnp.int32),
    )
    k_pool, v_pool, tables = np.asarray(pool.k), np.asarray(pool.v), np.asarray(pool.block_tables)
    expected = np.zeros_like(q)
    starts = batch.query_start_loc
    for seq, length in enumerate(batch.context_lens):
        k_seq = k_pool[:, tables[seq]].reshape(2, -1, 8)[:, :length]
        v_seq = v_pool[:, tables[seq]].reshape(2, -1, 8)[:, :length]
        q_len = starts[seq + 1] - starts[seq]
        for i in range(q_len):
            pos = length - q_len + i
            for head in range(6):
                kv = head // 3
                scores = k_seq[kv, : pos + 1] @ q[starts[seq] + i, head] / np.sqrt(8)
                probs = np.exp(scores - scores.max())
                expected[starts[seq] + i, head] = probs @ v_seq[kv, : pos + 1] / probs.sum()
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)

@pytest.mark.parametrize("block_q", [1, 2, 8])
def test_ragged_tiles_cover_every_token_once(block_q):
    """Tile metadata against a brute-force walk over the sequences."""
    rng = np.random.default_rng(block_q)
    q_lens = rng.integers(0, 12, size=9)
    q_lens[[1, 4]] = 0
    prefixes = rng.integers(0, 20, size=9)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(starts[-1]) + 5
    found = tiles.ragged_tiles(
        jnp.asarray(prefixes + q_lens, jnp.int32), jnp.asarray(starts), num_tokens, block_q
    )
    covered = {}
    for seq, first_pos, count, first_token in zip(
        *(np.asarray(a) for a in (found.seq, found.first_pos, found.num_tokens, found.first_token)),
        strict=True,
    ):
        for j in range(count):
            covered[first_token + j] = (seq, first_pos + j)
    expected = {
        int(starts[s] + i): (s, int(prefixes[s] + i)) for s in range(9) for i in range(q_lens[s])
    }
    assert covered == expected

def test_xla_work_list_matches_reference():
    """Many tiles of skewed lengths, padding among them, one page per loop step: the
    XLA loop's groups of sorted tiles each run to their own longest tile, over
    several steps, and every tile still sees exactly its own keys."""
    rng = np.random.default_rng(5)
    prefixes = np.minimum(rng.lognormal(3.0, 1.0, 37).astype(int), 300)
    new = rng.integers(1, 4, 37)
    new[rng.permutation(37)[:6]] = 0
    batch = RaggedBatch(tuple(zip(prefixes.tolist(), new.tolist(), strict=True)), padding_tokens=5)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=64, block_size=8, dtype=F32)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 64)), F32)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    tables = (pool.block_tables, pool.context_lens)
    expected = kp.ragged_paged_attention_reference(q, pool.k, pool.v, *tables, query_start_loc)
    out = kp.ragged_paged_attention(q, pool.k_nan, pool.v_nan, *tables, query_start_loc,
                                    implementation="xla", pages_per_chunk=1)
    assert_close(out, expected, F32)
    decode_q = q[:37]
    expected = kp.paged_decode_attention_reference(decode_q, pool.k, pool.v, *tables)
    out = kp.paged_decode_attention(decode_q, pool.k_nan, pool.v_nan, *tables,
                                    implementation="xla", pages_per_chunk=1)
    assert_close(out, expected, F32)

@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("long_step", [True, False])
def test_xla_long_chunks_beside_decode_rows_match_reference(window, long_step):
    """The XLA loop's default tiling of a mixed step: prefill chunks of XLA_LONG_QUERY
    tokens or more (one after a cached prefix, one fresh, one exactly at the limit) in
    large tiles, decode rows and a short chunk in small ones, with padding sequences
    and tokens, a sliding window and a soft cap; in a step of fewer than
    XLA_LONG_STEP_TOKENS tokens, a long chunk beside a decode row in small tiles."""
    rng = np.random.default_rng(11)
    long = kp.attention.XLA_LONG_QUERY
    rows = ((300, long + 2), (17, 1), (0, 0), (0, 200), (5, long - 1), (90, 1), (0, long),
            (0, 0))
    batch = RaggedBatch(rows if long_step else rows[:3], padding_tokens=7)
    assert (batch.num_tokens >= kp.attention.XLA_LONG_STEP_TOKENS) == long_step
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=32, block_size=16,
                     dtype=F32)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 32)), F32)
    tables = (pool.block_tables, pool.context_lens,
              jnp.asarray(batch.query_start_loc, jnp.int32))
    knobs = dict(sliding_window=window, soft_cap=20.0)
    expected = kp.ragged_paged_attention_reference(q, pool.k, pool.v, *tables, **knobs)
    out = kp.ragged_paged_attention(q, pool.k_nan, pool.v_nan, *tables,
                                    implementation="xla", **knobs)
    assert_close(out, expected, F32)
    assert not np.asarray(out[-batch.padding_tokens:]).any()


def test_xla_tile_size_follows_the_mix():
    """On CPU, decode-heavy steps get small query tiles, prefill-heavy ones the largest."""
    # 64 sequences in 80 tokens: mostly decodes, a 64-row tile each would be wasted.
    assert _default_block_q("xla", 3, 80, 64) <= 2
    # One long prompt: the largest tile, as the GPU kernel takes.
    assert _default_block_q("xla", 3, 256, 1) == _default_block_q("triton", 3, 256, 1) == 16
    assert _default_block_q("triton", 3, 80, 64) == 16

def test_default_implementation_follows_the_backend():
    # The Mosaic kernel on TPUs, the Triton kernel on GPUs (and whenever a kernel is
    # interpreted elsewhere), the XLA loop on CPUs.
    native = {"tpu": "tpu", "gpu": "triton", "cpu": "xla"}[jax.default_backend()]
    interpreted = "triton" if native == "xla" else native
    assert kp.default_implementation(False) == native
    assert kp.default_implementation(True) == interpreted
    assert kp.default_implementation(pltpu.InterpretParams()) == "tpu"

WITHOUT_TRITON = """
import sys

class NoTriton:
    def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ImportError("this jax has no Triton backend")

sys.meta_path.insert(0, NoTriton())
import jax.numpy as jnp
import kernels_pallas as kp

q, cache = jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16, 16))
args = (q, cache, cache, jnp.array([[1]], jnp.int32), jnp.array([5], jnp.int32))
assert kp.paged_decode_attention(*args, implementation="xla").shape == q.shape
try:
    kp.paged_decode_attention(*args, implementation="triton", interpret=True)
except ImportError as error:
    print(error)
"""

def test_kernels_import_without_the_triton_backend():
    # JAX deprecates its Triton backend from 0.11: the other kernels must still load and
    # run, and the Triton kernel fail on use (the engine then falls back to "xla").
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "this jax has no Triton backend" in result.stdout

def _decode_args(dtype=F32, block_size=8, num_q_heads=4):
    pool = make_pool(
        np.random.default_rng(0),
        [5, 9],
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
    )
    q = jnp.zeros((2, num_q_heads, 64), dtype)
    return q, pool.k, pool.v, pool.block_tables, pool.context_lens

@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q_dtype=BF16), TypeError, "at least as wide as unquantized caches"),
        (dict(num_q_heads=3), ValueError, "multiple of num_kv_heads"),
        (dict(implementation="cuda"), ValueError, "implementation must be one of"),
        (dict(implementation="tpu", block_size=4), ValueError, "multiple of 8 for float32"),
        (dict(implementation="triton", block_size=12), ValueError, "power of two"),
        (dict(implementation="triton", pages_per_chunk=1), ValueError, ">= 16"),
        (dict(implementation="triton", block_size=128, pages_per_chunk=4), ValueError, "65536"),
        (dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
    ],
)
def test_decode_rejects_bad_arguments(change, error, match):
    q, k, v, tables, lens = _decode_args(
        block_size=change.pop("block_size", 8), num_q_heads=change.pop("num_q_heads", 4)
    )
    q = q.astype(change.pop("q_dtype", F32))
    with pytest.raises(error, match=match):
        kp.paged_decode_attention(q, k, v, tables, lens, interpret=True, **change)

def test_ragged_rejects_bad_query_start_loc():
    q, k, v, tables, lens = _decode_args()
    with pytest.raises(ValueError, match=r"query_start_loc must be \[B \+ 1\]"):
        kp.ragged_paged_attention(q, k, v, tables, lens, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        kp.ragged_paged_attention(
            q, k, v, tables, lens, jnp.array([0, 1, 2], jnp.int32), interpret=True, block_q=3
        )

def test_write_kv_matches_slot_by_slot_writes():
    rng = np.random.default_rng(2)
    num_kv_heads, num_blocks, block_size, head_dim = 2, 6, 4, 8
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    # Real tokens in scattered slots, then padding tokens on the null block.
    slots = np.array([9, 22, 3 * 4 + 1, 20, 0, 1, 2], np.int32)
    k = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for token, slot in enumerate(slots):
        block, offset = divmod(int(slot), block_size)
        expected_k[:, block, offset] = k[token]
        expected_v[:, block, offset] = v[token]
    new_k, new_v = kp.write_kv(
        jnp.asarray(k_cache, BF16),
        jnp.asarray(v_cache, BF16),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(slots),
    )
    assert new_k.dtype == BF16
    np.testing.assert_array_equal(
        np.asarray(f32(new_k)), np.asarray(f32(jnp.asarray(expected_k, BF16)))
    )
    np.testing.assert_array_equal(
        np.asarray(f32(new_v)), np.asarray(f32(jnp.asarray(expected_v, BF16)))
    )

@pytest.mark.parametrize("slots", [[13], [8, 9, 39]])
def test_write_kv_updates_a_donated_cache_in_place(slots):
    """One token (XLA's dynamic-update-slice path) and several (scatter) alike."""
    shape = (2, 5, 8, 16)
    k_cache, v_cache = jnp.zeros(shape), jnp.zeros(shape)
    k_pointer, v_pointer = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
    new = jnp.ones((len(slots), 2, 16))
    write = jax.jit(kp.write_kv, donate_argnums=(0, 1))
    new_k, new_v = write(k_cache, v_cache, new, new, jnp.array(slots, jnp.int32))
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert new_k.unsafe_buffer_pointer() == k_pointer
    assert new_v.unsafe_buffer_pointer() == v_pointer
    assert float(new_k.sum()) == len(slots) * 2 * 16

@pytest.mark.parametrize("slots", [[13], [8, 9, 39]])
def test_write_kv_writes_one_layer_of_a_stacked_cache_in_place(slots):
    """numpy writes slot by slot into layer 1 of 3 as the oracle; the donated buffers
    are reused."""
    rng = np.random.default_rng(3)
    num_layers, layer, block_size = 3, 1, 8
    shape = (num_layers, 2, 5, block_size, 16)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((len(slots), 2, 16)).astype(np.float32) for _ in range(2))
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for token, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        expected_k[layer, :, block, offset] = k[token]
        expected_v[layer, :, block, offset] = v[token]
    device_k, device_v = jnp.asarray(k_cache), jnp.asarray(v_cache)
    pointers = device_k.unsafe_buffer_pointer(), device_v.unsafe_buffer_pointer()
    write = jax.jit(kp.write_kv, donate_argnums=(0, 1))
    new_k, new_v = write(device_k, device_v, jnp.asarray(k), jnp.asarray(v),
                         jnp.array(slots, jnp.int32), jnp.int32(layer))
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    np.testing.assert_array_equal(np.asarray(new_k), expected_k)
    np.testing.assert_array_equal(np.asarray(new_v), expected_v)

def test_cache_rank_must_match_the_layer_argument():
    one_layer, stacked = jnp.zeros((2, 5, 8, 16)), jnp.zeros((3, 2, 5, 8, 16))
    new, slots = jnp.zeros((1, 2, 16)), jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match=r"must both be \[num_layers, num_kv_heads"):
        kp.write_kv(one_layer, one_layer, new, new, slots, jnp.int32(0))
    with pytest.raises(ValueError, match=r"must both be \[num_kv_heads"):
        kp.write_kv(stacked, stacked, new, new, slots)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        kp.write_kv(stacked, stacked, new, new, slots, jnp.zeros(2, jnp.int32))
    q, tables, lens = jnp.zeros((1, 4, 16)), jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32)
    with pytest.raises(ValueError, match=r"must both be \[num_layers, num_kv_heads"):
        kp.paged_decode_attention(q, one_layer, one_layer, tables, lens, layer=jnp.int32(0))

def test_write_kv_rejects_mismatched_shapes():
    cache = jnp.zeros((2, 5, 8, 16))
    with pytest.raises(ValueError, match="k and v must be"):
        kp.write_kv(
            cache, cache, jnp.zeros((3, 1, 16)), jnp.zeros((3, 1, 16)), jnp.zeros(3, jnp.int32)
        )
    with pytest.raises(TypeError, match="slot_mapping must be int32"):
        kp.write_kv(cache, cache, jnp.zeros((3, 2, 16)), jnp.zeros((3, 2, 16)), jnp.zeros(3))

@pytest.mark.parametrize("implementation", ["triton", "tpu"])
def test_step_with_donated_cache_writes_then_attends(implementation):
    """The runner's pattern: one jitted step, cache donated, write K/V then attend."""
    interpret = kernel_interpret(implementation)
    rng = np.random.default_rng(8)
    block_size, num_kv_heads, head_dim = 8, 2, 64
    prefixes, new_tokens = [11, 0, 3], [1, 6, 9]
    lengths = [p + n for p, n in zip(prefixes, new_tokens, strict=True)]
    pool = make_pool(
        rng,
        lengths,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=F32,
    )
    tables = np.asarray(pool.block_tables)
    slots = [
        tables[seq, pos // block_size] * block_size + pos % block_size
        for seq, (prefix, count) in enumerate(zip(prefixes, new_tokens, strict=True))
        for pos in range(prefix, prefix + count)
    ]
    num_tokens = len(slots) + 2
    slot_mapping = jnp.asarray(slots + [0, 1], jnp.int32)
    query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(new_tokens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((num_tokens, 4, head_dim)), F32)
    k_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), F32)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), F32)

    expected_k, expected_v = np.asarray(pool.k).copy(), np.asarray(pool.v).copy()
    for token, slot in enumerate(slots):
        expected_k[:, slot // block_size, slot % block_size] = np.asarray(k_new[token])
        expected_v[:, slot // block_size, slot % block_size] = np.asarray(v_new[token])
    expected = kp.ragged_paged_attention_reference(
        q,
        jnp.asarray(expected_k),
        jnp.asarray(expected_v),
        pool.block_tables,
        pool.context_lens,
        query_start_loc,
    )

    def step(k_cache, v_cache):
        k_cache, v_cache = kp.write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
        out = kp.ragged_paged_attention(
            q,
            k_cache,
            v_cache,
            pool.block_tables,
            pool.context_lens,
            query_start_loc,
            implementation=implementation,
            interpret=interpret,
        )
        return out, k_cache, v_cache

    step = jax.jit(step, donate_argnums=(0, 1))
    out, _, _ = step(jnp.array(pool.k_nan), jnp.array(pool.v_nan))
    assert_close(out, expected, F32)
