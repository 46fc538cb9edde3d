"""The adapter slots as the scheduler hands them out, and the host cache of adapters.

The device holds `num_slots` adapters at once (vLLM's max_loras), in slots 1..num_slots
(0 is the base model). A request's group takes a slot when the scheduler admits it and
gives it back when it ends or goes back to the waiting queue (a swapped-out group keeps
its slot, as it keeps its blocks). A group whose adapter sits in a slot shares it; else
the adapter goes into a free slot, or into the least recently used idle one (no running
group uses it), and the step loads it there (`take_loads`). With every slot in use the
group waits, as in vLLM (the scheduler admits the requests behind it meanwhile); a slot in
use is never reassigned. Adapters read from disk stay in a host cache of `max_cpu_loras`,
least recently used first out. Unloading an adapter (`forget`) frees its slot once no
running group uses it.

A failed step may not have written the adapters its plan loaded (`forget_unapplied`):
their slots are loaded again by the next step, or freed if no group is left to use them.

Host-only: the scheduler imports it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from jpaged.lora.request import LoRARequest

if TYPE_CHECKING:
    from jpaged.lora.peft import LoRAAdapter
    from jpaged.sequence import SequenceGroup


def prefix_salt(cache_salt: str | None, adapter: LoRAAdapter | None) -> str | None:
    """The salt of a request's prefix-cache keys: its cache_salt, and its adapter's name
    and weights hash, so that no two adapters (nor an adapter and the base model, nor
    new weights under an old name) ever share a KV block."""
    if adapter is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{adapter.name}:{adapter.weights_hash}"


class NoAdapters:
    """The scheduler's adapter slots where LoRA is off: every group runs the base model."""

    def acquire(self, group: SequenceGroup) -> bool:
        return True

    def release(self, group: SequenceGroup) -> None:
        pass

    def take_loads(self) -> list:
        return []

    def forget_unapplied(self, loads: list) -> None:
        pass


