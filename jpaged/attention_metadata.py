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
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Index arrays of one step (B = padded sequences, T = padded tokens).

    slot_mapping:    int32 [T]  flat cache slot of each new token
                     (physical_block * block_size + offset).
    positions:       int32 [T]  position of each new token in its sequence.
    block_tables:    int32 [B, max_blocks_per_seq]  logical -> physical block.
    context_lens:    int32 [B]  tokens in the cache for each sequence after this
                     step's writes (cached prefix + new tokens).
    query_start_loc: int32 [B + 1]  sequence i owns new tokens
                     query_start_loc[i]:query_start_loc[i + 1]; its queries sit at
                     positions context_lens[i] - q_len .. context_lens[i] - 1.
    logits_indices:  int32 [B]  index into T of each sequence's last new token
                     (0 for padding sequences).
    """

    slot_mapping: jax.Array | np.ndarray
    positions: jax.Array | np.ndarray
    block_tables: jax.Array | np.ndarray
    context_lens: jax.Array | np.ndarray
    query_start_loc: jax.Array | np.ndarray
    logits_indices: jax.Array | np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
