"""The block allocator and the prefix cache beside it against a brute-force model made
of Python lists.

The model keeps the free queue as a list (head first), the prefix cache as two
dicts, and the references the test holds as plain lists: a block's refcount
must equal how often the test holds it. The allocator and the cache are driven
as the block manager drives them (every block the allocator hands out loses its
cache entry). Hashes and content keys come from small sets, so equal hashes
with different keys (collisions) are common. Misuse (freeing or sharing a block
nobody holds, copying an unshared one) must raise and change nothing.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.memory import allocator
from jpaged.memory.allocator import free_queue
from jpaged.memory.prefix_cache import NO_HASH, PrefixCache

HASHES = st.integers(1, 12)
KEYS = st.tuples(st.integers(0, 2), st.sampled_from([None, "", "a"]), st.sampled_from([b"0", b"1"]))


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), num_host_blocks=st.integers(0, 6))
    def setup(self, num_blocks, num_host_blocks):
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.state = allocator.create(num_blocks, num_host_blocks)
        self.cache = PrefixCache(num_blocks)
        self.shapes = self.array_shapes(self.state)
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
    def array_shapes(state):
        return [(a.shape, a.dtype) for a in _leaves(state)]

    def handed_out(self, blocks):
        """What the block manager does with blocks the allocator hands out."""
        self.cache.evict(np.asarray(blocks, np.int64))

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
                allocator.allocate(self.state, num)
            return
        expected = [self.model_take_head() for _ in range(num)]
        self.state, blocks = allocator.allocate(self.state, num)
        assert blocks.tolist() == expected
        self.handed_out(blocks)
        self.held += expected

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data):
        block = data.draw(st.sampled_from(self.held))
        self.state = allocator.share(self.state, [block])
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_one(self, data):
        block = data.draw(st.sampled_from(self.held))
        self.state = allocator.free(self.state, [block])
        self.model_release(block)

    @rule(block=st.integers(-2, 13))
    def free_or_share_unheld(self, block):
        """Misuse: a double free, or sharing a block nobody holds (or none at all)."""
        if block in self.held:
            return
        with pytest.raises(ValueError, match=f"device block {block} (is free|freed|is out)"):
            allocator.free(self.state, [block])
        with pytest.raises(ValueError, match=f"device block {block} (is free|is out)"):
            allocator.share(self.state, [block])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def copy_on_write_unshared(self, data):
        block = data.draw(st.sampled_from(self.held))
        if self.held.count(block) == 1:
            with pytest.raises(ValueError, match=f"device block {block} has 1 holders"):
                allocator.copy_on_write(self.state, block, copy_content=True)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=HASHES, key=KEYS)
    def register(self, data, block_hash, key):
        block = data.draw(st.sampled_from(self.held))
        entry = self.entry_of.get(block_hash)
        if entry is not None:
            expected = entry[1] if entry[2:] == key else None  # a collision registers nothing
            assert self.cache.register(block, block_hash, *key) == expected
        elif block in self.hash_of:
            with pytest.raises(ValueError, match=f"block {block} is already cached"):
                self.cache.register(block, block_hash, *key)
        else:
            assert self.cache.register(block, block_hash, *key) == self.next_cache_id
            self.hash_of[block] = block_hash
            self.entry_of[block_hash] = (block, self.next_cache_id, *key)
            self.next_cache_id += 1

    @rule(block_hash=HASHES, key=KEYS)
    def prefix_hit(self, block_hash, key):
        entry = self.entry_of.get(block_hash)
        if entry is None or entry[2:] != key:
            assert self.cache.lookup(block_hash, *key) is None
            return
        assert self.cache.lookup(block_hash, *key) == entry
        block = entry[0]
        if block not in self.held:
            (self.deferred if block in self.deferred else self.free).remove(block)
        self.state = allocator.take(self.state, block)
        self.held.append(block)

    @precondition(lambda self: any(self.held.count(b) > 1 for b in self.held))
    @rule(data=st.data(), copy_content=st.booleans())
    def copy_on_write(self, data, copy_content):
        block = data.draw(st.sampled_from([b for b in self.held if self.held.count(b) > 1]))
        if not self.free:
            with pytest.raises(ValueError):
                allocator.copy_on_write(self.state, block, copy_content)
            return
        private = self.model_take_head()
        self.state, given = allocator.copy_on_write(self.state, block, copy_content)
        assert given == private
        self.handed_out([private])
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
                allocator.swap_out(self.state, tables)
            return
        if self.written.intersection(distinct):
            with pytest.raises(ValueError, match="written by this step"):
                allocator.swap_out(self.state, tables)
            return
        host_of = {block: self.host_free.pop(0) for block in distinct}
        self.state, host_tables = allocator.swap_out(self.state, tables)
        assert host_tables == [[host_of[b] for b in table] for table in tables]
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
                allocator.swap_in(self.state, tables)
            return
        device_of = {block: self.model_take_head() for block in distinct}
        self.state, device_tables = allocator.swap_in(self.state, tables)
        assert device_tables == [[device_of[b] for b in table] for table in tables]
        self.handed_out(list(device_of.values()))
        self.ops["swap_in"] += device_of.items()
        self.written |= set(device_of.values())
        self.pinned |= set(device_of.values())
        self.held += [device_of[b] for b in wanted]
        self.host_pinned |= set(distinct)
        for block in wanted:
            self.model_release_host(block)

    @rule()
    def commit(self):
        self.state, ops = allocator.commit(self.state)
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

    @staticmethod
    def check_no_block_written_twice(ops):
        """Each phase scatters its writes, whose order is undefined for a repeated index."""
        device_writes = ops.swap_in[:, 1].tolist() + ops.copies[:, 1].tolist()
        assert len(set(device_writes)) == len(device_writes), "a device block written twice"
        host_writes = ops.swap_out[:, 1].tolist()
        assert len(set(host_writes)) == len(host_writes), "a host block written twice"

    def check_committed_state(self):
        device, host = self.state.device, self.state.host
        assert free_queue(device) == self.free
        assert free_queue(host) == self.host_free
        assert device.num_free == len(self.free) and host.num_free == len(self.host_free)
        expected = np.bincount(self.held, minlength=self.num_blocks)
        np.testing.assert_array_equal(device.refcounts, expected)
        expected_host = np.bincount(self.host_held, minlength=self.num_host_blocks)
        np.testing.assert_array_equal(host.refcounts, expected_host)
        expected_hashes = np.zeros(self.num_blocks, np.uint64)
        for block, block_hash in self.hash_of.items():
            expected_hashes[block] = block_hash
        np.testing.assert_array_equal(self.cache.block_hashes, expected_hashes)
        assert self.cache.entries == self.entry_of
        assert self.cache.next_cache_id == self.next_cache_id
        # Nothing of the step is left: no pins, no deferred blocks, no ops.
        assert not device.pinned.any() and not host.pinned.any()
        assert device.num_deferred == 0 and host.num_deferred == 0
        assert not self.state.ops.sizes.any() and not self.state.ops.written.any()
        assert (self.state.ops.copied_from == -1).all()
        # Every block is free xor referenced; free + used = total; the null block is neither.
        used = set(self.held)
        assert used.isdisjoint(self.free) and 0 not in used and 0 not in self.free
        assert len(used) + len(self.free) == self.num_blocks - 1

    @invariant()
    def mid_step_reads_match_model(self):
        if not hasattr(self, "state"):
            return
        assert self.state.device.num_free == len(self.free)
        assert self.state.host.num_free == len(self.host_free)
        for block in range(self.num_blocks):
            assert self.state.device.refcounts[block] == self.held.count(block)
            assert self.cache.block_hashes[block] == self.hash_of.get(block, NO_HASH)
        for block in range(self.num_host_blocks):
            assert self.state.host.refcounts[block] == self.host_held.count(block)

    @invariant()
    def the_state_keeps_its_shapes(self):
        """Every array keeps the shape and dtype the pool sizes fixed: the state could
        be a jitted function's carry."""
        if hasattr(self, "state"):
            assert self.array_shapes(self.state) == self.shapes

    def teardown(self):
        if not hasattr(self, "state"):
            return
        for block in list(self.held):
            self.state = allocator.free(self.state, [block])
            self.model_release(block)
        for block in list(self.host_held):
            self.state = allocator.free_host(self.state, [block])
            self.model_release_host(block)
        self.commit()
        assert self.state.device.num_free == self.num_blocks - 1
        assert self.state.host.num_free == self.num_host_blocks


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestAllocator = AllocatorMachine.TestCase


