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
    """The table as a scheduler and a device use it: groups are admitted in any order
    (a group whose adapter finds no slot is skipped, the others go on), each step's
    loads reach the device or the step fails (its groups end, perhaps some of its loads
    written, perhaps none), requests end or go back to waiting, adapters are unloaded."""

    def __init__(self):
        super().__init__()
        self.reads: dict[str, int] = {}  # name -> times read (each read: new weights hash)
        self.table = AdapterSlotTable(NUM_SLOTS, MAX_CPU, self._read)
        self.waiting: list[FakeGroup] = []
        self.admitted: list[tuple[FakeGroup, FakeAdapter]] = []
        self.step_groups: list[FakeGroup] = []  # admitted since the last step ran
        self.loaded: dict[int, FakeAdapter | None] = {}  # slot -> what the device holds

    def _read(self, request: LoRARequest) -> FakeAdapter:
        self.reads[request.lora_name] = self.reads.get(request.lora_name, 0) + 1
        return FakeAdapter(request.lora_name, str(self.reads[request.lora_name]))

    def _in_use(self) -> set[int]:
        return {slot for g, _ in self.admitted if (slot := g.adapter_slot)}

    @rule(name=st.sampled_from([*NAMES, None]))
    def add(self, name):
        adapter = None if name is None else self.table.adapter(
            LoRARequest(name, NAMES.index(name) + 1, f"/adapters/{name}"))
        self.waiting.append(FakeGroup(adapter))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        group = data.draw(st.sampled_from(self.waiting))
        in_use = self._in_use()
        slots_before = list(self.table.slot_adapters)
        if self.table.acquire(group):
            self.waiting.remove(group)
            self.admitted.append((group, group.adapter))
            self.step_groups.append(group)
        else:  # skipped only when every slot is in use by other adapters
            assert len(in_use) == NUM_SLOTS
            assert group.adapter_slot == 0
            assert self.table.slot_adapters == slots_before, "a skip changed the table"
        for slot in in_use:
            assert self.table.slot_adapters[slot] == slots_before[slot], \
                "a slot in use was reassigned"

    @rule(fails=st.booleans(), data=st.data())
    def step(self, fails, data):
        """The device runs the step: it writes the loads, or fails having written some
        of them (as garbage) and ends some of the step's groups."""
        loads = self.table.take_loads()
        for slot, adapter in loads:
            users = {a for g, a in self.admitted if g.adapter_slot == slot}
            assert users <= {adapter}, "a slot in use was loaded with another adapter"
        if not fails:
            self.loaded.update(dict(loads))
            self.step_groups = []
            for group, adapter in self.admitted:
                if adapter is not None:
                    assert self.loaded[group.adapter_slot] == adapter
            return
        written = data.draw(st.integers(0, len(loads)))
        self.loaded.update({slot: None for slot, _ in loads[:written]})  # half written
        ended = data.draw(st.lists(st.sampled_from(self.step_groups), unique=True)
                          if self.step_groups else st.just([]))
        for group in ended:
            self._release(group)
        self.step_groups = []
        self.table.forget_unapplied(loads)

    def _release(self, group):
        self.admitted = [(g, a) for g, a in self.admitted if g is not group]
        self.table.release(group)
        assert group.adapter_slot == 0

    @precondition(lambda self: self.admitted)
    @rule(data=st.data(), back_to_waiting=st.booleans())
    def finish(self, data, back_to_waiting):
        """A request ends, or is preempted by recompute (it waits again)."""
        group, _ = data.draw(st.sampled_from(self.admitted))
        self._release(group)
        if group in self.step_groups:
            self.step_groups.remove(group)
        if back_to_waiting:
            self.waiting.append(group)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name):
        self.table.forget(name)
        for slot, adapter in enumerate(self.table.slot_adapters):
            if adapter is not None and adapter.name == name:
                assert self.table.users[slot], f"idle slot {slot} kept unloaded {name}"

    @invariant()
    def table_is_consistent(self):
        assert not self.table.check_invariants()
        assert len(self._in_use()) <= NUM_SLOTS
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

    config = EngineConfig(model="tiny", kv_cache_memory_bytes=memory, block_size=4, max_num_seqs=64,
                          max_num_batched_tokens=64)
    groups = KVCacheGroups.of((None, None), free_windows=False)
    try:
        num_blocks = kv_cache_num_blocks(config, 8, block_bytes, None, groups, adapter_bytes)
    except ValueError:
        assert (memory - adapter_bytes) // block_bytes - 1 < 2  # too small for one sequence
        return
    assert num_blocks * block_bytes + adapter_bytes <= memory


def test_a_request_without_a_slot_lets_the_ones_behind_it_run():
    """One slot; a, b, the base model, a queued in that order: b's adapter finds the slot
    in use, so the base request and the second a run beside the first (as in vLLM), b
    keeps the queue's front and runs once both a's end; every request gets its tokens."""
    from jpaged.config import SchedulerConfig
    from jpaged.core.scheduler import Scheduler
    from jpaged.sampling_params import SamplingParams
    from jpaged.sequence import Sequence, SequenceGroup
    from tests.core.test_scheduler import Driver, Req, paged

    read = {name: FakeAdapter(name, "1") for name in ("a", "b")}
    table = AdapterSlotTable(1, 2, lambda request: read[request.lora_name])
    driver = Driver(Scheduler(SchedulerConfig(8, 64, 64), paged(), table))
    groups = []
    for index, name in enumerate(["a", "b", None, "a"]):
        req = Req(index, tuple(range(10 + index, 15 + index)), output_len=3 + index)
        adapter = name and table.adapter(LoRARequest(name, 1 + (name == "b"), f"/{name}"))
        group = SequenceGroup(req.request_id, [Sequence(0, list(req.prompt))],
                              SamplingParams(max_tokens=req.output_len, ignore_eos=True),
                              adapter=adapter)
        driver.scheduler.add_request(group)
        driver.reqs[req.request_id], driver.groups[req.request_id] = req, group
        groups.append(group)

    first = driver.step()
    assert [g.request_id for g in first.groups] == ["r0", "r2", "r3"]
    assert list(driver.scheduler.waiting) == [groups[1]]
    assert first.adapter_loads == [(1, read["a"])]
    admitted_b = None
    for _ in range(20):
        a_done = groups[0].is_finished and groups[3].is_finished
        output = driver.step()
        if groups[1] in output.groups:
            assert a_done, "b took the slot a uses"
            admitted_b = output
            break
    assert admitted_b.adapter_loads == [(1, read["b"])]
    driver.run()
    for req in driver.reqs.values():
        assert driver.outputs_of(req.request_id) == req.expected()
    assert not table.check_invariants() and table.users[1] == 0
