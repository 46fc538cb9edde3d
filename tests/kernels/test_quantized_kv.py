"""Quantized KV pages (int8, fp8 e4m3 and e5m2, a float32 scale per token and KV head).

Oracles: numpy's own absmax quantization of each written token; the float32
reference on the dequantized cache (the same numbers, so float32 tolerance); and
the float32 reference on the unquantized cache, within a bound derived from the
quantization step before any output is looked at (`attention_error_bound`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kernels_pallas as kp
from kernels_pallas.quantization import (
    STORAGE_DTYPE,
    EncodedPages,
    as_float,
    as_format,
    is_quantized,
    quantize,
    rotation,
    zeros,
)
from tests.kernels.test_kernels import assert_close, decode_lengths, make_pool, mixed_batch
from tests.kernels.test_kernels_backends import _lowered_text, run_checked
from tests.plugins.kernels import kernel_interpret

F32 = jnp.float32
QUANTIZED = [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2]
# The largest rounding error of one element relative to its token's absmax, and of
# the formats' subnormals relative to the scale: half a step of 2 / 254 of the
# absmax for int8; half the spacing of 3 (e4m3) or 2 (e5m2) mantissa bits, and
# half the smallest subnormal (2**-9, 2**-16) after scaling.
RELATIVE_STEP = {jnp.int8: (1 / 254, 0.0), jnp.float8_e4m3fn: (2.0**-4, 2.0**-10),
                 jnp.float8_e5m2: (2.0**-3, 2.0**-17)}
QMAX = {jnp.int8: 127.0, jnp.float8_e4m3fn: 448.0, jnp.float8_e5m2: 57344.0}


def numpy_quantize(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The definition: x [..., D] -> (values, f32 scales [...]), symmetric absmax."""
    scales = np.abs(x).max(-1) / QMAX[dtype]
    scaled = np.clip(x / np.where(scales == 0, 1, scales)[..., None], -QMAX[dtype], QMAX[dtype])
    if dtype == jnp.int8:
        return np.round(scaled).astype(np.int8), scales.astype(np.float32)
    return scaled.astype(jnp.dtype(dtype)), scales.astype(np.float32)


def element_error(x: np.ndarray, dtype) -> np.ndarray:
    """The most one element of each token [..., D] may move when quantized: [...]."""
    relative, subnormal = RELATIVE_STEP[dtype]
    absmax = np.abs(x).max(-1)
    return absmax * relative + absmax / QMAX[dtype] * subnormal


def attention_error_bound(q, k, v, lengths, dtype, scale) -> np.ndarray:
    """|attention(q, K', V') - attention(q, K, V)| per (row, head), for K', V' within
    element_error of K, V: every score moves by at most d = scale * sum|q| * eps_k, so
    each probability by a factor within exp(+-2 d), and the output by at most
    max eps_v + (exp(2 d) - 1) * max|v| over the keys it sees.

    q [B, Hq, D]; k, v [B, S, Hkv, D] (each sequence's keys in order); lengths [B].
    """
    group = q.shape[1] // k.shape[2]
    bounds = np.zeros(q.shape[:2])
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        keys, values = k[row, :length], v[row, :length]
        eps_k, eps_v = element_error(keys, dtype), element_error(values, dtype)  # [S, Hkv]
        for head in range(q.shape[1]):
            kv_head = head // group
            shift = scale * np.abs(q[row, head]).sum() * eps_k[:, kv_head].max()
            bounds[row, head] = (eps_v[:, kv_head].max()
                                 + np.expm1(2 * shift) * np.abs(values[:, kv_head]).max())
    return bounds


def quantized_pool(pool, dtype, poison: bool):
    """The pool's K and V as EncodedPages; poison: every slot no sequence owns gets a
    NaN scale (and NaN values in the fp8 formats, which have a NaN)."""
    pages = []
    for clean, poisoned in ((pool.k, pool.k_nan), (pool.v, pool.v_nan)):
        values, scales = quantize(clean, dtype)
        if poison:
            unowned = jnp.isnan(poisoned)
            scales = jnp.where(unowned[..., 0], jnp.nan, scales)
            if jnp.issubdtype(dtype, jnp.floating):
                nan_bits = lax.bitcast_convert_type(jnp.asarray(jnp.nan, dtype), values.dtype)
                values = jnp.where(unowned, nan_bits, values)
        pages.append(EncodedPages(values, scales, jnp.dtype(dtype)))
    return pages


def gathered(cache, tables, max_len):
    """cache [Hkv, N, bs, D] read through tables [B, M]: [B, max_len, Hkv, D]."""
    cache = np.asarray(cache)
    pages = cache[:, np.asarray(tables)]  # [Hkv, B, M, bs, D]
    seqs = pages.transpose(1, 2, 3, 0, 4).reshape(tables.shape[0], -1, cache.shape[0],
                                                    cache.shape[-1])
    return seqs[:, :max_len]


