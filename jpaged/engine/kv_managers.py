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
    or one group that keeps every block (`disable_hybrid_kv_cache_manager`, which an Orca
    allocation turns on: jpaged.core.step_modes). config: resolved against these
    layer windows (`EngineConfig.with_machine_defaults`)."""
    return KVCacheGroups.of(layer_windows, free_windows=not config.disable_hybrid_kv_cache_manager)


def make_kv_manager(config: EngineConfig, num_blocks: int, num_host_blocks: int,
                    max_model_len: int, groups: KVCacheGroups) -> KVManager:
    """Paged blocks over the KV cache groups, or Orca's reservations on them
    (`allocation`, one group). config: resolved, so prefix caching is off under Orca
    (jpaged.core.step_modes)."""
    cache_config = CacheConfig(
        block_size=config.block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        share_blocks=config.share_blocks, sliding_window=groups.windows[0],
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    if config.allocation != "paged":
        return ReservingBlockManager(cache_config, config.allocation, max_model_len)
    return BlockManager(cache_config, groups, max_model_len=max_model_len)
