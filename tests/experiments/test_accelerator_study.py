"""The accelerators study's scenarios: pools worked out by hand from the devices' public
memory and the models' shapes, and a device's fitted calibration taking the place of
the assumed one."""

from __future__ import annotations

import dataclasses
import json

from experiments.accelerator_study import device_calibrations, paper_pool_tokens, scenarios
from experiments.rate_study import RateSettings
from experiments.step_cost import ASSUMED, DEVICES, OPT_13B, StepCost

# Llama-3-8B: q, o 4096 x 4096; k, v 4096 x 1024; SwiGLU 3 x 4096 x 14336: 218,103,808
# weights a layer, 32 layers, and a 128,256 x 4,096 output embedding, in 2 bytes.
LLAMA3_8B_WEIGHT_BYTES = (32 * 218_103_808 + 128_256 * 4096) * 2
# K and V of 8 KV heads of 128 dims in 2 bytes, 32 layers.
LLAMA3_8B_KV_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2


def _figure12() -> dict:
    settings = RateSettings("sharegpt")
    return {"sharegpt": {"settings": dataclasses.asdict(settings) | {"length_scale": 0.25},
                         "pool_tokens": 1968}}


def test_pools_by_hand():
    # Figure 1: 30% of the A100's 40 GiB; OPT-13B's token is 2 x 40 layers x 5120 x 2 bytes.
    assert paper_pool_tokens() == int(0.30 * 40 * 2**30) // (2 * 40 * 5120 * 2)
    by_name = {s.name: s for s in scenarios(_figure12(), StepCost(DEVICES["a100-40gb"], OPT_13B),
                                            quick=True, seed=0, calibrations={})}
    assert by_name["h200-llama3-8b-sharegpt"].pool_tokens == int(
        (0.9 * 141e9 - LLAMA3_8B_WEIGHT_BYTES) // LLAMA3_8B_KV_TOKEN_BYTES)
    assert by_name["tpu-v5e-4-llama3-8b-sharegpt"].pool_tokens == int(
        (0.9 * 4 * 16 * 2**30 - LLAMA3_8B_WEIGHT_BYTES) // LLAMA3_8B_KV_TOKEN_BYTES)
    check = by_name["cpu-smollm2-sharegpt"]
    assert check.pool_tokens == 1968 and check.orca_blocks
    assert check.settings == RateSettings("sharegpt")


def test_a_device_calibration_replaces_the_assumed_one(tmp_path):
    fitted = {"decode": {"compute": 0.2, "bandwidth": 0.7, "overhead_s": 0.004},
              "prefill": {"compute": 0.6, "bandwidth": 0.5, "overhead_s": 0.006},
              "source": "fitted on an H200"}
    report = tmp_path / "accelerator.json"
    report.write_text(json.dumps({"sections": {"step_cost": {"device_key": "h200",
                                                             "calibration": fitted}}}))
    by_name = {s.name: s for s in scenarios(
        _figure12(), StepCost(DEVICES["a100-40gb"], OPT_13B), quick=True, seed=0,
        calibrations=device_calibrations(report))}
    h200 = by_name["h200-llama3-8b-sharegpt"].cost.calibration
    assert dataclasses.asdict(h200.decode) == fitted["decode"]
    assert dataclasses.asdict(h200.prefill) == fitted["prefill"]
    assert h200.source == "fitted on an H200"
    assert by_name["tpu-v5e-4-llama3-8b-sharegpt"].cost.calibration == ASSUMED
