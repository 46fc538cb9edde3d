"""The batch builder: one step's schedule -> padded int32 arrays for the device.

Runs on the host every step, so it does O(tokens + blocks of the scheduled
sequences) work, vectorised with numpy. Shapes are bucketed
(jpaged.core.step_shapes) so the jit-compiled step sees few distinct shapes;
padding follows jpaged.core.attention_metadata (null block 0, empty padding
sequences).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jpaged._deprecation import moved_names
from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.step_shapes import BucketSizes, bucket, padded_sizes
from jpaged.memory.block_table import BlockTable
from jpaged.sequence import Sequence

__getattr__ = moved_names(__name__, {name: "jpaged.core.step_shapes"
                                     for name in ("bucket", "padded_sizes", "sampler_rows")})


DEFAULT_BUCKETS = BucketSizes()
# The adapter slot of a token without an adapter (a request of the base model, and
# padding): slot 0 is reserved, as block 0 is, so that an adapter table's row 0 can
# hold an adapter of zeros and every token gathers a row without a branch.
NO_ADAPTER = 0


class BlockTables(Protocol):
    block_size: int
    num_groups: int

    def block_tables(self, seq: Sequence) -> tuple[BlockTable, ...]:
        """seq's table in each KV cache group."""


@dataclass(frozen=True)
class ModelInput:
    """One step's device inputs.

    input_ids: int32 [T]  token ids (0 for padding tokens).
    metadata:  the step's AttentionMetadata (numpy int32 arrays).
    num_tokens, num_seqs: the real (unpadded) counts.
    num_rows:  the padded rows of logits the step needs (<= R): the first
               num_rows entries of metadata.logits_indices.
    proposal_rows: int32 [num_seqs] the logits row of each sequence's first
               proposal (its others follow it), -1 where it has none.
    adapter_slots: int32 [T] the adapter slot of each token's sequence (LoRA),
               NO_ADAPTER for padding tokens and sequences without one; None when
               no sequence of the step has an adapter, so that steps without
               adapters keep the inputs they had.
    """

    input_ids: np.ndarray
    metadata: AttentionMetadata
    num_tokens: int
    num_seqs: int
    num_rows: int
    proposal_rows: np.ndarray
    adapter_slots: np.ndarray | None = None

    @property
    def decode_only(self) -> bool:
        """One new token per sequence: the step the paged decode kernel serves."""
        return self.num_tokens == self.num_seqs


