"""Configuration dataclasses for the KV cache and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache.

    Block 0 of the device pool is the reserved null block: padding entries in
    block tables and slot mappings point there, so `num_blocks` counts it and
    `num_blocks - 1` blocks hold real KV.

    share_blocks: whether a forked sequence (a parallel sample, a beam) shares
    its parent's blocks, copy-on-write, or copies all of them before its first
    write. False is the no-sharing baseline of the paper's memory comparison;
    the prefix cache shares blocks across requests either way.
    sliding_window: W when every layer of the model sees only its last W keys:
    the blocks that fall out of a sequence's window go back to the pool. None
    keeps every block.
    max_num_batched_tokens: the most tokens of a sequence one step computes (the
    scheduler's budget): a windowed sequence holds at most
    cdiv(sliding_window - 1 + it, block_size) + 1 blocks at once, what admission asks.
    """

    block_size: int = 16
    num_blocks: int = 1024
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    share_blocks: bool = True
    sliding_window: int | None = None
    max_num_batched_tokens: int = 2048

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler step.

    max_num_batched_tokens is the single token budget shared by decodes (one
    token each) and prefill chunks.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
