"""The Mosaic GPU kernel in Mosaic GPU interpret mode on the CPU (jax >= 0.12), with
the race detector on, against a float64 numpy definition of attention.

Every run reads a NaN-poisoned pool (tests/kernels/test_kernels.py: every slot no
sequence owns, the null block included) while numpy reads the clean one, so each
case checks the maths, that no NaN reaches the output, and that no thread races
another or the TMA copies (a race raises). Interpret mode runs every CUDA block of
the grid one after the other on the CPU, so shapes stay small; the fast tier has one
case of each op, the full tier the sweep (block sizes 16 to 128, GQA ratios, head
dims, key splits, windows, soft caps). Under JPAGED_TEST_COMPILED=1 on a Hopper GPU
the same cases compile the kernel instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import kernels_pallas as kp
from kernels_pallas.quantization import is_quantized
from tests.kernels.test_kernels import PagedPool, RaggedBatch, make_pool, mixed_batch
from tests.kernels.test_quantized_kv import quantized_pool
from tests.plugins.kernels import kernel_interpret

pytestmark = pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode (jax >= 0.12 has)")

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
INT8, E4M3, E5M2 = jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2
# Max abs error against float64, by the dtype of the products' operands: the queries,
# P and the outputs are rounded to it (quantized pages' values are exact in it, and
# numpy reads the same quantized values).
TOLERANCE = {jnp.dtype(F16): 4e-3, jnp.dtype(BF16): 2e-2}


def interpret_params():
    """The ops' interpret= for this kernel: GPU interpret mode with the race detector,
    or False when the kernels compile (JPAGED_TEST_COMPILED=1 on a Hopper GPU)."""
    if not kernel_interpret("mosaic_gpu"):
        return False
    return plgpu.InterpretGPUParams(detect_races=True)


def numpy_ragged_attention(q, pool, context_lens, query_start_loc, *, window=None,
                           soft_cap=None, scale=None):
    """Causal attention of every new token over its sequence's clean pages, float64.

    q [T, Hq, D]; pool: test_kernels.PagedPool; returns [T, Hq, D] (0 for tokens no
    sequence owns)."""
    q = np.asarray(q, np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    k_pool, v_pool = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (pool.k, pool.v))
    num_kv_heads, block_size = k_pool.shape[0], k_pool.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = np.zeros_like(q)
    tables = np.asarray(pool.block_tables)
    for row, length in enumerate(np.asarray(context_lens)):
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        if end == start:
            continue
        pages = tables[row, : -(-length // block_size)]
        k = k_pool[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :length]
        v = v_pool[:, pages].reshape(num_kv_heads, -1, head_dim)[:, :length]
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [Hq, S, D]
        positions = length - (end - start) + np.arange(end - start)
        scores = np.einsum("thd,hsd->hts", q[start:end], k) * scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        key_pos = np.arange(length)[None, :]
        visible = key_pos <= positions[:, None]
        if window is not None:
            visible &= key_pos > positions[:, None] - window
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[start:end] = np.einsum("hts,hsd->thd", probs, v)
    return out


def pool_and_caches(rng, lengths, *, num_kv_heads, head_dim, block_size, dtype):
    """(the clean pool numpy reads, the NaN-poisoned K and V caches the kernel reads).

    Quantized dtypes: the caches are EncodedPages with NaN scales (and NaN fp8 values)
    in every slot no sequence owns, and numpy reads their owned values times their
    scales in float64."""
    if not is_quantized(dtype):
        pool = make_pool(rng, lengths, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size, dtype=dtype)
        return pool, pool.k_nan, pool.v_nan
    pool = make_pool(rng, lengths, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=F32)
    clean = [np.asarray(pages.values).view(jnp.dtype(dtype)).astype(np.float64)
             * np.asarray(pages.scales, np.float64)[..., None]
             for pages in quantized_pool(pool, dtype, poison=False)]
    k_nan, v_nan = quantized_pool(pool, dtype, poison=True)
    return PagedPool(*clean, None, None, pool.block_tables, pool.context_lens), k_nan, v_nan


def assert_close(out, expected, dtype):
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), "a NaN from the poisoned pool reached the output"
    np.testing.assert_allclose(out, expected, atol=TOLERANCE[jnp.dtype(dtype)], rtol=0)


def run_decode(dtype, block_size, group, num_kv_heads, head_dim, lengths, *, splits=None,
               window=None, soft_cap=None, seed=0, q_dtype=None):
    """dtype: the pages' (16-bit or quantized); q_dtype: the queries', dtype's if None."""
    rng = np.random.default_rng(seed)
    pool, k_cache, v_cache = pool_and_caches(rng, lengths, num_kv_heads=num_kv_heads,
                                             head_dim=head_dim, block_size=block_size,
                                             dtype=dtype)
    q_dtype = q_dtype or dtype
    q = jnp.asarray(rng.standard_normal((len(lengths), num_kv_heads * group, head_dim)), q_dtype)
    out = kp.paged_decode_attention(
        q, k_cache, v_cache, pool.block_tables, pool.context_lens,
        sliding_window=window, soft_cap=soft_cap, implementation="mosaic_gpu",
        interpret=interpret_params(), num_kv_splits=splits)
    starts = np.concatenate([[0], np.cumsum(np.asarray(lengths) > 0)])
    # Decode rows are ragged rows of one token (none for a padding row).
    expected = numpy_ragged_attention(q[np.asarray(lengths) > 0], pool, pool.context_lens,
                                      starts, window=window, soft_cap=soft_cap)
    full = np.zeros(q.shape)
    full[np.asarray(lengths) > 0] = expected
    assert out.shape == q.shape and out.dtype == q_dtype
    assert_close(out, full, kp.mosaic_gpu_attention.compute_dtype(q_dtype, dtype))


