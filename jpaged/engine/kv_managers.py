"""The KV cache manager an engine's config asks for: how the model's layers share the pool
(its KV cache groups) and who hands out its blocks (paged, or Orca's reservations)."""

from __future__ import annotations

from jpaged.config import CacheConfig
from jpaged.engine.config import EngineConfig
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.reserving_block_manager import ReservingBlockManager

KVManager = BlockManager | ReservingBlockManager


def kv_cache_groups(config: EngineConfig, layer_windows: tuple[int | None, ...]
                    ) -> KVCacheGroups:
    """How the model's layers share the pool: groups whose sliding windows free blocks,
    or, with `disable_hybrid_kv_cache_manager`, one group that keeps every block.

    Raises ValueError for an Orca allocation of a model with a sliding window unless
    every block is kept: a reservation holds a sequence's blocks until it ends.
    """
    keep_every_block = config.disable_hybrid_kv_cache_manager
    if config.allocation != "paged" and not keep_every_block and any(
            window is not None for window in layer_windows):
        raise ValueError(
            f"allocation={config.allocation!r} reserves every block of a sequence, so it "
            "cannot free a sliding window's blocks: set disable_hybrid_kv_cache_manager=True "
            "to run this sliding-window model with every block kept")
    return KVCacheGroups.of(layer_windows, free_windows=not keep_every_block)


def make_kv_manager(config: EngineConfig, num_blocks: int, max_model_len: int,
                    groups: KVCacheGroups) -> KVManager:
    """Paged blocks over the KV cache groups, or Orca's reservations on them
    (`allocation`, one group)."""
    cache_config = CacheConfig(
        block_size=config.block_size, num_blocks=num_blocks,
        num_host_blocks=config.num_host_blocks,
        enable_prefix_caching=config.enable_prefix_caching and config.allocation == "paged",
        share_blocks=config.share_blocks, sliding_window=groups.windows[0],
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    if config.allocation != "paged":
        return ReservingBlockManager(cache_config, config.allocation, max_model_len)
    return BlockManager(cache_config, groups)