def build_model_input(
    scheduled: SequenceOf[tuple[Sequence, int]],
    block_tables: BlockTables,
    buckets: BucketSizes = DEFAULT_BUCKETS,
    min_rows: int = 0,
    num_speculative_tokens: int = 0,
    adapter_slot_of: Callable[[Sequence], int | None] | None = None,
) -> ModelInput:
    """Padded device inputs for one step.

    scheduled: (seq, num_new_tokens) pairs; seq feeds its tokens
               seq.num_computed_tokens .. + num_new_tokens - 1 (past its end, its
               proposals: seq.spec_token_ids), and its block table already holds
               slots for them (BlockManager.append_slots).
    min_rows:  sequence rows to pad to at least: the step's draws when parallel
               samples draw several tokens from one sequence's logits.
    num_speculative_tokens: k of speculative decoding (0: off). A step of decodes
               with proposals among them takes the shape of its rows' bucket times
               1 + k tokens; every step then has logits rows for proposals after
               those of the sequences' last tokens (`ModelInput.proposal_rows`).
    adapter_slot_of: each sequence's adapter slot (None or NO_ADAPTER: none), given
               to its tokens as `ModelInput.adapter_slots`; None: no adapters.
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

    # New tokens past a sequence's end are its proposals (speculative decoding only).
    num_proposals = np.zeros(num_seqs, np.int32)
    if num_speculative_tokens:
        lens = np.fromiter((len(seq) for seq in seqs), np.int32, num_seqs)
        num_proposals = np.maximum(starts + q_lens - lens, 0)
    verifying = bool(num_proposals.any())
    padded_tokens, padded_seqs, padded_rows = padded_sizes(
        num_tokens, max(num_seqs, min_rows), buckets, decode_only=num_tokens == num_seqs,
        speculative_tokens=num_speculative_tokens if verifying and _all_decodes(
            seqs, starts) else 0)
    padded_blocks = bucket(int(num_blocks.max(initial=0)), buckets.min_blocks_per_seq)

    tables = np.zeros((block_tables.num_groups, padded_seqs, padded_blocks), np.int32)
    seq_tables = block_tables.block_tables
    for row, (seq, n) in enumerate(zip(seqs, num_blocks.tolist(), strict=True)):
        for group, table in enumerate(seq_tables(seq)):
            tables[group, row, :n] = table.prefix(n)

    query_start_loc = np.full(padded_seqs + 1, num_tokens, np.int32)
    query_start_loc[0] = 0
    np.cumsum(q_lens, out=query_start_loc[1 : num_seqs + 1])

    owner = np.repeat(np.arange(num_seqs), q_lens)
    real_positions = np.arange(num_tokens) - query_start_loc[owner] + starts[owner]
    positions = np.zeros(padded_tokens, np.int32)
    positions[:num_tokens] = real_positions
    # Padding tokens write to slots 0..block_size-1: the null block.
    slot_mapping = np.tile(np.arange(padded_tokens, dtype=np.int32) % block_size,
                           (block_tables.num_groups, 1))
    slot_mapping[:, :num_tokens] = (
        tables[:, owner, real_positions // block_size] * block_size
        + real_positions % block_size
    )

    input_ids = np.zeros(padded_tokens, np.int32)
    input_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(_new_token_ids(seq, n) for seq, n in scheduled),
        np.int32,
        num_tokens,
    )
    num_logit_rows = padded_seqs * (1 + num_speculative_tokens) if num_speculative_tokens \
        else padded_seqs
    logits_indices = np.zeros(num_logit_rows, np.int32)
    logits_indices[:num_seqs] = query_start_loc[1 : num_seqs + 1] - 1
    # A sequence's proposals are its new tokens 1 .. p; the logits at token j (its
    # last computed token, then each proposal) check proposal j + 1.
    proposal_rows = np.full(num_seqs, -1, np.int32)
    if verifying:
        first_rows = padded_rows + np.cumsum(num_proposals) - num_proposals
        proposal_rows[num_proposals > 0] = first_rows[num_proposals > 0]
        checked = np.repeat(query_start_loc[:num_seqs], num_proposals)
        offsets = np.arange(len(checked)) - np.repeat(first_rows - padded_rows, num_proposals)
        logits_indices[padded_rows : padded_rows + len(checked)] = checked + offsets
        padded_rows = min(bucket(padded_rows + len(checked), 1), num_logit_rows)
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
    return ModelInput(input_ids, metadata, num_tokens, num_seqs, padded_rows, proposal_rows,
                      _adapter_slots(seqs, q_lens, padded_tokens, adapter_slot_of))


def _adapter_slots(seqs: list[Sequence], q_lens: np.ndarray, padded_tokens: int,
                   adapter_slot_of: Callable[[Sequence], int | None] | None
                   ) -> np.ndarray | None:
    """int32 [padded_tokens]: each new token's sequence's adapter slot, NO_ADAPTER for
    padding; None if no sequence has an adapter."""
    if adapter_slot_of is None:
        return None
    slots = np.array([NO_ADAPTER if (slot := adapter_slot_of(seq)) is None else slot
                      for seq in seqs], np.int32)
    if (slots == NO_ADAPTER).all():
        return None
    token_slots = np.full(padded_tokens, NO_ADAPTER, np.int32)
    token_slots[: int(q_lens.sum())] = np.repeat(slots, q_lens)
    return token_slots


def _all_decodes(seqs: list[Sequence], starts: np.ndarray) -> bool:
    """Whether every sequence computes its last token (and any proposals) only."""
    return all(len(seq) - 1 == start for seq, start in zip(seqs, starts.tolist(), strict=True))


def _new_token_ids(seq: Sequence, num_new_tokens: int) -> list[int]:
    """The ids of seq's next num_new_tokens tokens: its own, then its proposals."""
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
    if end <= len(seq):
        return seq.token_slice(start, end)
    return seq.token_slice(start, len(seq)) + seq.spec_token_ids[: end - len(seq)]