def test_write_kv_quantizes_each_token_as_numpy_does():
    rng = np.random.default_rng(5)
    num_kv_heads, num_blocks, block_size, head_dim = 2, 5, 4, 16
    slots = np.array([9, 2, 17, 0, 1], np.int32)
    k = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    v = 3.0 * rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    k[1, 0] = 0.0  # an all-zero row gets scale 0, never a NaN
    for dtype in QUANTIZED:
        empty = zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype)
        new_k, new_v = kp.write_kv(empty, empty, jnp.asarray(k), jnp.asarray(v),
                                   jnp.asarray(slots))
        for new, x in ((new_k, k), (new_v, v)):
            values, scales = numpy_quantize(x, dtype)
            for token, slot in enumerate(slots):
                block, offset = divmod(int(slot), block_size)
                stored = as_format(new.values[:, block, offset], dtype)
                np.testing.assert_array_equal(np.asarray(stored), values[token])
                np.testing.assert_allclose(np.asarray(new.scales[:, block, offset]),
                                           scales[token], rtol=1e-6)
            read = np.asarray(as_float(new))
            for token, slot in enumerate(slots):
                block, offset = divmod(int(slot), block_size)
                error = np.abs(read[:, block, offset] - x[token]).max(-1)
                assert (error <= element_error(x[token], dtype) * (1 + 1e-5)).all()
        assert np.asarray(new_k.scales[0, 0, 2]) == 0.0  # slot 2, head 0: the zero row
        assert new_k.dtype == dtype and new_k.values.dtype.itemsize == 1
        assert new_k.scales.dtype == F32


@pytest.mark.parametrize("dtype", [*QUANTIZED, jnp.bfloat16, jnp.float16])
def test_a_step_moves_only_the_rows_it_writes_and_reads(dtype):
    """Writes into a donated cache and reads through a block table touch their rows
    alone: XLA's CPU backend would compute a scatter into, or a gather from, an fp8,
    bfloat16 or float16 array in a wider float, converting the whole pool there and
    back."""
    cache = zeros((4, 2, 256, 16, 64), dtype)
    pool_bytes = cache.values.nbytes

    def write(k_cache, v_cache, new, slots):
        return kp.write_kv(k_cache, v_cache, new, new, slots, jnp.int32(1))

    compiled = jax.jit(write, donate_argnums=(0, 1)).lower(
        cache, cache, jnp.ones((8, 2, 64), F32), jnp.arange(8, dtype=jnp.int32)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 64

    def read(k_cache, v_cache, q, block_tables, context_lens):
        return kp.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                         layer=jnp.int32(1), implementation="xla")

    compiled = jax.jit(read).lower(cache, cache, jnp.ones((4, 4, 64), F32),
                                   jnp.ones((4, 8), jnp.int32),
                                   jnp.full((4,), 100, jnp.int32)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes // 8


# (implementation, dtype, block size, gqa ratio, head_dim)
CASES = [
    ("reference", jnp.int8, 16, 3, 64),
    ("xla", jnp.int8, 16, 3, 64),
    ("xla", jnp.float8_e4m3fn, 8, 1, 128),
    ("xla", jnp.float8_e5m2, 32, 4, 64),
    ("triton", jnp.int8, 16, 4, 64),
    ("triton", jnp.float8_e4m3fn, 32, 1, 128),
    ("triton", jnp.float8_e5m2, 8, 8, 64),
    ("tpu", jnp.int8, 32, 3, 128),
    ("tpu", jnp.float8_e4m3fn, 32, 4, 64),
    ("tpu", jnp.float8_e5m2, 64, 1, 64),
]


@pytest.mark.parametrize("implementation,dtype,block_size,group,head_dim", CASES)
def test_decode_reads_the_dequantized_cache(implementation, dtype, block_size, group, head_dim):
    """Every backend on a NaN-poisoned quantized pool: the float32 reference on the
    dequantized pool, and the unquantized reference within the derived bound."""
    rng = np.random.default_rng(block_size + group + head_dim)
    lengths = decode_lengths(block_size)
    pool = make_pool(rng, lengths, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                     dtype=F32)
    q = jnp.asarray(rng.standard_normal((len(lengths), 2 * group, head_dim)), F32)
    k_clean, v_clean = quantized_pool(pool, dtype, poison=False)
    k_nan, v_nan = quantized_pool(pool, dtype, poison=True)
    out = kp.paged_decode_attention(
        q, k_nan, v_nan, pool.block_tables, pool.context_lens, implementation=implementation,
        interpret=implementation in ("triton", "tpu") and kernel_interpret(implementation))
    dequantized = kp.paged_decode_attention_reference(
        q, as_float(k_clean), as_float(v_clean), pool.block_tables, pool.context_lens)
    assert_close(out, dequantized, F32)

    exact = kp.paged_decode_attention_reference(q, pool.k, pool.v, pool.block_tables,
                                                pool.context_lens)
    longest = max(lengths)
    bound = attention_error_bound(
        np.asarray(q), gathered(pool.k, pool.block_tables, longest),
        gathered(pool.v, pool.block_tables, longest), lengths, dtype, head_dim**-0.5)
    error = np.abs(np.asarray(out) - np.asarray(exact)).max(-1)
    assert (error <= bound + 1e-5).all()
    assert error.max() > 0  # the cache really is quantized


@pytest.mark.parametrize("implementation,dtype", [
    ("reference", jnp.int8), ("xla", jnp.float8_e4m3fn), ("triton", jnp.int8),
    ("tpu", jnp.float8_e5m2)])
def test_ragged_reads_the_dequantized_cache(implementation, dtype):
    """Prefill, decode, chunked prefill and padding in one batch, with a sliding window
    and a soft cap: the float32 reference on the dequantized pool."""
    rng = np.random.default_rng(8)
    batch = mixed_batch(32)
    pool = make_pool(rng, batch.context_lens, num_kv_heads=2, head_dim=64, block_size=32,
                     dtype=F32)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, 6, 64)), F32)
    query_start_loc = jnp.asarray(batch.query_start_loc, jnp.int32)
    k_clean, v_clean = quantized_pool(pool, dtype, poison=False)
    k_nan, v_nan = quantized_pool(pool, dtype, poison=True)
    knobs = dict(sliding_window=21, soft_cap=30.0)
    out = kp.ragged_paged_attention(
        q, k_nan, v_nan, pool.block_tables, pool.context_lens, query_start_loc,
        implementation=implementation,
        interpret=implementation in ("triton", "tpu") and kernel_interpret(implementation),
        **knobs)
    expected = kp.ragged_paged_attention_reference(
        q, as_float(k_clean), as_float(v_clean), pool.block_tables, pool.context_lens,
        query_start_loc, **knobs)
    assert_close(out, expected, F32)
    assert not np.asarray(out[-batch.padding_tokens:]).any()


