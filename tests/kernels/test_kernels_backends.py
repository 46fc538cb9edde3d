"""The kernels as the accelerators would see them, checked on CPU.

- TPU interpret mode (`pltpu.InterpretParams`) simulates HBM, VMEM, DMAs and
  semaphores: the TPU kernel must run without data races and without an
  out-of-bounds DMA (the interpreter raises on one), on padded block tables.
- Lowering for "cuda" and "tpu" runs the whole Pallas-to-Triton and
  Pallas-to-Mosaic lowering without a device, so a kernel that uses something
  a backend cannot express fails here rather than on the accelerator.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

import kernels_pallas as kp
from tests.kernels.test_kernels import BF16, F32, assert_close, f32, make_pool, mixed_batch

# Two simulated TensorCores (the parallel grid split as on a megacore chip) and
# DMAs that land as soon as they start: under these settings the race detector
# flags a chunk prefetched into the buffer still being read, and a read of a
# buffer whose copy was never waited for.
CHECKED = pltpu.InterpretParams(
    detect_races=True,
    out_of_bounds_reads="raise",
    dma_execution_mode="eager",
    num_cores_or_threads=2,
)


def run_checked(fn, *args, **kwargs):
    """Run under TPU interpret mode; fail on any race the detector saw."""
    pltpu.reset_tpu_interpret_mode_state()
    out = jax.block_until_ready(fn(*args, implementation="tpu", interpret=CHECKED, **kwargs))
    assert interpret_pallas_call.races is not None, "the TPU interpreter did not run"
    assert not interpret_pallas_call.races.races_found
    return out


@pytest.mark.parametrize("dtype,block_size,splits", [(F32, 8, 1), (BF16, 16, 2)])
def test_tpu_decode_has_no_races_or_out_of_bounds_dma(dtype, block_size, splits):
    rng = np.random.default_rng(21)
    # Two padding rows, and table rows padded far past their last block.
    lengths = [3 * block_size + 5, 0, 1, block_size, 0]
    pool = make_pool(rng, lengths, num_kv_heads=1, head_dim=128, block_size=block_size, dtype=dtype)
    tables = jnp.pad(pool.block_tables, ((0, 0), (0, 3)))
    q = jnp.asarray(rng.standard_normal((len(lengths), 2, 128)), dtype)
    expected = kp.paged_decode_attention_reference(
        f32(q), f32(pool.k), f32(pool.v), tables, pool.context_lens
    )
    out = run_checked(
        kp.paged_decode_attention,
        q,
        pool.k_nan,
        pool.v_nan,
        tables,
        pool.context_lens,
        pages_per_chunk=2,
        num_kv_splits=splits,
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("sliding_window", [None, 11])
def test_tpu_ragged_has_no_races_or_out_of_bounds_dma(sliding_window):
    """With a window, the chunk before it is copied only from its first visible page."""
    rng = np.random.default_rng(22)
    batch = mixed_batch(8)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=1, head_dim=128, block_size=8, dtype=F32)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 2, 128)), F32)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    expected = kp.ragged_paged_attention_reference(
        q, pool.k, pool.v, pool.block_tables, pool.context_lens, query_start_loc,
        sliding_window=sliding_window,
    )
    out = run_checked(
        kp.ragged_paged_attention,
        q,
        pool.k_nan,
        pool.v_nan,
        pool.block_tables,
        pool.context_lens,
        query_start_loc,
        block_q=8,
        pages_per_chunk=2,
        sliding_window=sliding_window,
    )
    assert_close(out, expected, F32)


def test_tpu_malformed_table_stays_inside_the_pool():
    """Block ids past the pool and lengths past the table are clamped, not followed."""
    rng = np.random.default_rng(23)
    pool = make_pool(rng, [20, 9], num_kv_heads=1, head_dim=128, block_size=8, dtype=F32)
    num_blocks = pool.k.shape[1]
    tables = pool.block_tables.at[0, 1].set(num_blocks + 7).at[1, 0].set(-3)
    lengths = jnp.array([20, 500], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 2, 128)), F32)
    out = run_checked(kp.paged_decode_attention, q, pool.k, pool.v, tables, lengths)
    assert np.isfinite(np.asarray(out)).all()


# With no GPU present, newer jax lowers Triton kernels only for a named GPU.
H100 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
    ),
)


def _lowered_text(fn, platform, *shapes, **kwargs) -> str:
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    gpu = jax.sharding.use_abstract_mesh(H100) if platform == "cuda" else contextlib.nullcontext()
    with gpu:
        traced = jax.jit(functools.partial(fn, **kwargs)).trace(*args)
        return traced.lower(lowering_platforms=(platform,)).as_text()


def _decode_shapes(dtype, batch, group, num_kv_heads, head_dim, block_size, max_blocks):
    cache = ((num_kv_heads, 64, block_size, head_dim), dtype)
    return (
        ((batch, num_kv_heads * group, head_dim), dtype),
        cache,
        cache,
        ((batch, max_blocks), jnp.int32),
        ((batch,), jnp.int32),
    )


LOWERING_CASES = [
    # (dtype, gqa ratio, num_kv_heads, head_dim, block_size, max_blocks, splits)
    (F32, 1, 2, 64, 1, 40, None),
    (BF16, 3, 1, 128, 16, 9, 1),
    (BF16, 8, 2, 128, 128, 5, 4),
    (F32, 4, 2, 64, 32, 7, None),
]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize(
    "dtype,group,num_kv_heads,head_dim,block_size,max_blocks,splits", LOWERING_CASES
)
def test_triton_kernels_lower_for_cuda(
    dtype, group, num_kv_heads, head_dim, block_size, max_blocks, splits
):
    shapes = _decode_shapes(dtype, 4, group, num_kv_heads, head_dim, block_size, max_blocks)
    decode = _lowered_text(
        kp.paged_decode_attention, "cuda", *shapes, implementation="triton", num_kv_splits=splits
    )
    q_shape = ((24, num_kv_heads * group, head_dim), dtype)
    ragged = _lowered_text(
        kp.ragged_paged_attention,
        "cuda",
        q_shape,
        *shapes[1:],
        ((5,), jnp.int32),
        implementation="triton",
    )
    for text in (decode, ragged):
        assert "triton" in text and "paged_attention_triton" in text


@pytest.mark.parametrize(
    "dtype,group,num_kv_heads,head_dim,block_size,max_blocks,splits", LOWERING_CASES
)
def test_tpu_kernels_lower_for_tpu(
    dtype, group, num_kv_heads, head_dim, block_size, max_blocks, splits
):
    block_size = max(block_size, 16)
    shapes = _decode_shapes(dtype, 4, group, num_kv_heads, head_dim, block_size, max_blocks)
    decode = _lowered_text(
        kp.paged_decode_attention, "tpu", *shapes, implementation="tpu", num_kv_splits=splits
    )
    q_shape = ((24, num_kv_heads * group, head_dim), dtype)
    ragged = _lowered_text(
        kp.ragged_paged_attention,
        "tpu",
        q_shape,
        *shapes[1:],
        ((5,), jnp.int32),
        implementation="tpu",
        pages_per_chunk=2,
    )
    for text in (decode, ragged):
        assert "tpu_custom_call" in text and "paged_attention_tpu" in text


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("platform,implementation,marker", [
    ("cuda", "triton", "paged_attention_triton"), ("tpu", "tpu", "paged_attention_tpu")])
def test_kernels_lower_with_a_stacked_cache_and_a_traced_layer(platform, implementation, marker):
    """The layer and its sliding window traced, as a scanned model passes them."""
    cache = ((3, 2, 64, 16, 128), BF16)
    index_shapes = (((4, 9), jnp.int32), ((4,), jnp.int32))
    scalar = ((), jnp.int32)

    def decode(q, k_cache, v_cache, block_tables, context_lens, layer, window):
        return kp.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                         layer=layer, sliding_window=window, soft_cap=50.0,
                                         implementation=implementation)

    def ragged(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, layer, window):
        return kp.ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens,
                                         query_start_loc, layer=layer, sliding_window=window,
                                         soft_cap=50.0, implementation=implementation)

    texts = (
        _lowered_text(decode, platform, ((4, 8, 128), BF16), cache, cache, *index_shapes,
                      scalar, scalar),
        _lowered_text(ragged, platform, ((24, 8, 128), BF16), cache, cache, *index_shapes,
                      ((5,), jnp.int32), scalar, scalar),
    )
    for text in texts:
        assert marker in text
