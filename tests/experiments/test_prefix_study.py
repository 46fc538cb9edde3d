"""The pieces of Figures 16 and 17 that need no model, against oracles worked out by hand:
what a reserved prefix lets the simulator run at once, the rate study's rules over any
servers, and a block's bytes over PCIe."""

from __future__ import annotations

import math

import pytest

from experiments.chatbot_study import PCIE_BYTES_PER_S, projected_block_costs
from experiments.rate_study import RateRules, rate_search
from experiments.simulator import SimConfig, simulate
from experiments.workloads import RequestSpec

PREFIX = tuple(range(100, 108))  # two full blocks of 4


def _requests(num: int) -> list[RequestSpec]:
    """Prompts of the prefix and 4 tokens of their own (12 tokens: three blocks of 4), one
    output token, whose K/V is never written: three blocks each at their peak."""
    return [RequestSpec(f"r{i}", 0.0, PREFIX + (i, i, i, i), output_len=1) for i in range(num)]


@pytest.mark.parametrize(("config", "peak"), [
    # 16 blocks: the prefix holds 2, each request one block of its own: 14 at once.
    (SimConfig(enable_prefix_caching=True, reserved_prefix=PREFIX), 14),
    # Three private blocks each: 5 at once in 16 blocks.
    (SimConfig(), 5),
    # A contiguous slab of 13 slots each (12 prompt + 1 output): 4 in 64 slots.
    (SimConfig(allocator="orca-oracle"), 4),
])
def test_a_reserved_prefix_runs_as_many_requests_as_its_private_blocks_allow(config, peak):
    config = SimConfig(**{**config.__dict__, "block_size": 4, "num_kv_slots": 64,
                          "max_num_seqs": 64, "max_num_batched_tokens": 256,
                          "max_model_len": 16, "watermark": 0.0})
    result = simulate(_requests(20), config)
    assert result.peak_running_seqs == peak and result.num_finished == 20
    if config.reserved_prefix:
        # Every request hits the prefix's 8 tokens of its 12, and nothing else.
        assert math.isclose(result.prefix_cache_hit_rate, 8 / 12)


def test_a_reserved_prefix_needs_paged_blocks_and_the_prefix_cache():
    with pytest.raises(ValueError, match="reserved prefix"):
        SimConfig(reserved_prefix=PREFIX)
    with pytest.raises(ValueError, match="reserved prefix"):
        SimConfig(allocator="orca-oracle", enable_prefix_caching=True, reserved_prefix=PREFIX)


def test_rate_search_finds_each_servers_crossing_by_the_rules():
    """Latency base x (1 + (rate / C)^4) for a server of capacity C: the threshold is 3 x
    its value at 0.25 C; the ladder brackets the crossing between 1.0 and 1.4 x C, and
    the interpolation is the same fraction of C for both servers, so the ratio of their
    sustained rates is the ratio of their capacities."""
    capacity = {"paged": 10.0, "orca-oracle": 4.0}
    calls = []

    def run_at(name: str, rate: float) -> dict:
        calls.append((name, rate))
        if math.isinf(rate):  # 20 requests at the capacity
            return {"num_requests": 20, "virtual_s": 20 / capacity[name]}
        return {"normalized_latency_s_mean": 0.1 * (1 + (rate / capacity[name]) ** 4)}

    result = rate_search(run_at, ("paged", "orca-oracle"), RateRules())
    threshold = 3 * 0.1 * (1 + 0.25**4)
    low, high = 0.1 * 2, 0.1 * (1 + 1.4**4)
    fraction = 1.0 + (threshold - low) / (high - low) * 0.4
    for name, c in capacity.items():
        assert math.isclose(result["sustained_rate"][name]["rate"], fraction * c)
        assert result["sustained_rate"][name]["bound"] == "interpolated"
    assert math.isclose(result["rate_ratios"]["rate_ratio_vs_orca_oracle"], 2.5)
    assert math.isclose(result["capacity_ratios"]["capacity_ratio_vs_orca_oracle"], 2.5)
    # Orca: all at once, 1.4 (above the threshold), then 1.0 (below): the bracket.
    assert [rate / 4.0 for name, rate in calls if name == "orca-oracle"] == [math.inf, 1.4, 1.0]
    assert rate_search(run_at, ("paged",), RateRules(), curves=False).keys() == {
        "capacity_requests_per_s", "capacity_ratios", "all_at_once"}


def test_a_projected_block_load_is_its_bytes_over_the_link():
    costs = projected_block_costs(512, 16)
    # LLaMA-13B in float16: 16 tokens x 40 layers x K and V x 40 heads x 128 x 2 bytes.
    block_bytes = 16 * 40 * 2 * 40 * 128 * 2
    assert costs["block_bytes"] == block_bytes
    assert math.isclose(costs["load_ms_per_block"], 1e3 * block_bytes / PCIE_BYTES_PER_S)
    assert costs["recompute_over_load"] > 1  # 32 blocks of prefill on an A100's clock
