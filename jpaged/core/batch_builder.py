"""The batch builder: one step's schedule -> padded int32 arrays for the device.

Runs on the host every step, so it does O(tokens + blocks of the scheduled
sequences) work, vectorised with numpy. Shapes are bucketed to powers of two
(with minimums) so the jit-compiled step sees few distinct shapes; padding
follows jpaged.core.attention_metadata (null block 0, empty padding sequences).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.memory.block_manager import BlockTable
from jpaged.sequence import Sequence


class BlockTables(Protocol):
    block_size: int

    def block_table(self, seq: Sequence) -> BlockTable: ...


@dataclass(frozen=True)
class BucketSizes:
    """Smallest padded sizes; a padded size is the next power of two >= max(actual, minimum).

    linear_step > 0 pads token and sequence counts past it to a multiple of it
    instead: 48 rather than 64 rows for 33 sequences, fewer wasted rows for
    more compiled shapes (worth it where rows cost compute, as on CPUs).

    mixed_num_seqs > 0 pads the sequence rows of every mixed step (more tokens
    than sequences) to at least this many, so mixed steps vary by token count
    alone: one compiled shape per token bucket instead of one per (tokens, rows)
    pair. Padding rows are empty sequences, which the attention skips, and the
    logits are still taken for the rows in use only (`ModelInput.num_rows`).

    mixed_min_tokens and mixed_token_step > 0 pad a mixed step's tokens to at least
    mixed_min_tokens and, past mixed_token_step, to a multiple of it (else the
    token buckets of decode steps): a mixed step's tokens vary more than a decode
    step's rows, so coarser buckets there save compiles for little padding.
    """

    min_num_tokens: int = 16
    min_num_seqs: int = 8
    min_blocks_per_seq: int = 8
    linear_step: int = 0
    mixed_num_seqs: int = 0
    mixed_min_tokens: int = 0
    mixed_token_step: int = 0

    def __post_init__(self):
        for name in ("min_num_tokens", "min_num_seqs", "min_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("linear_step", "mixed_num_seqs", "mixed_min_tokens", "mixed_token_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelInput:
    """One step's device inputs.

    input_ids: int32 [T]  token ids (0 for padding tokens).
    metadata:  the step's AttentionMetadata (numpy int32 arrays).
    num_tokens, num_seqs: the real (unpadded) counts.
    num_rows:  the padded rows of logits the step needs (<= B): the first
               num_rows entries of metadata.logits_indices.
    """

    input_ids: np.ndarray
    metadata: AttentionMetadata
    num_tokens: int
    num_seqs: int
    num_rows: int

    @property
    def decode_only(self) -> bool:
        """One new token per sequence: the step the paged decode kernel serves."""
        return self.num_tokens == self.num_seqs


def bucket(n: int, minimum: int, linear_step: int = 0) -> int:
    """Next power of two >= max(n, minimum); past linear_step (if > 0), next multiple of it."""
    size = max(n, minimum)
    if 0 < linear_step < size:
        return -(-size // linear_step) * linear_step
    return 1 << (size - 1).bit_length()


def padded_sizes(
    num_tokens: int, num_rows: int, buckets: BucketSizes, decode_only: bool
) -> tuple[int, int, int]:
    """(padded tokens, padded sequence rows, padded logit rows) of a step.

    Logit rows are the bucket of num_rows. A decode-only step has as many token
    rows as sequence rows; a mixed step pads its tokens on their own, and its
    sequence rows to at least buckets.mixed_num_seqs.
    """
    logit_rows = bucket(num_rows, buckets.min_num_seqs, buckets.linear_step)
    if decode_only:
        tokens = bucket(max(num_tokens, logit_rows), buckets.min_num_tokens, buckets.linear_step)
        return tokens, logit_rows, logit_rows
    tokens = bucket(num_tokens, max(buckets.min_num_tokens, buckets.mixed_min_tokens),
                    buckets.mixed_token_step or buckets.linear_step)
    return tokens, max(logit_rows, buckets.mixed_num_seqs), logit_rows


def sampler_rows(num_draws: int, max_rows: int) -> int:
    """Padded rows of the sampler: the next power of 8 >= num_draws, at most max_rows
    (but never below num_draws). A padding row costs the sampler little next to a
    model step, while each row count compiles the sampler's variants anew."""
    size = 1
    while size < num_draws:
        size *= 8
    return max(num_draws, min(size, max_rows))


def build_model_input(
    scheduled: SequenceOf[tuple[Sequence, int]],
    block_tables: BlockTables,
    buckets: BucketSizes = BucketSizes(),
    min_rows: int = 0,
) -> ModelInput:
    """Padded device inputs for one step.

    scheduled: (seq, num_new_tokens) pairs; seq feeds its tokens
               seq.num_computed_tokens .. + num_new_tokens - 1, and its block
               table already holds slots for them (BlockManager.append_slots).
    min_rows:  sequence rows to pad to at least: the step's draws when parallel
               samples draw several tokens from one sequence's logits.
    """
    block_size = block_tables.block_size
    num_seqs = len(scheduled)
    seqs = [seq for seq, _ in scheduled]
    q_lens = np.fromiter((n for _, n in scheduled), np.int32, num_seqs)
    starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, num_seqs)
    assert (q_lens >= 1).all(), "every scheduled sequence feeds at least one token"
    context_lens = starts + q_lens
    num_blocks = -(-context_lens // block_size)
    num_tokens = int(q_lens.sum())

    padded_tokens, padded_seqs, padded_rows = padded_sizes(
        num_tokens, max(num_seqs, min_rows), buckets, decode_only=num_tokens == num_seqs
    )
    padded_blocks = bucket(int(num_blocks.max(initial=0)), buckets.min_blocks_per_seq)

    tables = np.zeros((padded_seqs, padded_blocks), np.int32)
    block_table = block_tables.block_table
    for row, (seq, n) in enumerate(zip(seqs, num_blocks.tolist(), strict=True)):
        tables[row, :n] = block_table(seq).prefix(n)

    query_start_loc = np.full(padded_seqs + 1, num_tokens, np.int32)
    query_start_loc[0] = 0
    np.cumsum(q_lens, out=query_start_loc[1 : num_seqs + 1])

    owner = np.repeat(np.arange(num_seqs), q_lens)
    real_positions = np.arange(num_tokens) - query_start_loc[owner] + starts[owner]
    positions = np.zeros(padded_tokens, np.int32)
    positions[:num_tokens] = real_positions
    # Padding tokens write to slots 0..block_size-1: the null block.
    slot_mapping = np.arange(padded_tokens, dtype=np.int32) % block_size
    slot_mapping[:num_tokens] = (
        tables[owner, real_positions // block_size] * block_size + real_positions % block_size
    )

    input_ids = np.zeros(padded_tokens, np.int32)
    input_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(
            seq.token_slice(seq.num_computed_tokens, seq.num_computed_tokens + n)
            for seq, n in scheduled
        ),
        np.int32,
        num_tokens,
    )
    logits_indices = np.zeros(padded_seqs, np.int32)
    logits_indices[:num_seqs] = query_start_loc[1 : num_seqs + 1] - 1
    padded_context_lens = np.zeros(padded_seqs, np.int32)
    padded_context_lens[:num_seqs] = context_lens

    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        positions=positions,
        block_tables=tables,
        context_lens=padded_context_lens,
        query_start_loc=query_start_loc,
        logits_indices=logits_indices,
    )
    return ModelInput(input_ids, metadata, num_tokens, num_seqs, padded_rows)