def _leaves(tree):
    """The arrays of a state of nested NamedTuples, in order."""
    if isinstance(tree, np.ndarray):
        return [tree]
    return [leaf for child in tree for leaf in _leaves(child)]


def test_state_create_leaves_null_block_out():
    state = allocator.create(num_blocks=5, num_host_blocks=3)
    assert free_queue(state.device) == [1, 2, 3, 4]
    assert free_queue(state.host) == [0, 1, 2]
    state, blocks = allocator.allocate(state, 4)
    assert sorted(blocks.tolist()) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="need 1 free device blocks, only 0"):
        allocator.allocate(state, 1)


def test_freed_blocks_join_the_tail_and_allocation_takes_the_head():
    state, (a, b, c) = allocator.allocate(allocator.create(num_blocks=6, num_host_blocks=0), 3)
    state = allocator.free(state, [b])
    state = allocator.free(state, [a])
    state, _ = allocator.commit(state)
    assert free_queue(state.device) == [4, 5, b, a]


def test_a_table_freed_at_once_joins_the_tail_in_its_order():
    state, blocks = allocator.allocate(allocator.create(num_blocks=6, num_host_blocks=0), 4)
    state = allocator.share(state, blocks[:2])
    state = allocator.free(state, blocks[::-1])  # the shared two keep one holder each
    assert free_queue(state.device) == [5, int(blocks[3]), int(blocks[2])]
    assert state.device.refcounts[blocks].tolist() == [1, 1, 0, 0]


