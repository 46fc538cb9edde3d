"""The allocator's transitions under `jax.jit` against the host's numpy path.

The hypothesis machine of tests/memory/test_allocator.py (a brute-force model of
lists) drives the host allocator; this subclass runs every allocate, share, free
and copy-on-write a second time, jitted on a JAX copy of the state made before the
operation, and requires every array of the two states to be equal afterwards. Swaps,
prefix hits and commits run on the host alone (the decode loop never does them);
the JAX copy is taken afresh from the host before each operation.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from jpaged.memory import allocator
from tests.memory.test_allocator import AllocatorMachine

# Blocks a jitted allocate may take: the most the machine's `allocate` rule asks for.
CAPACITY = 4


@partial(jax.jit, static_argnames="capacity")
def _allocate(state, count, *, capacity):
    """`count` blocks (traced, <= capacity) from the head: `capacity` masked takes."""
    device, blocks = state.device, []
    for i in range(capacity):
        device, block = allocator.take_free_block(device, i < count)
        blocks.append(block)
    return state._replace(device=device), jnp.stack(blocks)


@jax.jit
def _share(state, blocks):
    return state._replace(device=allocator.add_holders(state.device, blocks))


@jax.jit
def _free(state, blocks):
    device = state.device
    for i in range(blocks.shape[0]):
        device = allocator.drop_holder(device, blocks[i])
    return state._replace(device=device)


@jax.jit
def _copy_on_write(state, block, copy_content):
    return allocator.private_copy(state, block, copy_content)


class DeviceAllocatorMachine(AllocatorMachine):
    # Two pool sizes of each kind: every jitted function compiles for a few shapes only.
    @initialize(num_blocks=st.sampled_from([5, 12]), num_host_blocks=st.sampled_from([0, 4]))
    def setup(self, num_blocks, num_host_blocks):
        super().setup(num_blocks, num_host_blocks)

    def on_device(self):
        """The host state now, as JAX arrays."""
        return jax.tree.map(jnp.asarray, self.state)

    def check_same(self, device_state):
        host_leaves = jax.tree.leaves(self.state)
        device_leaves = jax.tree.leaves(device_state)
        assert len(host_leaves) == len(device_leaves)
        for host, device in zip(host_leaves, device_leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(device), host)

    @rule(num=st.integers(0, CAPACITY))
    def allocate(self, num):
        before = self.on_device()
        enough = num <= len(self.free)
        super().allocate(num)
        if enough:
            after, blocks = _allocate(before, num, capacity=CAPACITY)
            self.check_same(after)
            np.testing.assert_array_equal(np.asarray(blocks)[:num], self.held[len(self.held)
                                                                             - num:])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data):
        before = self.on_device()
        held = list(self.held)
        super().share(data)
        (block,) = [b for b in set(self.held) if self.held.count(b) > held.count(b)]
        self.check_same(_share(before, jnp.array([block])))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_one(self, data):
        before = self.on_device()
        held = list(self.held)
        super().free_one(data)
        (block,) = [b for b in set(held) if held.count(b) > self.held.count(b)]
        self.check_same(_free(before, jnp.array([block])))

    @precondition(lambda self: any(self.held.count(b) > 1 for b in self.held))
    @rule(data=st.data(), copy_content=st.booleans())
    def copy_on_write(self, data, copy_content):
        before = self.on_device()
        held, enough = list(self.held), bool(self.free)
        super().copy_on_write(data, copy_content)
        if not enough:
            return
        (block,) = [b for b in set(held) if held.count(b) > self.held.count(b)]
        after, private = _copy_on_write(before, block, copy_content)
        self.check_same(after)
        assert int(private) == self.held[-1]


DeviceAllocatorMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None)
TestDeviceAllocator = DeviceAllocatorMachine.TestCase
