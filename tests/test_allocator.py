"""The functional allocator against a brute-force model made of Python lists.

The model keeps the free queue as a list (head first), the prefix cache as two
dicts, and the references the test holds as plain lists: a block's refcount
must equal how often the test holds it. Hashes and content keys come from small
sets, so equal hashes with different keys (collisions) are common. Misuse
(freeing or sharing a block nobody holds, copying an unshared one) must raise
and leave the transaction as it was.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.memory.allocator import AllocatorState, ChunkedArray, Transaction
from jpaged.memory.prefix_cache import NO_HASH

HASHES = st.integers(1, 12)
KEYS = st.tuples(st.integers(0, 2), st.sampled_from([None, "", "a"]), st.sampled_from([b"0", b"1"]))


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), num_host_blocks=st.integers(0, 6))
    def setup(self, num_blocks, num_host_blocks):
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.state = AllocatorState.create(num_blocks, num_host_blocks)
        self.txn = Transaction(self.state)
        self.snapshots = [self.snapshot(self.state)]
        # The model.
        self.free = list(range(1, num_blocks))
        self.host_free = list(range(num_host_blocks))
        self.hash_of: dict[int, int] = {}
        self.entry_of: dict[int, tuple] = {}  # hash -> (block, cache id, *key)
        self.next_cache_id = 1
        self.held: list[int] = []
        self.host_held: list[int] = []
        self.pinned: set[int] = set()
        self.host_pinned: set[int] = set()
        self.deferred: list[int] = []
        self.host_deferred: list[int] = []
        self.ops = {"swap_out": [], "swap_in": [], "copies": []}
        self.written: set[int] = set()  # device blocks this step's swap-in or copies write
        self.copied_from: dict[int, int] = {}  # this step's copy destination -> source

    @staticmethod
    def snapshot(state):
        arrays = (state.device.refcounts, state.device.next_free, state.block_hashes)
        return state, [a.to_numpy().copy() for a in arrays], state.hash_index.items()

    # Model helpers ---------------------------------------------------------------

    def model_take_head(self):
        block = self.free.pop(0)
        if block in self.hash_of:
            del self.entry_of[self.hash_of.pop(block)]
        return block

    def model_release(self, block):
        self.held.remove(block)
        if block not in self.held:
            (self.deferred if block in self.pinned else self.free).append(block)

    def model_release_host(self, block):
        self.host_held.remove(block)
        if block not in self.host_held:
            (self.host_deferred if block in self.host_pinned else self.host_free).append(block)

    # Rules ------------------------------------------------------------------------------

    @rule(num=st.integers(0, 4))
    def allocate(self, num):
        if num > len(self.free):
            with pytest.raises(ValueError, match="free device blocks"):
                self.txn.allocate(num)
            return
        expected = [self.model_take_head() for _ in range(num)]
        assert self.txn.allocate(num) == expected
        self.held += expected

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data):
        block = data.draw(st.sampled_from(self.held))
        self.txn.share(block)
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_one(self, data):
        block = data.draw(st.sampled_from(self.held))
        self.txn.free(block)
        self.model_release(block)

    @rule(block=st.integers(-2, 13))
    def free_or_share_unheld(self, block):
        """Misuse: a double free, or sharing a block nobody holds (or none at all)."""
        if block in self.held:
            return
        with pytest.raises(ValueError, match=f"device block {block} (is free|freed|is out)"):
            self.txn.free(block)
        with pytest.raises(ValueError, match=f"device block {block} (is free|is out)"):
            self.txn.share(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def copy_on_write_unshared(self, data):
        block = data.draw(st.sampled_from(self.held))
        if self.held.count(block) == 1:
            with pytest.raises(ValueError, match=f"device block {block} has 1 holders"):
                self.txn.copy_on_write(block, copy_content=True)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=HASHES, key=KEYS)
    def register(self, data, block_hash, key):
        block = data.draw(st.sampled_from(self.held))
        entry = self.entry_of.get(block_hash)
        if entry is not None:
            expected = entry[1] if entry[2:] == key else None  # a collision registers nothing
            assert self.txn.register(block, block_hash, *key) == expected
        elif block in self.hash_of:
            with pytest.raises(ValueError, match=f"block {block} is already cached"):
                self.txn.register(block, block_hash, *key)
        else:
            assert self.txn.register(block, block_hash, *key) == self.next_cache_id
            self.hash_of[block] = block_hash
            self.entry_of[block_hash] = (block, self.next_cache_id, *key)
            self.next_cache_id += 1

    @rule(block_hash=HASHES, key=KEYS)
    def prefix_hit(self, block_hash, key):
        entry = self.entry_of.get(block_hash)
        if entry is None or entry[2:] != key:
            assert self.txn.cached_block(block_hash, *key) is None
            return
        assert self.txn.cached_block(block_hash, *key) == entry
        block = entry[0]
        if block not in self.held:
            (self.deferred if block in self.deferred else self.free).remove(block)
        self.txn.take_cached(block)
        self.held.append(block)

    @precondition(lambda self: any(self.held.count(b) > 1 for b in self.held))
    @rule(data=st.data(), copy_content=st.booleans())
    def copy_on_write(self, data, copy_content):
        block = data.draw(st.sampled_from([b for b in self.held if self.held.count(b) > 1]))
        if not self.free:
            with pytest.raises(ValueError):
                self.txn.copy_on_write(block, copy_content)
            return
        private = self.model_take_head()
        assert self.txn.copy_on_write(block, copy_content) == private
        if copy_content:
            # Copies read before any writes: a filled block reads as its own source.
            source = self.copied_from.get(block, block)
            self.pinned |= {source, private}
            self.ops["copies"].append((source, private))
            self.copied_from[private] = source
            self.written.add(private)
        self.model_release(block)
        self.held.append(private)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def swap_out(self, data):
        tables = data.draw(st.lists(st.lists(st.sampled_from(self.held), max_size=3), max_size=2))
        wanted = sum(tables, [])
        if any(wanted.count(b) > self.held.count(b) for b in wanted):
            return
        distinct = list(dict.fromkeys(wanted))
        if len(distinct) > len(self.host_free):
            with pytest.raises(ValueError, match="free host blocks"):
                self.txn.swap_out(tables)
            return
        if self.written.intersection(distinct):
            with pytest.raises(ValueError, match="written by this step"):
                self.txn.swap_out(tables)
            return
        host_of = {block: self.host_free.pop(0) for block in distinct}
        assert self.txn.swap_out(tables) == [[host_of[b] for b in table] for table in tables]
        self.ops["swap_out"] += host_of.items()
        self.host_pinned |= set(host_of.values())
        self.host_held += [host_of[b] for b in wanted]
        for table in tables:
            for block in reversed(table):
                self.model_release(block)

    @precondition(lambda self: self.host_held)
    @rule(data=st.data())
    def swap_in(self, data):
        tables = data.draw(st.lists(st.lists(st.sampled_from(self.host_held), max_size=3)))
        wanted = sum(tables, [])
        if any(wanted.count(b) > self.host_held.count(b) for b in wanted):
            return
        distinct = list(dict.fromkeys(wanted))
        if len(distinct) > len(self.free):
            with pytest.raises(ValueError, match="free device blocks"):
                self.txn.swap_in(tables)
            return
        device_of = {block: self.model_take_head() for block in distinct}
        assert self.txn.swap_in(tables) == [[device_of[b] for b in table] for table in tables]
        self.ops["swap_in"] += device_of.items()
        self.written |= set(device_of.values())
        self.pinned |= set(device_of.values())
        self.held += [device_of[b] for b in wanted]
        self.host_pinned |= set(distinct)
        for block in wanted:
            self.model_release_host(block)

    @rule()
    def commit(self):
        self.state, ops = self.txn.commit()
        self.txn = Transaction(self.state)
        self.check_no_block_written_twice(ops)
        for name, pairs in self.ops.items():
            np.testing.assert_array_equal(getattr(ops, name), np.array(pairs).reshape(-1, 2))
            pairs.clear()
        self.free += self.deferred
        self.host_free += self.host_deferred
        self.deferred, self.host_deferred = [], []
        self.pinned, self.host_pinned, self.written = set(), set(), set()
        self.copied_from = {}
        self.check_committed_state()
        self.snapshots.append(self.snapshot(self.state))

    @staticmethod
    def check_no_block_written_twice(ops):
        """Each phase scatters its writes, whose order is undefined for a repeated index."""
        device_writes = ops.swap_in[:, 1].tolist() + ops.copies[:, 1].tolist()
        assert len(set(device_writes)) == len(device_writes), "a device block written twice"
        host_writes = ops.swap_out[:, 1].tolist()
        assert len(set(host_writes)) == len(host_writes), "a host block written twice"

    def check_committed_state(self):
        device, host = self.state.device, self.state.host
        assert device.free_queue() == self.free
        assert host.free_queue() == self.host_free
        assert device.num_free == len(self.free) and host.num_free == len(self.host_free)
        expected = np.bincount(self.held, minlength=self.num_blocks)
        np.testing.assert_array_equal(device.refcounts.to_numpy(), expected)
        expected_host = np.bincount(self.host_held, minlength=self.num_host_blocks)
        np.testing.assert_array_equal(host.refcounts.to_numpy(), expected_host)
        expected_hashes = np.zeros(self.num_blocks, np.uint64)
        for block, block_hash in self.hash_of.items():
            expected_hashes[block] = block_hash
        np.testing.assert_array_equal(self.state.block_hashes.to_numpy(), expected_hashes)
        assert dict(self.state.hash_index.items()) == self.entry_of
        assert self.state.next_cache_id == self.next_cache_id
        # Every block is free xor referenced; free + used = total; the null block is neither.
        used = set(self.held)
        assert used.isdisjoint(self.free) and 0 not in used and 0 not in self.free
        assert len(used) + len(self.free) == self.num_blocks - 1

    @invariant()
    def transaction_reads_match_model(self):
        if not hasattr(self, "txn"):
            return
        assert self.txn.num_free == len(self.free)
        assert self.txn.num_free_host == len(self.host_free)
        for block in range(self.num_blocks):
            assert self.txn.refcount(block) == self.held.count(block)
            assert self.txn.block_hash(block) == self.hash_of.get(block, NO_HASH)
        for block in range(self.num_host_blocks):
            assert self.txn.host_refcount(block) == self.host_held.count(block)

    @invariant()
    def earlier_states_are_unchanged(self):
        for state, arrays, index_items in getattr(self, "snapshots", []):
            now = (state.device.refcounts, state.device.next_free, state.block_hashes)
            for before, after in zip(arrays, now, strict=True):
                np.testing.assert_array_equal(before, after.to_numpy())
                assert not any(chunk.flags.writeable for chunk in after.chunks)
            assert state.hash_index.items() == index_items

    def teardown(self):
        if not hasattr(self, "txn"):
            return
        for block in list(self.held):
            self.txn.free(block)
            self.model_release(block)
        for block in list(self.host_held):
            self.txn.free_host(block)
            self.model_release_host(block)
        self.commit()
        assert self.state.device.num_free == self.num_blocks - 1
        assert self.state.host.num_free == self.num_host_blocks


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocator = AllocatorMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 300),
    dtype=st.sampled_from([np.int32, np.uint64]),
    batches=st.lists(st.dictionaries(st.integers(0, 299), st.integers(0, 2**31 - 1)), max_size=5),
)
def test_chunked_array_matches_numpy_and_keeps_old_versions(size, dtype, batches):
    versions = [(ChunkedArray.of(np.arange(size, dtype=dtype)), np.arange(size, dtype=dtype))]
    for changes in batches:
        changes = {k: v for k, v in changes.items() if k < size}
        array, model = versions[-1]
        model = model.copy()
        model[list(changes)] = list(changes.values())
        versions.append((array.updated(changes), model))
    for array, model in versions:
        assert len(array) == size
        np.testing.assert_array_equal(array.to_numpy(), model)
        assert all(array.item(i) == model[i] for i in range(size))


def test_state_create_leaves_null_block_out():
    state = AllocatorState.create(num_blocks=5, num_host_blocks=3)
    assert state.device.free_queue() == [1, 2, 3, 4]
    assert state.host.free_queue() == [0, 1, 2]
    txn = Transaction(state)
    assert sorted(txn.allocate(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="need 1 free device blocks, only 0"):
        txn.allocate(1)


def test_freed_blocks_join_the_tail_and_allocation_takes_the_head():
    txn = Transaction(AllocatorState.create(num_blocks=6, num_host_blocks=0))
    a, b, c = txn.allocate(3)
    txn.free(b)
    txn.free(a)
    state, _ = txn.commit()
    assert state.device.free_queue() == [4, 5, b, a]


def test_one_state_starts_independent_transactions():
    state = AllocatorState.create(num_blocks=4, num_host_blocks=0)
    first, second = Transaction(state), Transaction(state)
    assert first.allocate(2) == [1, 2]
    assert second.allocate(1) == [1]
    state_a, _ = first.commit()
    state_b, _ = second.commit()
    assert state.device.free_queue() == [1, 2, 3]
    assert state_a.device.free_queue() == [3]
    assert state_b.device.free_queue() == [2, 3]


def test_a_freed_copy_destination_is_not_reused_by_the_same_steps_swap_in():
    txn = Transaction(AllocatorState.create(num_blocks=3, num_host_blocks=1))
    txn.swap_out([txn.allocate(1)])  # host block 0 now holds KV to swap back in
    state, _ = txn.commit()
    txn = Transaction(state)
    (shared,) = txn.allocate(1)
    txn.share(shared)
    private = txn.copy_on_write(shared, copy_content=True)
    txn.free(private)  # its holder ends before the step runs, but the copy still writes it
    # Swap-in runs before copies: reused now, the block would get the copy, not host block 0.
    assert txn.num_free == 0
    with pytest.raises(ValueError, match="need 1 free device blocks, only 0"):
        txn.swap_in([[0]])
    state, ops = txn.commit()
    assert ops.copies.tolist() == [[shared, private]]
    assert state.device.free_queue() == [private]


def test_a_copy_from_a_block_the_same_step_fills_reads_that_blocks_source():
    txn = Transaction(AllocatorState.create(num_blocks=4, num_host_blocks=0))
    (first,) = txn.allocate(1)
    txn.share(first)
    second = txn.copy_on_write(first, copy_content=True)
    txn.share(second)
    third = txn.copy_on_write(second, copy_content=True)
    _, ops = txn.commit()
    # All copies read before any writes, so `second` does not yet hold first's KV.
    assert ops.copies.tolist() == [[first, second], [first, third]]


def test_misuse_of_a_transaction_raises_and_changes_nothing():
    txn = Transaction(AllocatorState.create(num_blocks=4, num_host_blocks=2))
    held, free = txn.allocate(2)
    txn.free(free)
    txn.swap_out([[held]])  # host block 0 holds it now; device block `held` is free
    txn.free_host(0)
    with pytest.raises(ValueError, match="host block 0 freed more often than referenced"):
        txn.free_host(0)
    with pytest.raises(ValueError, match="host block 1 freed more often than referenced"):
        txn.free_host(1)
    with pytest.raises(ValueError, match=f"device block {held} is not in the prefix cache"):
        txn.take_cached(held)
    (shared,) = txn.allocate(1)
    with pytest.raises(ValueError, match=f"device block {shared} occurs 2 times .* 1 holders"):
        txn.swap_out([[shared], [shared]])
    with pytest.raises(ValueError, match="host block 1 occurs 1 times .* 0 holders"):
        txn.swap_in([[1]])
    with pytest.raises(ValueError, match="device block 9 is out of range"):
        txn.free(9)
    assert txn.refcount(shared) == 1 and txn.host_refcount(0) == 0 and txn.host_refcount(1) == 0
    assert txn.num_free == 2 and txn.num_free_host == 1  # host block 0 awaits its swap-out
    state, _ = txn.commit()
    with pytest.raises(RuntimeError, match="already committed"):
        txn.commit()
    assert state.device.free_queue() == [free, held] and state.host.free_queue() == [1, 0]


def test_a_double_free_raises_with_asserts_stripped():
    """Under `python -O` an assert would let the refcount go negative silently."""
    code = (
        "from jpaged.memory.allocator import AllocatorState, Transaction\n"
        "txn = Transaction(AllocatorState.create(num_blocks=3, num_host_blocks=0))\n"
        "(block,) = txn.allocate(1)\n"
        "txn.free(block)\n"
        "try:\n"
        "    txn.free(block)\n"
        "except ValueError as error:\n"
        "    print(type(error).__name__, error)\n"
        "print('refcount', txn.refcount(block))\n"
    )
    run = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parents[1],
    )
    assert run.stdout.splitlines() == [
        "ValueError device block 1 freed more often than referenced: it is already free",
        "refcount 0",
    ]
