"""Orca's contiguous slabs for the simulator: the external fragmentation of Figure 2.

Orca-style systems store each request's KV cache in one contiguous slab of
token slots, reserved when the request is admitted and freed when it ends
(the vLLM paper, Section 2.3 and Figure 2). The slab's size is the policy's
reservation, "orca-max", "orca-pow2" or "orca-oracle" (jpaged.memory.reservation,
the same rule the engine's reserving blocks follow); pow2 and oracle know a
request's output length from its parameters (max_tokens with ignore_eos).

Slabs are placed first-fit in a single arena, so freed slabs leave holes and a
request can wait while enough slots are free in total (external fragmentation).
A slab covers the whole request, so a running request never needs more memory
and is never preempted; the arena has no swap space and no prefix cache.

`ContiguousArena` implements the scheduler's `KVCacheManager` for requests of
one sequence, plus the slot accounting the Figure-2 breakdown needs.
"""

from __future__ import annotations

import bisect

from jpaged.memory.allocator import BlockOps
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.reservation import ALLOCATIONS, known_output_len, reserved_tokens
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


class ContiguousArena:
    """First-fit contiguous slabs in an arena of `num_slots` token slots."""

    num_host_blocks = 0

    def __init__(self, num_slots: int, allocation: str, max_model_len: int):
        if allocation not in ALLOCATIONS[1:]:
            raise ValueError(f"allocation must be one of {ALLOCATIONS[1:]}, got {allocation!r}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.allocation = allocation
        self.max_model_len = max_model_len
        # Free holes as parallel sorted lists of start offsets and lengths.
        self._hole_starts: list[int] = [0]
        self._hole_lens: list[int] = [num_slots]
        self._slabs: dict[int, tuple[int, int]] = {}

    def reservation(self, group: SequenceGroup) -> int:
        """Slots reserved for each sequence of `group` under the policy."""
        try:
            return reserved_tokens(self.allocation, group.seqs[0].num_prompt_tokens,
                                   known_output_len(group, self.max_model_len),
                                   self.max_model_len)
        except ValueError as error:
            raise ValueError(f"request {group.request_id!r}: {error}") from None

    # Scheduler interface.

    def check_fits(self, group: SequenceGroup) -> None:
        if group.max_seqs > 1:
            raise ValueError(f"request {group.request_id!r}: the arena serves one sequence "
                             "per request")
        if self.reservation(group) > self.num_slots:
            raise ValueError(f"request {group.request_id!r} reserves more slots than the "
                             f"arena's {self.num_slots}")

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        size = self.reservation(group)
        if size > self.num_slots:
            return AllocStatus.NEVER
        lens = list(self._hole_lens)
        for _ in group.seqs_with(SequenceStatus.WAITING):
            hole = _first_fit(lens, size)
            if hole is None:
                return AllocStatus.LATER
            lens[hole] -= size
        return AllocStatus.OK

    def allocate(self, group: SequenceGroup) -> None:
        size = self.reservation(group)
        for seq in group.seqs_with(SequenceStatus.WAITING):
            hole = _first_fit(self._hole_lens, size)
            assert hole is not None, "allocate() without a successful can_allocate()"
            start = self._hole_starts[hole]
            self._slabs[seq.seq_id] = (start, size)
            if self._hole_lens[hole] == size:
                del self._hole_starts[hole], self._hole_lens[hole]
            else:
                self._hole_starts[hole] += size
                self._hole_lens[hole] -= size

    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool:
        return all(
            seq.num_computed_tokens + num_new_tokens <= self._slabs[seq.seq_id][1]
            for seq in group.seqs_with(SequenceStatus.RUNNING)
        )

    def has_decode_slot(self, seq: Sequence) -> bool:
        """The slab holds the next position unless the request reached its reservation."""
        return seq.num_computed_tokens < self._slabs[seq.seq_id][1]

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """The slab already holds every position of the request: only check the bound."""
        assert seq.num_computed_tokens + num_new_tokens <= self._slabs[seq.seq_id][1]

    def free(self, seq: Sequence) -> None:
        """Return seq's slab to the arena, merging it with neighbouring holes."""
        slab = self._slabs.pop(seq.seq_id, None)
        if slab is None:
            return
        start, size = slab
        i = bisect.bisect(self._hole_starts, start)
        if i < len(self._hole_starts) and self._hole_starts[i] == start + size:
            size += self._hole_lens[i]
            del self._hole_starts[i], self._hole_lens[i]
        if i > 0 and self._hole_starts[i - 1] + self._hole_lens[i - 1] == start:
            self._hole_lens[i - 1] += size
        else:
            self._hole_starts.insert(i, start)
            self._hole_lens.insert(i, size)

    def mark_computed(self, seq: Sequence) -> None:
        """Contiguous slabs have no prefix cache and free nothing early: nothing to do."""

    def end_step(self) -> BlockOps:
        """Slabs never move: no copies, no swaps."""
        return BlockOps.none()

    # Accounting.

    def allocated_slots(self, seq: Sequence) -> int:
        return self._slabs[seq.seq_id][1]

    def slab(self, seq: Sequence) -> tuple[int, int]:
        """(first slot, number of slots) of seq's slab."""
        return self._slabs[seq.seq_id]

    @property
    def holes(self) -> list[tuple[int, int]]:
        """Free (first slot, number of slots) ranges, in address order."""
        return list(zip(self._hole_starts, self._hole_lens, strict=True))

    @property
    def num_free_slots(self) -> int:
        return sum(self._hole_lens)


def _first_fit(hole_lens: list[int], size: int) -> int | None:
    """Index of the first hole (address order) of at least `size` slots."""
    return next((i for i, length in enumerate(hole_lens) if length >= size), None)