def test_bfloat16_queries_read_a_quantized_cache():
    """A bfloat16 model's queries against int8 pages: the values enter the matmul as
    bfloat16 exactly, so only the queries' own rounding separates it from f32."""
    rng = np.random.default_rng(9)
    lengths = decode_lengths(16)
    pool = make_pool(rng, lengths, num_kv_heads=1, head_dim=64, block_size=16, dtype=F32)
    q = jnp.asarray(rng.standard_normal((len(lengths), 4, 64)), jnp.bfloat16)
    k, v = quantized_pool(pool, jnp.int8, poison=True)
    out = kp.paged_decode_attention(q, k, v, pool.block_tables, pool.context_lens,
                                    implementation="xla")
    k_clean, v_clean = quantized_pool(pool, jnp.int8, poison=False)
    expected = kp.paged_decode_attention_reference(
        q.astype(F32), as_float(k_clean), as_float(v_clean), pool.block_tables,
        pool.context_lens)
    assert out.dtype == jnp.bfloat16
    assert_close(out, expected, jnp.bfloat16)


def test_tpu_kernel_copies_scales_without_races_or_out_of_bounds_dma():
    rng = np.random.default_rng(10)
    lengths = [3 * 32 + 5, 0, 1, 32]
    pool = make_pool(rng, lengths, num_kv_heads=1, head_dim=128, block_size=32, dtype=F32)
    tables = jnp.pad(pool.block_tables, ((0, 0), (0, 2)))
    q = jnp.asarray(rng.standard_normal((len(lengths), 2, 128)), F32)
    k, v = quantized_pool(pool, jnp.int8, poison=True)
    k_clean, v_clean = quantized_pool(pool, jnp.int8, poison=False)
    out = run_checked(kp.paged_decode_attention, q, k, v, tables, pool.context_lens,
                      pages_per_chunk=2, num_kv_splits=2)
    expected = kp.paged_decode_attention_reference(q, as_float(k_clean), as_float(v_clean),
                                                   tables, pool.context_lens)
    assert_close(out, expected, F32)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("platform,implementation,marker,dtype", [
    ("cuda", "triton", "paged_attention_triton", jnp.int8),
    ("cuda", "triton", "paged_attention_triton", jnp.float8_e4m3fn),
    ("cuda", "triton", "paged_attention_triton", jnp.bfloat16),
    ("tpu", "tpu", "paged_attention_tpu", jnp.int8),
    ("tpu", "tpu", "paged_attention_tpu", jnp.float8_e5m2),
    ("tpu", "tpu", "paged_attention_tpu", jnp.bfloat16)])
