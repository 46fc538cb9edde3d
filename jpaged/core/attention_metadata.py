"""The padded int32 index arrays one device step consumes.

The host builds them once per step; the device step reads K/V through them.
All arrays are padded to power-of-two buckets so the jit-compiled step sees a
small, fixed set of shapes. Padding points at the reserved null block 0:

- `block_tables` rows of padding sequences are all 0, and entries past a
  sequence's last block are 0.
- `slot_mapping` entries of padding tokens are 0..block_size-1 (slots of the
  null block), so writing their K/V is harmless and never read back.
- Padding sequences have `context_lens == 0` and an empty query range
  (`query_start_loc[i] == query_start_loc[i + 1]`).

A NamedTuple is a JAX pytree without registration, so this module needs no jax:
the host side builds numpy arrays and jit moves them to the device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class AttentionMetadata(NamedTuple):
    """Index arrays of one step (G = KV cache groups, B = padded sequences, T = padded
    tokens).

    Numpy arrays on the host; inside a jitted step the same fields hold jax arrays.
    Each layer reads its group's row g of slot_mapping and block_tables
    (jpaged.memory.kv_cache_groups); a model without groups has G = 1.

    slot_mapping:    int32 [G, T]  flat cache slot of each new token in each group
                     (physical_block * block_size + offset).
    positions:       int32 [T]  position of each new token in its sequence.
    block_tables:    int32 [G, B, max_blocks_per_seq]  logical -> physical block.
    context_lens:    int32 [B]  tokens in the cache for each sequence after this
                     step's writes (cached prefix + new tokens).
    query_start_loc: int32 [B + 1]  sequence i owns new tokens
                     query_start_loc[i]:query_start_loc[i + 1]; its queries sit at
                     positions context_lens[i] - q_len .. context_lens[i] - 1.
    logits_indices:  int32 [B]  index into T of each sequence's last new token
                     (0 for padding sequences).
    adapter_slots:   int32 [T]  the LoRA adapter slot of each new token (0: the base
                     model, and padding); None for a model without adapter slots.
    """

    slot_mapping: np.ndarray
    positions: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    adapter_slots: np.ndarray | None = None
