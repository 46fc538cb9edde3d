"""What the scheduler needs from a KV memory manager.

Two implementations in jpaged: the paged `BlockManager` (blocks allocated as
tokens arrive, shared by forks and the prefix cache, swapped to host memory)
and `ReservingBlockManager` (the paper's Orca baselines on the same blocks:
every sequence reserves its blocks at admission). The simulator's contiguous
arena (experiments.baselines) is a third, for Orca's external fragmentation.
"""

from __future__ import annotations

import enum
from typing import Protocol

from jpaged.memory.allocator import BlockOps
from jpaged.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


class KVCacheManager(Protocol):
    """The scheduler's calls. A manager without host blocks (num_host_blocks 0) is never
    asked to swap: swap preemption needs host blocks."""

    num_host_blocks: int

    def check_fits(self, group: SequenceGroup) -> None:
        """Raise ValueError, naming the request, if `group` can never be admitted."""

    def can_allocate(self, group: SequenceGroup) -> AllocStatus: ...
    def allocate(self, group: SequenceGroup) -> None: ...
    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool: ...
    def has_decode_slot(self, seq: Sequence) -> bool: ...
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None: ...
    def fork(self, parent: Sequence, child: Sequence) -> None: ...
    def free(self, seq: Sequence) -> None: ...  # a no-op for a sequence it does not know
    def can_swap_out(self, group: SequenceGroup) -> bool: ...
    def swap_out(self, group: SequenceGroup) -> None: ...
    def can_swap_in(self, group: SequenceGroup) -> AllocStatus: ...
    def swap_in(self, group: SequenceGroup) -> None: ...
    def mark_computed(self, seq: Sequence) -> None: ...
    def end_step(self) -> BlockOps: ...
