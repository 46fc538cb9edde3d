"""A paged KV pool driven by hand: scattered block tables and one jitted model step.

JAX and flax are imported on the first model step, not with this plugin, so that the
host-only tests run without them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pytest

from jpaged.core.attention_metadata import AttentionMetadata


@dataclass
class PagedCacheBook:
    """Host-side block tables for tests: every sequence takes its blocks in the order of a
    random permutation of the pool (block 0 stays the null block), so logically adjacent
    blocks are physically scattered.
    """

    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    seed: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    free: list[int] = field(init=False)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        self.free = [int(b) for b in rng.permutation(np.arange(1, self.num_blocks))]

    def step(
        self, chunks: list[tuple[int, list[int]]], num_tokens: int, num_seqs: int
    ) -> tuple[np.ndarray, AttentionMetadata]:
        """Append each (seq_id, new_tokens) chunk to its sequence; padded to num_tokens tokens
        and num_seqs sequences. Returns (input_ids int32 [num_tokens], metadata)."""
        assert sum(len(t) for _, t in chunks) <= num_tokens and len(chunks) <= num_seqs
        ids, slots, positions, context_lens, starts = [], [], [], [], [0]
        tables = np.zeros((num_seqs, self.max_blocks_per_seq), np.int32)
        for row, (seq_id, tokens) in enumerate(chunks):
            start = self.lengths.get(seq_id, 0)
            table = self.tables.setdefault(seq_id, [])
            for pos in range(start, start + len(tokens)):
                block, offset = divmod(pos, self.block_size)
                if block == len(table):
                    table.append(self.free.pop())
                slots.append(table[block] * self.block_size + offset)
                positions.append(pos)
            self.lengths[seq_id] = start + len(tokens)
            ids += tokens
            context_lens.append(self.lengths[seq_id])
            starts.append(starts[-1] + len(tokens))
            tables[row, : len(table)] = table
        logits_indices = [end - 1 for end in starts[1:]]
        padding = num_tokens - len(ids)
        pad_seqs = num_seqs - len(chunks)
        metadata = AttentionMetadata(
            slot_mapping=np.array([slots + [i % self.block_size for i in range(padding)]],
                                  np.int32),
            positions=np.array(positions + [0] * padding, np.int32),
            block_tables=tables[None],
            context_lens=np.array(context_lens + [0] * pad_seqs, np.int32),
            query_start_loc=np.array(starts + [starts[-1]] * pad_seqs, np.int32),
            logits_indices=np.array(logits_indices + [0] * pad_seqs, np.int32),
        )
        return np.array(ids + [0] * padding, np.int32), metadata


@pytest.fixture
def paged_cache_book():
    return PagedCacheBook


def _model_step(graphdef, state, input_ids, kv_cache, metadata):
    """The runner's path through the model with the reference kernels: logits f32 [B, vocab]
    at metadata.logits_indices, and the updated cache."""
    from flax import nnx

    model = nnx.merge(graphdef, state)
    hidden, kv_cache = model.hidden_states(input_ids, kv_cache, metadata)
    return model.compute_logits(hidden[metadata.logits_indices]), kv_cache


@functools.cache
def _jitted_model_step():
    import jax

    return jax.jit(_model_step, static_argnums=0, donate_argnums=3)


def model_step(graphdef, state, input_ids, kv_cache, metadata):
    """One jitted model step, the cache donated: model_step(*nnx.split(model), input_ids, ...)."""
    return _jitted_model_step()(graphdef, state, input_ids, kv_cache, metadata)
