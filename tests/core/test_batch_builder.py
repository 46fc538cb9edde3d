"""The batch builder against a brute-force oracle written with plain loops."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig
from jpaged.core.batch_builder import NO_ADAPTER, build_model_input
from jpaged.core.step_shapes import BucketSizes, sampler_rows
from jpaged.memory.block_manager import BlockManager, BlockTable
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


class FixedTables:
    """tables: seq_id -> its table in each of num_groups KV cache groups."""

    def __init__(self, block_size, num_groups, tables):
        self.block_size, self.num_groups, self.tables = block_size, num_groups, tables

    def block_tables(self, seq):
        return tuple(BlockTable(table) for table in self.tables[seq.seq_id])


def padded_size(n, minimum, linear_step=0):
    """The smallest power of two >= max(n, minimum), or past linear_step its smallest
    multiple that is, counted up one by one."""
    size = 1
    while size < max(n, minimum):
        size = size + linear_step if 0 < linear_step <= size else size * 2
    return size


def oracle(scheduled, tables, block_size, buckets, min_rows=0):
    """Every array built entry by entry, padding per jpaged.core.attention_metadata."""
    num_tokens = sum(n for _, n in scheduled)
    context_lens = [seq.num_computed_tokens + n for seq, n in scheduled]
    blocks = [-(-length // block_size) for length in context_lens]
    # Rows cover the draws. A decode-only step has as many token rows as sequence
    # rows; a mixed one pads its tokens alone and its rows to at least mixed_num_seqs.
    rows = max(len(scheduled), min_rows)
    logit_rows = padded_size(rows, buckets.min_num_seqs, buckets.linear_step)
    if num_tokens == len(scheduled):
        padded_seqs = logit_rows
        padded_tokens = padded_size(max(num_tokens, padded_seqs), buckets.min_num_tokens,
                                    buckets.linear_step)
    else:
        padded_seqs = max(logit_rows, buckets.mixed_num_seqs)
        padded_tokens = padded_size(num_tokens, max(buckets.min_num_tokens,
                                                    buckets.mixed_min_tokens),
                                    buckets.mixed_token_step or buckets.linear_step)
    padded_blocks = padded_size(max(blocks, default=0), buckets.min_blocks_per_seq)
    out = {
        "input_ids": [0] * padded_tokens,
        "positions": [0] * padded_tokens,
        "slot_mapping": [[t % block_size for t in range(padded_tokens)]
                         for _ in range(tables.num_groups)],
        "block_tables": [[[0] * padded_blocks for _ in range(padded_seqs)]
                         for _ in range(tables.num_groups)],
        "context_lens": [0] * padded_seqs,
        "query_start_loc": [num_tokens] * (padded_seqs + 1),
        "logits_indices": [0] * padded_seqs,
        "num_rows": logit_rows,
    }
    out["query_start_loc"][0] = token = 0
    for i, (seq, n) in enumerate(scheduled):
        group_tables = tables.tables[seq.seq_id]
        for g, table in enumerate(group_tables):
            for j in range(blocks[i]):
                out["block_tables"][g][i][j] = table[j]
        for position in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            out["input_ids"][token] = seq.token_ids[position]
            out["positions"][token] = position
            for g, table in enumerate(group_tables):
                out["slot_mapping"][g][token] = (
                    table[position // block_size] * block_size + position % block_size
                )
            token += 1
        out["context_lens"][i] = context_lens[i]
        out["query_start_loc"][i + 1] = token
        out["logits_indices"][i] = token - 1
    return out


@st.composite
def schedules(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_groups = draw(st.integers(1, 3))
    scheduled, tables = [], {}
    free_blocks = iter(draw(st.permutations(range(1, 1200))))
    for seq_id in range(draw(st.integers(0, 9))):
        num_prompt = draw(st.integers(1, 40))
        num_output = draw(st.integers(0, 8))
        tokens = draw(
            st.lists(
                st.integers(0, 1000),
                min_size=num_prompt + num_output,
                max_size=num_prompt + num_output,
            )
        )
        seq = Sequence(seq_id, tokens[:num_prompt], tokens[num_prompt:])
        seq.num_computed_tokens = draw(st.integers(0, len(seq) - 1))
        num_new = draw(st.integers(1, len(seq) - seq.num_computed_tokens))
        spare = draw(st.integers(0, 2))  # tables may hold blocks beyond this step's context
        tables[seq_id] = [[next(free_blocks) for _ in range(-(-len(seq) // block_size) + spare)]
                          for _ in range(num_groups)]
        scheduled.append((seq, num_new))
    buckets = BucketSizes(*draw(st.tuples(*[st.integers(1, 20)] * 3)),
                          linear_step=draw(st.sampled_from([0, 4, 8, 16])),
                          mixed_num_seqs=draw(st.sampled_from([0, 1, 8, 16, 24])),
                          mixed_min_tokens=draw(st.sampled_from([0, 4, 16])),
                          mixed_token_step=draw(st.sampled_from([0, 8, 32])))
    min_rows = draw(st.integers(0, 12))  # parallel samples draw more rows than sequences
    return scheduled, FixedTables(block_size, num_groups, tables), buckets, min_rows


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_matches_brute_force_oracle(schedule):
    scheduled, tables, buckets, min_rows = schedule
    model_input = build_model_input(scheduled, tables, buckets, min_rows)
    expected = oracle(scheduled, tables, tables.block_size, buckets, min_rows)
    metadata = model_input.metadata
    assert model_input.num_rows == expected.pop("num_rows")
    arrays = {"input_ids": model_input.input_ids, **metadata._asdict()}
    for name, want in expected.items():
        assert arrays[name].dtype == np.int32, name
        np.testing.assert_array_equal(arrays[name], np.array(want), err_msg=name)
    assert model_input.num_tokens == sum(n for _, n in scheduled)
    assert model_input.num_seqs == len(scheduled)


def test_through_a_block_manager_after_copy_on_write():
    manager = BlockManager(CacheConfig(block_size=4, num_blocks=16, watermark=0.0))
    parent = Sequence(0, list(range(6)))
    group = SequenceGroup("a", [parent])
    manager.allocate(group)
    manager.append_slots(parent, 6)
    parent.num_computed_tokens, parent.status = 6, SequenceStatus.RUNNING
    parent.append_token(42)
    child = Sequence(1, list(range(6)), [43], SequenceStatus.RUNNING, 6)
    manager.fork(parent, child)
    scheduled = [(parent, 1), (child, 1)]
    for seq, n in scheduled:
        manager.append_slots(seq, n)
    metadata = build_model_input(scheduled, manager, BucketSizes(1, 1, 1)).metadata
    parent_table, child_table = manager.block_table(parent), manager.block_table(child)
    assert parent_table[0] == child_table[0] and parent_table[1] != child_table[1]
    np.testing.assert_array_equal(metadata.block_tables, [[parent_table, child_table]])
    np.testing.assert_array_equal(
        metadata.slot_mapping, [[parent_table[1] * 4 + 2, child_table[1] * 4 + 2]]
    )
    np.testing.assert_array_equal(metadata.context_lens, [7, 7])


def test_bucket_minimums_must_be_positive():
    with pytest.raises(ValueError, match="min_num_seqs must be >= 1, got 0"):
        BucketSizes(min_num_seqs=0)


@given(st.integers(1, 600), st.integers(1, 600))
def test_sampler_rows_are_few_powers_of_eight_covering_the_draws(num_draws, max_rows):
    padded = sampler_rows(num_draws, max_rows)
    powers_of_eight = [8**k for k in range(5)]
    smallest_power = min(p for p in powers_of_eight if p >= num_draws)
    assert padded >= num_draws
    assert padded == (num_draws if num_draws > max_rows else min(smallest_power, max_rows))


# ---- adapter slots (LoRA's extension point) ---------------------------------------------


def adapter_oracle(scheduled, padded_tokens, slot_of):
    """Each new token's sequence's slot, token by token, NO_ADAPTER for the padding; None
    when no sequence has an adapter."""
    slots = [NO_ADAPTER] * padded_tokens
    token = 0
    for seq, n in scheduled:
        for _ in range(n):
            slot = slot_of(seq)
            slots[token] = NO_ADAPTER if slot is None else slot
            token += 1
    return slots if any(slot != NO_ADAPTER for slot in slots) else None


@settings(max_examples=25, deadline=None)
@given(schedules(), st.lists(st.sampled_from([None, NO_ADAPTER, 1, 2, 7]), min_size=10,
                             max_size=10))
def test_each_token_gets_its_sequences_adapter_slot(schedule, slots):
    scheduled, tables, buckets, min_rows = schedule
    slot_of = {seq.seq_id: slot for (seq, _), slot in zip(scheduled, slots[:len(scheduled)],
                                                          strict=True)}
    model_input = build_model_input(scheduled, tables, buckets, min_rows,
                                    adapter_slot_of=lambda seq: slot_of[seq.seq_id])
    expected = adapter_oracle(scheduled, len(model_input.input_ids),
                              lambda seq: slot_of[seq.seq_id])
    if expected is None:
        assert model_input.adapter_slots is None
    else:
        assert model_input.adapter_slots.dtype == np.int32
        np.testing.assert_array_equal(model_input.adapter_slots, expected)
    # The rest of the step's inputs are those of a step without adapters.
    plain = build_model_input(scheduled, tables, buckets, min_rows)
    assert plain.adapter_slots is None
    np.testing.assert_array_equal(model_input.input_ids, plain.input_ids)
    for name, array in plain.metadata._asdict().items():
        np.testing.assert_array_equal(getattr(model_input.metadata, name), array, err_msg=name)


@pytest.mark.parametrize("decode_only", [True, False])
def test_adapter_slots_of_decode_and_mixed_steps(decode_only):
    seqs = [Sequence(i, list(range(5)), [9, 9]) for i in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = len(seq) - 1 if decode_only else 2
    scheduled = [(seq, len(seq) - seq.num_computed_tokens) for seq in seqs]
    tables = FixedTables(4, 1, {i: [[i + 1, i + 4]] for i in range(3)})
    slot_of = {0: 3, 1: None, 2: 1}
    model_input = build_model_input(scheduled, tables, BucketSizes(1, 1, 1),
                                    adapter_slot_of=lambda seq: slot_of[seq.seq_id])
    assert model_input.decode_only == decode_only
    per_seq = [3, NO_ADAPTER, 1]
    real = [slot for slot, (_, n) in zip(per_seq, scheduled, strict=True) for _ in range(n)]
    padding = [NO_ADAPTER] * (len(model_input.input_ids) - len(real))
    np.testing.assert_array_equal(model_input.adapter_slots, real + padding)
    without = build_model_input(scheduled, tables, BucketSizes(1, 1, 1),
                                adapter_slot_of=lambda seq: None)
    assert without.adapter_slots is None