def test_a_double_free_inside_a_table_changes_nothing():
    state, blocks = allocator.allocate(allocator.create(num_blocks=6, num_host_blocks=0), 3)
    state = allocator.free(state, blocks[1:2])
    before = [leaf.copy() for leaf in _leaves(state)]
    with pytest.raises(ValueError, match=f"device block {blocks[1]} freed more often"):
        allocator.free(state, blocks)
    for old, new in zip(before, _leaves(state), strict=True):
        np.testing.assert_array_equal(old, new)


def test_the_state_is_arrays_only():
    """No Python object per block: every leaf is a numpy array of a fixed dtype."""
    state = allocator.create(num_blocks=7, num_host_blocks=5)
    leaves = _leaves(state)
    assert all(isinstance(leaf, np.ndarray) and leaf.dtype != object for leaf in leaves)
    # Sized by the pools (a block or a queue link each) or by the five phases of ops.
    assert {leaf.shape[0] for leaf in leaves if leaf.ndim} == {5, 6, 7, 8}


def test_a_freed_copy_destination_is_not_reused_by_the_same_steps_swap_in():
    state, held = allocator.allocate(allocator.create(num_blocks=3, num_host_blocks=1), 1)
    state, _ = allocator.swap_out(state, [held.tolist()])  # host block 0 holds KV to swap in
    state, _ = allocator.commit(state)
    state, (shared,) = allocator.allocate(state, 1)
    state = allocator.share(state, [shared])
    state, private = allocator.copy_on_write(state, int(shared), copy_content=True)
    state = allocator.free(state, [private])  # its holder ends, but the copy still writes it
    # Swap-in runs before copies: reused now, the block would get the copy, not host block 0.
    assert state.device.num_free == 0
    with pytest.raises(ValueError, match="need 1 free device blocks, only 0"):
        allocator.swap_in(state, [[0]])
    state, ops = allocator.commit(state)
    assert ops.copies.tolist() == [[shared, private]]
    assert free_queue(state.device) == [private]


def test_a_copy_from_a_block_the_same_step_fills_reads_that_blocks_source():
    state, (first,) = allocator.allocate(allocator.create(num_blocks=4, num_host_blocks=0), 1)
    state = allocator.share(state, [first])
    state, second = allocator.copy_on_write(state, int(first), copy_content=True)
    state = allocator.share(state, [second])
    state, third = allocator.copy_on_write(state, second, copy_content=True)
    _, ops = allocator.commit(state)
    # All copies read before any writes, so `second` does not yet hold first's KV.
    assert ops.copies.tolist() == [[first, second], [first, third]]


def test_misuse_raises_and_changes_nothing():
    state, (held, free) = allocator.allocate(allocator.create(num_blocks=4, num_host_blocks=2), 2)
    held, free = int(held), int(free)
    state = allocator.free(state, [free])
    state, _ = allocator.swap_out(state, [[held]])  # host block 0 holds it; `held` is free
    state = allocator.free_host(state, [0])
    before = [leaf.copy() for leaf in _leaves(state)]
    with pytest.raises(ValueError, match="host block 0 freed more often than referenced"):
        allocator.free_host(state, [0])
    with pytest.raises(ValueError, match="host block 1 freed more often than referenced"):
        allocator.free_host(state, [1])
    with pytest.raises(ValueError, match="device block 0 is the null block"):
        allocator.take(state, 0)
    with pytest.raises(ValueError, match="device block 9 is out of range"):
        allocator.free(state, [9])
    with pytest.raises(ValueError, match="host block 1 occurs 1 times .* 0 holders"):
        allocator.swap_in(state, [[1]])
    for old, new in zip(before, _leaves(state), strict=True):
        np.testing.assert_array_equal(old, new)
    state, (shared,) = allocator.allocate(state, 1)
    with pytest.raises(ValueError, match=f"device block {shared} occurs 2 times .* 1 holders"):
        allocator.swap_out(state, [[shared], [shared]])
    assert state.device.refcounts[shared] == 1 and not state.host.refcounts.any()
    assert state.device.num_free == 2 and state.host.num_free == 1  # host 0 awaits its swap-out
    state, _ = allocator.commit(state)
    assert free_queue(state.device) == [free, held] and free_queue(state.host) == [1, 0]


def test_a_double_free_raises_with_asserts_stripped():
    """Under `python -O` an assert would let the refcount go negative silently."""
    code = (
        "from jpaged.memory import allocator\n"
        "state, (block,) = allocator.allocate(allocator.create(3, 0), 1)\n"
        "state = allocator.free(state, [block])\n"
        "try:\n"
        "    allocator.free(state, [block])\n"
        "except ValueError as error:\n"
        "    print(type(error).__name__, error)\n"
        "print('refcount', state.device.refcounts[block])\n"
    )
    run = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parents[2], timeout=120,
    )
    assert run.stdout.splitlines() == [
        "ValueError device block 1 freed more often than referenced: it is already free",
        "refcount 0",
    ]
