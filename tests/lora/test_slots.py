"""The adapter slot table under load, schedule, finish, evict and unload: a hypothesis
state machine against its invariants (a slot in use is never reassigned, at most
max_loras adapters on the device and max_cpu_loras on the host), and the one budget KV
blocks and slots share."""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jpaged.lora.request import LoRARequest
from jpaged.lora.slots import AdapterSlotTable

NUM_SLOTS, MAX_CPU = 3, 4
NAMES = [f"adapter{i}" for i in range(7)]


@dataclass(frozen=True)
class FakeAdapter:
    name: str
    weights_hash: str

    @property
    def key(self):
        return self.name, self.weights_hash


@dataclass(eq=False)
class FakeGroup:
    adapter: FakeAdapter | None
    adapter_slot: int = 0


class SlotMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.reads: dict[str, int] = {}  # name -> times read (each read: new weights hash)
        self.table = AdapterSlotTable(NUM_SLOTS, MAX_CPU, self._read)
        self.waiting: list[FakeGroup] = []
        self.admitted: list[tuple[FakeGroup, FakeAdapter]] = []
        self.loaded: dict[int, FakeAdapter] = {}  # slot -> adapter, as the device holds them

    def _read(self, request: LoRARequest) -> FakeAdapter:
        self.reads[request.lora_name] = self.reads.get(request.lora_name, 0) + 1
        return FakeAdapter(request.lora_name, str(self.reads[request.lora_name]))

    @rule(name=st.sampled_from([*NAMES, None]))
    def add(self, name):
        adapter = None if name is None else self.table.adapter(
            LoRARequest(name, NAMES.index(name) + 1, f"/adapters/{name}"))
        self.waiting.append(FakeGroup(adapter))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule(self, data):
        group = data.draw(st.sampled_from(self.waiting))
        in_use = {slot for g, _ in self.admitted if (slot := g.adapter_slot)}
        if self.table.acquire(group):
            self.waiting.remove(group)
            self.admitted.append((group, group.adapter))
        else:  # waits only when every slot is in use by other adapters
            assert len(in_use) == NUM_SLOTS
            assert group.adapter_slot == 0
        for slot, adapter in self.table.take_loads():
            assert slot not in in_use, "a slot in use was reassigned"
            self.loaded[slot] = adapter

    @precondition(lambda self: self.admitted)
    @rule(data=st.data(), back_to_waiting=st.booleans())
    def finish(self, data, back_to_waiting):
        """A request ends, or is preempted by recompute (it waits again)."""
        group, adapter = data.draw(st.sampled_from(self.admitted))
        self.admitted.remove((group, adapter))
        self.table.release(group)
        assert group.adapter_slot == 0
        if back_to_waiting:
            self.waiting.append(group)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name):
        self.table.forget(name)

    @invariant()
    def slots_hold_their_users_adapters(self):
        assert not self.table.check_invariants()
        for group, adapter in self.admitted:
            if adapter is not None:
                assert self.loaded[group.adapter_slot] == adapter
        assert len({g.adapter_slot for g, a in self.admitted if a}) <= NUM_SLOTS
        assert len(self.table.host_adapters) <= MAX_CPU


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(block_bytes=st.integers(1, 4096), adapter_bytes=st.integers(0, 1 << 20),
       memory=st.integers(1 << 16, 1 << 24))
@settings(max_examples=60, deadline=None)
def test_kv_blocks_and_slots_share_the_budget(block_bytes, adapter_bytes, memory):
    """The pool's blocks plus the slots' bytes never exceed kv_cache_memory."""
    from jpaged.engine.config import EngineConfig
    from jpaged.engine.kv_cache_sizing import kv_cache_num_blocks
    from jpaged.memory.kv_cache_groups import KVCacheGroups

    config = EngineConfig(model="tiny", kv_cache_memory=memory, block_size=4, max_num_seqs=64,
                          max_num_batched_tokens=64)
    groups = KVCacheGroups.of((None, None), free_windows=False)
    try:
        num_blocks = kv_cache_num_blocks(config, 8, block_bytes, None, groups, adapter_bytes)
    except ValueError:
        assert (memory - adapter_bytes) // block_bytes - 1 < 2  # too small for one sequence
        return
    assert num_blocks * block_bytes + adapter_bytes <= memory