def test_encoded_kernels_lower(platform, implementation, marker, dtype):
    """Both ops over a stacked encoded cache (quantized, or bfloat16 bits) with a traced
    layer, as the model runs them."""
    pages, scales = ((3, 2, 64, 32, 128), STORAGE_DTYPE[jnp.dtype(dtype)]), ((3, 2, 64, 32), F32)
    index_shapes = (((4, 9), jnp.int32), ((4,), jnp.int32))

    def encoded(values, scales):
        return EncodedPages(values, scales if is_quantized(dtype) else None, dtype)

    def decode(q, k, v, k_scales, v_scales, block_tables, context_lens, layer):
        return kp.paged_decode_attention(
            q, encoded(k, k_scales), encoded(v, v_scales), block_tables, context_lens,
            layer=layer, implementation=implementation)

    def ragged(q, k, v, k_scales, v_scales, block_tables, context_lens, query_start_loc, layer):
        return kp.ragged_paged_attention(
            q, encoded(k, k_scales), encoded(v, v_scales), block_tables, context_lens,
            query_start_loc, layer=layer, implementation=implementation)

    caches = (pages, pages, scales, scales)
    texts = (
        _lowered_text(decode, platform, ((4, 8, 128), jnp.bfloat16), *caches, *index_shapes,
                      ((), jnp.int32)),
        _lowered_text(ragged, platform, ((24, 8, 128), jnp.bfloat16), *caches, *index_shapes,
                      ((5,), jnp.int32), ((), jnp.int32)),
    )
    for text in texts:
        assert marker in text


def test_layout_rules_name_the_dtype():
    with pytest.raises(ValueError, match="multiple of 32 for int8"):
        kp.check_cache_layout("tpu", jnp.int8, 16, 128)
    kp.check_cache_layout("tpu", jnp.float8_e4m3fn, 32, 128)
    assert kp.default_block_size("tpu", jnp.int8) == 32
    assert kp.default_block_size("tpu", jnp.bfloat16) == 16
    assert kp.default_block_size("triton", jnp.int8) == 16
    with pytest.raises(ValueError, match="int16"):
        kp.check_cache_layout("xla", jnp.int16, 16, 64)


def test_quantized_and_plain_caches_do_not_mix():
    k = zeros((1, 4, 8, 16), jnp.int8)
    v = jnp.zeros((1, 4, 8, 16), F32)
    with pytest.raises(TypeError, match="one kind"):
        kp.write_kv(k, v, jnp.zeros((1, 1, 16)), jnp.zeros((1, 1, 16)),
                    jnp.zeros(1, jnp.int32))
    bad = kp.EncodedPages(jnp.zeros((1, 4, 8, 16), jnp.int8), jnp.zeros((1, 4, 16), F32),
                            jnp.dtype(jnp.int8))
    with pytest.raises(ValueError, match="need scales"):
        kp.write_kv(bad, bad, jnp.zeros((1, 1, 16)), jnp.zeros((1, 1, 16)),
                    jnp.zeros(1, jnp.int32))
    unbitcast = kp.EncodedPages(jnp.zeros((1, 4, 8, 16), jnp.float8_e4m3fn),
                                  jnp.zeros((1, 4, 8), F32), jnp.dtype(jnp.float8_e4m3fn))
    with pytest.raises(TypeError, match="stored as uint8"):
        kp.write_kv(unbitcast, unbitcast, jnp.zeros((1, 1, 16)), jnp.zeros((1, 1, 16)),
                    jnp.zeros(1, jnp.int32))


def test_fp8_values_clip_to_the_format():
    """A token whose absmax maps onto the format's largest value, the rest in range."""
    x = jnp.asarray([[1e30, -3.0, 0.5]], F32)
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        values, scales = quantize(x, dtype)
        values = as_format(values, dtype).astype(F32)
        assert np.isfinite(np.asarray(values)).all()
        assert float(values[0, 0]) == float(jnp.finfo(dtype).max)
        np.testing.assert_allclose(np.asarray(scales), [1e30 / QMAX[dtype]], rtol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_the_rotation_is_orthonormal_and_spreads_a_channel_over_its_block(head_dim):
    r = rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    block = 32 if head_dim == 96 else head_dim
    one_channel = np.zeros(head_dim, np.float32)
    one_channel[5] = 1.0
    rotated = one_channel @ r
    # A one-hot channel becomes a flat row over its Hadamard block, zero elsewhere.
    np.testing.assert_allclose(np.abs(rotated[:block]), 1 / np.sqrt(block), rtol=1e-6)
    assert not rotated[block:].any()
