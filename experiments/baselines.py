"""The paper's contiguous-allocation baselines: Orca (Max), Orca (Pow2), Orca (Oracle).

Orca-style systems store each request's KV cache in one contiguous slab of
token slots, reserved when the request is admitted and freed when it ends
(the vLLM paper, Section 2.3 and Figure 2). The slab size is the policy:

- "max":    max_model_len slots, whatever the request needs;
- "pow2":   the prompt plus the next power of two of the request's true
            output length (a 25-token output reserves 32 output slots): the
            output over-reserved by less than 2x, as the paper defines it;
            never more than max_model_len;
- "oracle": exactly the true total length, as if it knew the output length.

Slabs are placed first-fit in a single arena, so freed slabs leave holes and a
request can wait while enough slots are free in total (external fragmentation).
A slab covers the whole request, so a running request never needs more memory
and is never preempted; these managers have no swap space and no prefix cache.

`ContiguousKVManager` offers the scheduler's `KVCacheManager` interface (less
the swap methods) plus the slot accounting the Figure-2 breakdown needs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

from jpaged.memory.allocator import BlockOps
from jpaged.memory.block_manager import AllocStatus
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

POLICIES = ("max", "pow2", "oracle")

_NO_PAIRS = np.zeros((0, 2), np.int32)
_NO_PAIRS.flags.writeable = False


class ContiguousKVManager:
    """First-fit contiguous slabs in an arena of `num_slots` token slots.

    total_len_of(group) is the request's true total length (prompt + output),
    known in advance to the "pow2" and "oracle" policies; the prompt is the
    group's first sequence's.
    """

    num_host_blocks = 0

    def __init__(
        self,
        num_slots: int,
        policy: str,
        max_model_len: int,
        total_len_of: Callable[[SequenceGroup], int],
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.policy = policy
        self.max_model_len = max_model_len
        self.total_len_of = total_len_of
        # Free holes as parallel sorted lists of start offsets and lengths.
        self._hole_starts: list[int] = [0]
        self._hole_lens: list[int] = [num_slots]
        self._slabs: dict[int, tuple[int, int]] = {}

    def reservation(self, group: SequenceGroup) -> int:
        """Slots reserved for each sequence of `group` under the policy."""
        if self.policy == "max":
            return self.max_model_len
        total = self.total_len_of(group)
        if self.policy == "oracle":
            return total
        prompt_len = group.seqs[0].num_prompt_tokens
        if total <= prompt_len:
            raise ValueError(
                f"request {group.request_id!r}: total length {total} must exceed its "
                f"{prompt_len} prompt tokens (every request outputs at least one token)"
            )
        output_slots = 1 << (total - prompt_len - 1).bit_length()  # next power of two
        return min(prompt_len + output_slots, self.max_model_len)

    # Scheduler interface.

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

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Contiguous slabs have no prefix cache: nothing to register."""

    def end_step(self) -> BlockOps:
        """Slabs never move: no copies, no swaps."""
        return BlockOps(swap_out=_NO_PAIRS, swap_in=_NO_PAIRS, copies=_NO_PAIRS)

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