def run_ragged(dtype, block_size, group, num_kv_heads, head_dim, batch: RaggedBatch, *,
               block_q=None, splits=1, window=None, soft_cap=None, seed=0, q_dtype=None):
    """dtype: the pages' (16-bit or quantized); q_dtype: the queries', dtype's if None."""
    rng = np.random.default_rng(seed)
    pool, k_cache, v_cache = pool_and_caches(rng, batch.context_lens,
                                             num_kv_heads=num_kv_heads, head_dim=head_dim,
                                             block_size=block_size, dtype=dtype)
    q_dtype = q_dtype or dtype
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, num_kv_heads * group, head_dim)),
                    q_dtype)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    out = kp.ragged_paged_attention(
        q, k_cache, v_cache, pool.block_tables, pool.context_lens, query_start_loc,
        sliding_window=window, soft_cap=soft_cap, implementation="mosaic_gpu",
        interpret=interpret_params(), block_q=block_q, num_kv_splits=splits)
    expected = numpy_ragged_attention(q, pool, pool.context_lens, batch.query_start_loc,
                                      window=window, soft_cap=soft_cap)
    assert out.shape == q.shape and out.dtype == q_dtype
    assert_close(out, expected, kp.mosaic_gpu_attention.compute_dtype(q_dtype, dtype))


def test_decode_gqa_key_splits():
    """Padding row, one token, one page, a partial page, contexts over several chunks
    and both key splits; four query heads packed into one 64-row tile; float32 queries
    (the engine's), rounded to the pages' bfloat16 for the products."""
    run_decode(BF16, 16, 4, 1, 64, [0, 1, 16, 35, 200], splits=2, q_dtype=jnp.float32)


def test_ragged_mixed_batch_window_soft_cap():
    """Prefill, decode, an empty sequence, a chunked prefill after a cached prefix, a
    one-page prompt, a one-token prompt and padding tokens, two KV heads, with a window
    that ends between pages and a soft cap."""
    run_ragged(F16, 32, 2, 2, 64, mixed_batch(32), window=45, soft_cap=20.0)


def test_decode_int8_pages_with_float32_queries():
    """int8 pages and their per-token scales (NaN in every slot no sequence owns), float32
    queries taken as float16 for the products; a context over two chunks, key splits."""
    run_decode(INT8, 16, 4, 1, 64, [0, 3, 16, 150], splits=2, q_dtype=F32, seed=1)


