"""What the machine gives an engine: its default limits, and the memory it has free."""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class MachineDefaults:
    """The limits an engine takes when its config leaves them as None."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_fraction: float
    num_decode_steps: int


# A CPU runs a step's matrix products on a few cores: a 256-token budget keeps
# decode steps of 64 sequences short enough to interleave with prefill chunks.
# The pool there is bounded by the weights (see `kv_cache_budget`).
CPU_DEFAULTS = MachineDefaults(max_num_seqs=64, max_num_batched_tokens=256,
                               kv_cache_fraction=0.25, num_decode_steps=1)
# vLLM's defaults on an accelerator (its gpu_memory_utilization is 0.9).
ACCELERATOR_DEFAULTS = MachineDefaults(max_num_seqs=256, max_num_batched_tokens=2048,
                                       kv_cache_fraction=0.9, num_decode_steps=1)


def on_accelerator() -> bool:
    """Whether this process's first device reports its own memory (a GPU or TPU, not the
    host). Only a process's own devices report memory: on several hosts
    `jax.devices()[0]` belongs to process 0."""
    stats = jax.local_devices()[0].memory_stats()
    return bool(stats) and "bytes_limit" in stats


def machine_defaults() -> MachineDefaults:
    return ACCELERATOR_DEFAULTS if on_accelerator() else CPU_DEFAULTS


def free_device_memory(device: jax.Device | None = None) -> int:
    """Bytes free on `device`, by default this process's first device (free host RAM when
    the device is a CPU)."""
    stats = (device or jax.local_devices()[0]).memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return available_host_memory()


def total_device_memory(device: jax.Device | None = None) -> int:
    """Bytes `device` has in all, by default this process's first device (the host's RAM
    when the device is a CPU)."""
    stats = (device or jax.local_devices()[0]).memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_host_memory() -> int:
    """Bytes of host RAM a new allocation can get: Linux's MemAvailable, which counts the
    page cache the kernel drops on demand (right after reading a checkpoint, most of
    the free RAM is page cache); elsewhere the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
