"""Old home of HybridBlockManager, kept for one release: `BlockManager(cache_config,
groups)` (jpaged.memory.block_manager) serves one KV cache group or several."""

from __future__ import annotations

from jpaged._deprecation import moved_names

__getattr__ = moved_names(__name__, {
    "HybridBlockManager": "jpaged.memory.block_manager:BlockManager"})