def test_ragged_fp8_pages_with_bfloat16_queries():
    """e4m3 pages (NaN values and scales where no sequence owns a slot), bfloat16
    queries: fp8 reaches bfloat16 through float16 in the kernel."""
    batch = RaggedBatch(prefix_and_new=((0, 21), (40, 1), (0, 0), (19, 9)), padding_tokens=2)
    run_ragged(E4M3, 32, 2, 1, 64, batch, window=30, seed=2, q_dtype=BF16)


# (dtype, block_size, group, num_kv_heads, head_dim, splits, window, soft_cap)
DECODE_SWEEP = [
    (F16, 16, 1, 2, 128, 1, None, None),
    (BF16, 32, 8, 1, 64, 3, None, 10.0),
    (F16, 64, 3, 2, 64, None, 70, None),
    (BF16, 128, 16, 1, 128, 2, None, None),
    (F16, 16, 64, 1, 64, 1, 20, None),
    (BF16, 8, 2, 1, 128, 1, None, None),
    (INT8, 32, 4, 2, 128, 2, None, 10.0),
    (E4M3, 16, 8, 1, 64, 1, 40, None),
    (E5M2, 64, 1, 1, 128, None, None, None),
    (INT8, 128, 2, 1, 64, 1, None, None),
]
# The queries of quantized pages in the sweeps: the engine's float32.
QUANTIZED_Q_DTYPE = F32


@pytest.mark.full
@pytest.mark.parametrize("dtype,block_size,group,num_kv_heads,head_dim,splits,window,soft_cap",
                         DECODE_SWEEP)
def test_decode_sweep(dtype, block_size, group, num_kv_heads, head_dim, splits, window,
                      soft_cap):
    lengths = [0, 1, block_size, 2 * block_size + 3, 3 * block_size + 150]
    run_decode(dtype, block_size, group, num_kv_heads, head_dim, lengths, splits=splits,
               window=window, soft_cap=soft_cap, seed=block_size + group,
               q_dtype=QUANTIZED_Q_DTYPE if is_quantized(dtype) else None)


# (dtype, block_size, group, num_kv_heads, head_dim, block_q, splits, window)
RAGGED_SWEEP = [
    (BF16, 16, 1, 2, 64, None, 1, None),
    (F16, 16, 8, 1, 128, 8, 2, None),
    (BF16, 64, 3, 1, 64, 16, 1, 21),
    (F16, 128, 4, 2, 64, None, 1, 200),
    (BF16, 32, 1, 1, 128, 64, 2, None),
    (INT8, 16, 2, 2, 128, None, 2, 50),
    (E4M3, 64, 4, 1, 64, 16, 1, None),
    (E5M2, 32, 1, 1, 64, 32, 1, 21),
]


@pytest.mark.full
@pytest.mark.parametrize("dtype,block_size,group,num_kv_heads,head_dim,block_q,splits,window",
                         RAGGED_SWEEP)
def test_ragged_sweep(dtype, block_size, group, num_kv_heads, head_dim, block_q, splits,
                      window):
    batch = RaggedBatch(prefix_and_new=((0, 70), (2 * block_size + 5, 1), (0, 0),
                                        (block_size + 3, 19), (0, 1), (130, 33)),
                        padding_tokens=5)
    run_ragged(dtype, block_size, group, num_kv_heads, head_dim, batch, block_q=block_q,
               splits=splits, window=window, seed=block_size * 3 + group,
               q_dtype=QUANTIZED_Q_DTYPE if is_quantized(dtype) else None)


