"""Datasheet peaks of the accelerators jpaged is measured on, in one table: the
benchmarks' fractions of peak and the step-cost model's devices (experiments.step_cost)
both read it. Imports nothing of jpaged, so a kernel benchmark may use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peaks:
    """One chip's peaks. flops: dense bfloat16 FLOP/s (None where the datasheet gives
    none); bandwidth: main-memory bytes/s; source: where the figures come from."""

    flops: float | None
    bandwidth: float
    source: str


# By a substring of jax's device_kind, first match wins (so the more specific names
# come first). NVIDIA's dense FLOP/s are half its datasheets' "with sparsity" figures.
PEAKS = {
    "H200": Peaks(989e12, 4.8e12, "NVIDIA H200 datasheet: 989 TFLOPS BF16 dense, 4.8 TB/s"),
    "H100 PCIe": Peaks(756e12, 2.0e12, "NVIDIA H100 datasheet, PCIe: 756 TFLOPS BF16 "
                                       "dense, 2 TB/s"),
    "H100 NVL": Peaks(835e12, 3.9e12, "NVIDIA H100 datasheet, NVL: 835 TFLOPS BF16 "
                                      "dense, 3.9 TB/s"),
    "H100": Peaks(989e12, 3.35e12, "NVIDIA H100 datasheet, SXM: 989 TFLOPS BF16 dense, "
                                   "3.35 TB/s"),
    "A100-SXM4-80GB": Peaks(312e12, 2.039e12, "NVIDIA A100 datasheet, 80GB SXM: 312 TFLOPS "
                                              "BF16 dense, 2,039 GB/s"),
    "A100 80GB PCIe": Peaks(312e12, 1.935e12, "NVIDIA A100 datasheet, 80GB PCIe: 312 "
                                              "TFLOPS BF16 dense, 1,935 GB/s"),
    "A100": Peaks(312e12, 1.555e12, "NVIDIA A100 datasheet, 40GB: 312 TFLOPS BF16 dense, "
                                    "1,555 GB/s"),
    "L40S": Peaks(362e12, 0.864e12, "NVIDIA L40S datasheet: 362 TFLOPS BF16 dense, 864 GB/s"),
    "L4": Peaks(121e12, 0.3e12, "NVIDIA L4 datasheet: 121 TFLOPS BF16 dense, 300 GB/s"),
    "A10G": Peaks(None, 0.6e12, "NVIDIA A10G (AWS G5): 600 GB/s"),
    "TPU v4": Peaks(275e12, 1.2e12, "Google Cloud TPU v4 documentation: 275 TFLOPS BF16, "
                                    "1,200 GB/s"),
    "TPU v5 lite": Peaks(197e12, 0.819e12, "Google Cloud TPU v5e documentation: 197 TFLOPS "
                                           "BF16, 819 GB/s"),
    "TPU v5e": Peaks(197e12, 0.819e12, "Google Cloud TPU v5e documentation: 197 TFLOPS "
                                       "BF16, 819 GB/s"),
    "TPU v5p": Peaks(459e12, 2.765e12, "Google Cloud TPU v5p documentation: 459 TFLOPS "
                                       "BF16, 2,765 GB/s"),
    # jax names a v5p "TPU v5".
    "TPU v5": Peaks(459e12, 2.765e12, "Google Cloud TPU v5p documentation: 459 TFLOPS "
                                      "BF16, 2,765 GB/s"),
    "TPU v6 lite": Peaks(918e12, 1.64e12, "Google Cloud TPU v6e documentation: 918 TFLOPS "
                                          "BF16, 1,640 GB/s"),
    "TPU v6e": Peaks(918e12, 1.64e12, "Google Cloud TPU v6e documentation: 918 TFLOPS "
                                      "BF16, 1,640 GB/s"),
}


def peaks(device_kind: str) -> Peaks | None:
    """The peaks of a device kind (jax's device_kind); None for one not in the table."""
    for name, known in PEAKS.items():
        if name in device_kind:
            return known
    return None
