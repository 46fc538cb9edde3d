"""The conversations' replay on a tiny model: every arm serves the same rounds with the
same greedy answers (the no-cache arm is the oracle: caching must change no token), and
where the history outgrows the device pool the host tier serves what the device lost."""

from __future__ import annotations

import pytest

from experiments.chatbot_study import ReplaySettings, replay
from jpaged.model.loader import load_model

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def test_every_arm_answers_alike_and_the_tier_serves_what_the_device_evicted(loaded):
    settings = ReplaySettings(num_conversations=6, output_cap=48, max_model_len=128,
                              device_pool_tokens=128, tier_tokens=2048, request_rate=4.0,
                              think_s=2.0, block_size=4, max_num_seqs=4,
                              max_num_batched_tokens=64)
    result = replay(loaded, settings, loaded[1].vocab_size, progress=lambda message: None)
    arms = result["arms"]
    assert set(arms) == set(settings.arms)
    assert len({run["num_requests"] for run in arms.values()}) == 1
    assert len({run["answers_sha256"] for run in arms.values()}) == 1
    device, tier = arms["device-cache"], arms["device+tier"]
    # The history (rounds of up to 128 tokens, 6 conversations) outgrows 128 device slots:
    # the tier serves blocks the device lost, on top of the device's own hits.
    assert tier["prefix_cache_tier_hit_tokens"] > 0
    assert tier["kv_offload_loaded_blocks"] * settings.block_size >= \
        tier["prefix_cache_tier_hit_tokens"]
    assert tier["prefix_cache_hit_tokens"] > device["prefix_cache_hit_tokens"]
    assert arms["no-cache"]["prefix_cache_hit_tokens"] == 0
    assert result["tier_gib"] > 0 and arms["control"]["device_pool_tokens"] == 128 + 2048