def test_out_of_range_table_entry_poisons_its_sequence():
    """A block-table entry past the pool (or negative) within a sequence's context turns
    that sequence's output into NaN; a TMA read there would silently give zeros. The
    pools hold no NaN, so only the kernel's check can put one there. The other sequences
    are untouched."""
    rng = np.random.default_rng(5)
    lengths = [40, 20, 33]
    pool = make_pool(rng, lengths, num_kv_heads=1, head_dim=64, block_size=16, dtype=BF16)
    num_blocks = pool.k.shape[1]
    tables = np.array(pool.block_tables)
    tables[0, 1] = num_blocks  # past the pool
    tables[2, 2] = -1
    q = jnp.asarray(rng.standard_normal((3, 2, 64)), BF16)
    out = np.asarray(kp.paged_decode_attention(
        q, pool.k, pool.v, jnp.asarray(tables), pool.context_lens,
        implementation="mosaic_gpu", interpret=interpret_params(), num_kv_splits=1
    ).astype(jnp.float32))
    assert np.isnan(out[0]).all() and np.isnan(out[2]).all()
    # Row 1 alone: its own table row is intact.
    pool_row = pool.__class__(pool.k, pool.v, pool.k_nan, pool.v_nan,
                              pool.block_tables[1:2], pool.context_lens[1:2])
    expected = numpy_ragged_attention(q[1:2], pool_row, pool.context_lens[1:2], np.array([0, 1]))
    assert_close(jnp.asarray(out[1:2]), expected, BF16)


@pytest.mark.parametrize("op,dtype", [("decode", BF16), ("ragged", BF16), ("decode", INT8),
                                      ("ragged", E4M3)])
def test_lowers_to_the_mosaic_gpu_custom_call_for_cuda(op, dtype):
    """Lowering for CUDA on the CPU runs Mosaic GPU's lowering of the whole kernel
    (layouts, TMA descriptors, wgmma shapes, the conversions Hopper has); compiling for
    sm_90a needs a GPU."""
    rng = np.random.default_rng(0)
    pool, k_cache, v_cache = pool_and_caches(rng, [5] * 4, num_kv_heads=2, head_dim=128,
                                             block_size=16, dtype=dtype)
    pages = jax.tree.map(lambda x: jnp.stack([x] * 3), k_cache)
    tables = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    knobs = dict(layer=jnp.int32(1), implementation="mosaic_gpu", sliding_window=100,
                 soft_cap=30.0)
    q_dtype = F32 if is_quantized(dtype) else dtype
    if op == "decode":
        q = jax.ShapeDtypeStruct((4, 8, 128), q_dtype)
        fn = lambda q, k, v, t, n: kp.paged_decode_attention(  # noqa: E731
            q, k, v, t, n, num_kv_splits=2, **knobs)
        args = (q, pages, pages, tables, lens)
    else:
        q = jax.ShapeDtypeStruct((96, 8, 128), q_dtype)
        starts = jax.ShapeDtypeStruct((5,), jnp.int32)
        fn = lambda q, k, v, t, n, s: kp.ragged_paged_attention(  # noqa: E731
            q, k, v, t, n, s, **knobs)
        args = (q, pages, pages, tables, lens, starts)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @mosaic_gpu" in text


@pytest.mark.parametrize("dtype,block_size,head_dim,match", [
    (jnp.float32, 16, 64, "float16 or bfloat16 pages"),
    (BF16, 16, 80, "head_dim in"),
    (BF16, 12, 64, "block_size a multiple of 8"),
    (BF16, 48, 64, "block_size a multiple of 8"),
    (BF16, 256, 128, "exceed shared memory"),
])
def test_layouts_it_cannot_read_are_refused_by_name(dtype, block_size, head_dim, match):
    with pytest.raises(ValueError, match=match):
        kp.check_cache_layout("mosaic_gpu", dtype, block_size, head_dim)


def test_tiles_of_more_than_64_rows_are_refused():
    rng = np.random.default_rng(0)
    pool = make_pool(rng, [5], num_kv_heads=1, head_dim=64, block_size=16, dtype=BF16)
    q = jnp.zeros((8, 4, 64), BF16)
    with pytest.raises(ValueError, match="64 rows"):
        kp.ragged_paged_attention(q, pool.k, pool.v, pool.block_tables, pool.context_lens,
                                  jnp.asarray([0, 8], jnp.int32), implementation="mosaic_gpu",
                                  interpret=True, block_q=32)


def test_gpu_interpret_params_select_the_kernel_and_cpu_names_why_not():
    assert kp.default_implementation(plgpu.InterpretGPUParams()) == "mosaic_gpu"
    if jax.default_backend() == "cpu":
        assert "needs a GPU" in kp.mosaic_gpu_support()
        assert kp.default_implementation(False) == "xla"