class AdapterSlotTable(NoAdapters):
    """num_slots: max_loras; max_cpu_loras: adapters the host cache keeps; read: reads and
    checks the adapter of a LoRARequest (jpaged.lora.peft.read_adapter, bound to the model)."""

    def __init__(self, num_slots: int, max_cpu_loras: int,
                 read: Callable[[LoRARequest], LoRAAdapter]):
        self.num_slots, self.max_cpu_loras, self._read = num_slots, max_cpu_loras, read
        self.slot_adapters: list[LoRAAdapter | None] = [None] * (num_slots + 1)  # [0] unused
        self.users = [0] * (num_slots + 1)
        self._slot_of: dict[tuple[str, str], int] = {}
        self._free = list(range(num_slots, 0, -1))  # popped from the end: slot 1 first
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._host: OrderedDict[tuple[str, int, str], LoRAAdapter] = OrderedDict()
        self._loads: list[tuple[int, LoRAAdapter]] = []
        # Slots of unloaded adapters that running groups still use: freed by their last.
        self._retired: set[int] = set()
        self.num_loads = 0  # adapters put into a slot
        self.num_reads, self.read_seconds = 0, 0.0  # adapters read from disk and checked

    # The host cache.

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request`, from the host cache or read (ValueError, changing
        nothing, if it cannot be served)."""
        key = (request.lora_name, request.lora_int_id, request.lora_path)
        adapter = self._host.get(key)
        if adapter is None:
            started = time.perf_counter()
            adapter = self._read(request)
            self.num_reads += 1
            self.read_seconds += time.perf_counter() - started
            if len(self._host) == self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host[key] = adapter
        self._host.move_to_end(key)
        return adapter

    def forget(self, lora_name: str) -> bool:
        """Unload the adapters named `lora_name`: the host cache drops them and their
        slots are freed, at once if idle, else when their last running group ends; the
        next request naming it reads it again. Whether there was one."""
        keys = [key for key in self._host if key[0] == lora_name]
        for key in keys:
            del self._host[key]
        slots = [slot for (name, _), slot in self._slot_of.items() if name == lora_name]
        for slot in slots:
            del self._slot_of[self.slot_adapters[slot].key]
            if self.users[slot]:
                self._retired.add(slot)
            else:
                self._free_slot(slot)
        return bool(keys or slots)

    @property
    def host_adapters(self) -> list[LoRAAdapter]:
        return list(self._host.values())

    # Slots.

    def acquire(self, group: SequenceGroup) -> bool:
        """Give `group` its adapter's slot (group.adapter_slot); False, changing nothing,
        when every slot is in use by other adapters."""
        adapter = group.adapter
        if adapter is None or group.adapter_slot:
            return True
        slot = self._slot_of.get(adapter.key)
        if slot is None:
            slot = self._place(adapter)
            if slot is None:
                return False
        self._idle.pop(slot, None)
        self.users[slot] += 1
        group.adapter_slot = slot
        return True

    def release(self, group: SequenceGroup) -> None:
        """Take back `group`'s slot, if it holds one; the last user leaves it idle."""
        slot, group.adapter_slot = group.adapter_slot, 0
        if not slot:
            return
        self.users[slot] -= 1
        if self.users[slot]:
            return
        if slot in self._retired:
            self._free_slot(slot)
        else:
            self._idle[slot] = None

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        """The (slot, adapter) loads since the last call: the device applies them before
        the step that uses them."""
        loads, self._loads = self._loads, []
        return loads

    def forget_unapplied(self, loads: list[tuple[int, LoRAAdapter]]) -> None:
        """A step planned `loads` and failed, perhaps before writing them: each slot still
        holding its load's adapter is loaded again by the next step if groups use it,
        else freed (call it once the failed step's groups have released their slots)."""
        for slot, adapter in loads:
            if self.slot_adapters[slot] is not adapter:
                continue
            if self.users[slot]:
                self._loads.append((slot, adapter))
            else:
                if self._slot_of.get(adapter.key) == slot:
                    del self._slot_of[adapter.key]
                self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        self._idle.pop(slot, None)
        self._retired.discard(slot)
        self.slot_adapters[slot] = None
        self._free.append(slot)
        self._drop_loads(slot)

    def _drop_loads(self, slot: int) -> None:
        """Forget a pending load of `slot`: what it held is gone or replaced."""
        self._loads = [(s, adapter) for s, adapter in self._loads if s != slot]

    def _place(self, adapter: LoRAAdapter) -> int | None:
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            slot, _ = self._idle.popitem(last=False)
            del self._slot_of[self.slot_adapters[slot].key]
            self._drop_loads(slot)
        else:
            return None
        self.slot_adapters[slot] = adapter
        self._slot_of[adapter.key] = slot
        self._loads.append((slot, adapter))
        self.num_loads += 1
        return slot

    def check_invariants(self) -> list[str]:
        """What breaks the table's invariants (empty: none)."""
        problems = []
        for slot in range(1, self.num_slots + 1):
            adapter, users = self.slot_adapters[slot], self.users[slot]
            states = [slot in self._free, slot in self._idle, users > 0]
            if sum(states) != 1:
                problems.append(f"slot {slot}: free, idle and in use {states}")
            if (adapter is None) != (slot in self._free):
                problems.append(f"slot {slot}: holds {adapter} but free={slot in self._free}")
            if slot in self._retired and not users:
                problems.append(f"slot {slot}: retired but idle")
            mapped = adapter and self._slot_of.get(adapter.key)
            if adapter is not None and mapped != slot and slot not in self._retired:
                problems.append(f"slot {slot}: its adapter maps to slot {mapped}")
            if users < 0:
                problems.append(f"slot {slot}: {users} users")
        if len(self._host) > self.max_cpu_loras:
            problems.append(f"{len(self._host)} adapters in a host cache of {self.max_cpu_loras}")
        return problems
