"""The step-cost model against hand-computed values and brute force, and its fit against
synthetic step times from known parameters.

Hand-computed: a two-layer model small enough to count every weight, pair and block
on paper (the counts are in the comments). Brute force: attention pairs and blocks
read by enumerating every query token and key position. The fit: step times drawn
from the model with known efficiencies, perturbed like the engine's measured steps
(a few percent of jitter, and now and then a step another process stretched), must
give those efficiencies back within 5 %.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from experiments.step_cost import (
    Calibration,
    Device,
    Efficiency,
    ModelShape,
    StepCost,
    StepShape,
    allreduce_bytes,
    attended_keys,
    attention_flops,
    blocks_read,
    fit,
    kv_bytes,
    linear_flops,
)
from jpaged.core.step_shapes import default_buckets

# 2 layers of q, o: 8 x (2 x 4); k, v: 8 x (1 x 4); SwiGLU 3 x 8 x 16 -> 576 weights a layer.
TINY = ModelShape("tiny", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                  intermediate_size=16, vocab_size=10, dtype_bytes=2)
# A decode of a 5-token context and a 3-token prompt, in a bucket of 8 tokens, 2 logit rows.
SHAPE = StepShape(query_lens=(1, 3), context_lens=(5, 3), padded_tokens=8, logit_rows=2,
                  block_size=4)
DEVICE = Device("round numbers", peak_flops=1000.0, peak_bandwidth=100.0,
                memory_bytes=10_000.0, source="test")
HALF = Efficiency(compute=0.5, bandwidth=0.5, overhead_s=1.0)


def test_counts_by_hand():
    assert TINY.layer_params == 576
    assert TINY.weight_bytes == (2 * 576 + 10 * 8) * 2 == 2464
    assert TINY.kv_bytes_per_token_layer == 2 * 1 * 4 * 2
    # 2 FLOPs x (576 weights x 2 layers x 8 tokens + 80 output-embedding weights x 2 rows).
    assert linear_flops(TINY, SHAPE) == 2 * (576 * 2 * 8 + 80 * 2)
    # Pairs a layer: 5 (the decode) + 1 + 2 + 3 (the prompt) = 11; 4 x 2 heads x 4 dims each.
    assert attention_flops(TINY, SHAPE) == 4 * 2 * 4 * 11 * 2
    # Blocks a layer: 2 (5 tokens) + 1 (3 tokens); read in full, plus 4 new tokens written.
    assert kv_bytes(TINY, SHAPE) == (3 * 4 * 2 + 4 * 2) * 16


def test_step_seconds_by_hand():
    cost = StepCost(DEVICE, TINY, Calibration(HALF, HALF, "test"))
    # Rates 500 FLOP/s and 50 B/s: linear max(18752 / 500, 2464 / 50) = 49.28 (weights),
    # attention max(704 / 500, 512 / 50) = 10.24 (KV), and the overhead of 1.
    assert cost.seconds(SHAPE) == pytest.approx(1.0 + 49.28 + 10.24)
    decode_only = dataclasses.replace(cost, calibration=Calibration(
        HALF, Efficiency(1.0, 1.0, 0.0), "test"))
    assert decode_only.seconds(SHAPE) == pytest.approx(2464 / 100 + 512 / 100), \
        "a step with a prompt chunk takes the prefill efficiency"


def test_windows_and_a_quantized_cache_by_hand():
    # Layer 0 slides over 2 keys: the decode sees 2, the prompt's tokens 1, 2, 2.
    windowed = dataclasses.replace(TINY, layer_windows=(2, None))
    assert attention_flops(windowed, SHAPE) == 4 * 2 * 4 * ((2 + 5) + 11)
    # A head of 4 int8 elements and a 2-byte scale: 6 bytes, 12 for K and V a layer, over
    # the same 32 token-layers (24 read in blocks, 8 written).
    quantized = dataclasses.replace(TINY, kv_head_bytes=4 + 2)
    assert kv_bytes(quantized, SHAPE) == 32 * 12


def test_tensor_parallel_by_hand():
    # A ring all-reduce sends 2 (n - 1) / n of 8 tokens x 8 hidden x 2 bytes, twice a layer.
    assert allreduce_bytes(TINY, SHAPE, 4) == 2 * 2 * 1.5 * 128
    assert allreduce_bytes(TINY, SHAPE, 1) == 0
    slice4 = dataclasses.replace(DEVICE, num_chips=4, interconnect_bandwidth=96.0)
    cost = StepCost(slice4, TINY, Calibration(HALF, HALF, "test"))
    assert cost.seconds(SHAPE) == pytest.approx(1.0 + 49.28 / 4 + 10.24 / 4 + 768 / 96)


def test_pool_by_hand():
    # 90% of 10,000 bytes, less 2,464 of weights, over 2 layers x 16 bytes a token.
    assert StepCost(DEVICE, TINY).kv_pool_tokens() == (9000 - 2464) // 32
    with pytest.raises(ValueError, match="leaves no KV memory"):
        StepCost(dataclasses.replace(DEVICE, memory_bytes=100.0), TINY).kv_pool_tokens()


def _brute_pairs(query_len: int, context_len: int, window: int | None) -> int:
    pairs = 0
    for p in range(context_len - query_len, context_len):
        pairs += sum(1 for j in range(p + 1) if window is None or j > p - window)
    return pairs


def _brute_blocks(query_len: int, context_len: int, window: int | None, block_size: int) -> int:
    keys = {j for p in range(context_len - query_len, context_len) for j in range(p + 1)
            if window is None or j > p - window}
    return len({j // block_size for j in keys})


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_pairs_and_blocks_against_brute_force(window):
    for context_len in range(1, 30):
        for query_len in range(1, context_len + 1):
            q, c = np.array([query_len]), np.array([context_len])
            assert attended_keys(q, c, window)[0] == _brute_pairs(query_len, context_len, window)
            for block_size in (1, 4, 16):
                assert blocks_read(q, c, window, block_size)[0] == _brute_blocks(
                    query_len, context_len, window, block_size)


def test_shape_takes_the_engines_bucket():
    buckets = default_buckets("xla", 1, 64)
    decode = StepShape.of([1] * 17, [40] * 17, buckets, 16)
    assert (decode.padded_tokens, decode.logit_rows, decode.is_decode) == (32, 32, True)
    mixed = StepShape.of([1, 100], [40, 100], buckets, 16)
    assert (mixed.padded_tokens, mixed.is_decode) == (128, False)


# The fit.

CPU_LIKE = Device("cpu-like", peak_flops=200e9, peak_bandwidth=30e9, memory_bytes=0.0,
                  source="test")
SMALL = ModelShape("small", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                   head_dim=64, intermediate_size=1536, vocab_size=49152, dtype_bytes=4)
TRUE = Calibration(decode=Efficiency(compute=0.3, bandwidth=0.6, overhead_s=0.01),
                   prefill=Efficiency(compute=0.5, bandwidth=0.4, overhead_s=0.02),
                   source="known")


def _synthetic_steps(rng: np.random.Generator) -> tuple[list[StepShape], list[float]]:
    """As many steps as a few engine runs take: decode batches 1-64 at contexts 32-1024
    (batch 1 waits on the weights, large batches on compute) and prompt chunks of 2-256
    tokens (log-uniform: short chunks wait on the weights too) beside up to 7 decodes;
    times from TRUE, each with 3 % jitter and one in twenty stretched 1.3-3x."""
    buckets = default_buckets("xla", 1, 64)
    shapes = []
    for _ in range(2000):
        batch = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]))
        contexts = rng.integers(32, 1024, batch).tolist()
        shapes.append(StepShape.of([1] * batch, contexts, buckets, 16))
    for _ in range(1000):
        chunk = int(np.exp(rng.uniform(np.log(2), np.log(256))))
        decodes = int(rng.integers(0, 8))
        prior = int(rng.integers(0, 512))
        shapes.append(StepShape.of([chunk] + [1] * decodes,
                                   [prior + chunk] + rng.integers(32, 512, decodes).tolist(),
                                   buckets, 16))
    truth = StepCost(CPU_LIKE, SMALL, TRUE)
    seconds = [truth.seconds(s) * rng.lognormal(0, 0.03) * (rng.uniform(1.3, 3.0)
               if rng.random() < 0.05 else 1.0) for s in shapes]
    return shapes, seconds


@pytest.mark.parametrize("seed", [0, 1])
def test_fit_recovers_known_efficiencies(seed):
    shapes, seconds = _synthetic_steps(np.random.default_rng(seed))
    fitted = fit(StepCost(CPU_LIKE, SMALL), shapes, seconds, "synthetic")
    for phase in ("decode", "prefill"):
        got, want = getattr(fitted, phase), getattr(TRUE, phase)
        for name in ("compute", "bandwidth", "overhead_s"):
            assert math.isclose(getattr(got, name), getattr(want, name), rel_tol=0.05), \
                (phase, name, getattr(got, name), getattr(want, name))
