"""ReservingBlockManager: the paper's Orca baselines on paged blocks.

The second implementation of the scheduler's `KVCacheManager` (the engine picks
it with `allocation="orca-max" | "orca-pow2" | "orca-oracle"`). A group is
admitted only when blocks for its policy's reservation (jpaged.memory.reservation)
fit for each of the `max_seqs` sequences it may have, and holds them all until
it ends: its sequences never grow, share nothing and are never preempted for
blocks. A fork (a parallel sample, a beam) copies the parent's computed blocks
into blocks of the reservation; a sequence that ends gives its blocks back to
it. Orca has no prefix cache and no swap space, so it reserves no prefixes either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jpaged.config import CacheConfig
from jpaged.memory import allocator
from jpaged.memory.allocator import AllocatorState, BlockOps
from jpaged.memory.block_table import BlockTable
from jpaged.memory.host_tier import HostPoolCounts
from jpaged.memory.invariants import holder_problems
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.prefix_cache import PrefixCacheStats
from jpaged.memory.reservation import known_output_len, reserved_tokens
from jpaged.memory.reserved_prefixes import ReservedPrefixes
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class _Reservation:
    """The device blocks of one group, held from admission until it ends.

    blocks_per_seq: each sequence's table length, ceil(reserved tokens / block_size).
    spare:          held blocks no table holds: those of sequences the group has
                    yet to fork, or whose sequences ended.
    members:        seq_ids of the group's sequences holding a table.
    """

    blocks_per_seq: int
    spare: list[int]
    members: set[int] = field(default_factory=set)

    def take(self) -> list[int]:
        """blocks_per_seq spare blocks for a sequence's table."""
        blocks = self.spare[-self.blocks_per_seq :]
        del self.spare[-self.blocks_per_seq :]
        return blocks


class ReservingBlockManager:
    """Block tables that reserve a request's whole length at admission."""

    num_host_blocks = 0
    enable_prefix_caching = False
    adopts_device_blocks = False  # a decode loop allocates from the free queue, not a reservation

    def __init__(self, cache_config: CacheConfig, allocation: str, max_model_len: int):
        reserved_tokens(allocation, 1, 1, max_model_len)  # an unknown allocation raises
        if allocation == "paged":
            raise ValueError("allocation 'paged' reserves nothing: use BlockManager")
        self.allocation = allocation
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.num_device_blocks = cache_config.num_blocks - 1
        self.prefix_cache_stats = PrefixCacheStats()  # no cache: no queries
        self.state: AllocatorState = allocator.create(cache_config.num_blocks, 0)
        self._tables: dict[int, BlockTable] = {}
        self._reservations: dict[int, _Reservation] = {}  # seq_id -> its group's
        self._logical_blocks = 0
        self.reserved_prefixes = ReservedPrefixes()  # always empty

    @property
    def num_free_blocks(self) -> int:
        return int(self.state.device.num_free)

    @property
    def physical_blocks_used(self) -> int:
        return self.num_device_blocks - self.num_free_blocks

    @property
    def logical_blocks_used(self) -> int:
        return self._logical_blocks

    @property
    def spare_blocks(self) -> list[int]:
        """Device blocks the groups hold outside any table."""
        reservations = {id(r): r for r in self._reservations.values()}
        return [block for r in reservations.values() for block in r.spare]

    num_groups = 1

    @property
    def group_blocks_used(self) -> tuple[int]:
        return (self._logical_blocks,)

    def block_table(self, seq: Sequence) -> BlockTable:
        return self._tables[seq.seq_id]

    def block_tables(self, seq: Sequence) -> tuple[BlockTable]:
        return (self._tables[seq.seq_id],)

    def reserved_len(self, group: SequenceGroup) -> int:
        """Token slots each sequence of `group` reserves."""
        try:
            output_len = known_output_len(group, self.max_model_len)
            return reserved_tokens(self.allocation, group.seqs[0].num_prompt_tokens,
                                   output_len, self.max_model_len)
        except ValueError as error:
            raise ValueError(f"request {group.request_id!r}: {error}") from None

    def reservation_blocks(self, group: SequenceGroup) -> int:
        """Blocks `group` holds from admission to its end: reserved_len tokens for each
        of the max_seqs sequences it may have (samples, beams)."""
        return group.max_seqs * -(-self.reserved_len(group) // self.block_size)

    def check_fits(self, group: SequenceGroup) -> None:
        required = self.reservation_blocks(group)
        if required > self.num_device_blocks:
            raise ValueError(
                f"request {group.request_id!r}: allocation={self.allocation!r} reserves "
                f"{group.max_seqs} x {self.reserved_len(group)} tokens = {required} blocks, "
                f"more than the pool's {self.num_device_blocks} blocks"
            )

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether the whole reservation fits. No watermark: reserved sequences never grow."""
        required = self.reservation_blocks(group)
        if required > self.num_device_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if required <= self.num_free_blocks else AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        self.state, blocks = allocator.allocate(self.state, self.reservation_blocks(group))
        reservation = _Reservation(-(-self.reserved_len(group) // self.block_size),
                                   blocks.tolist())
        for seq in group.seqs_with(SequenceStatus.WAITING):
            self._join(seq, reservation)
            seq.num_computed_tokens = 0

    def _join(self, seq: Sequence, reservation: _Reservation) -> BlockTable:
        table = self._tables[seq.seq_id] = BlockTable(reservation.take())
        self._reservations[seq.seq_id] = reservation
        reservation.members.add(seq.seq_id)
        self._logical_blocks += len(table)
        return table

    def can_append_slots(self, group: SequenceGroup, num_new_tokens: int) -> bool:
        return all(seq.num_computed_tokens + num_new_tokens <= self._capacity(seq)
                   for seq in group.seqs_with(SequenceStatus.RUNNING))

    def _capacity(self, seq: Sequence) -> int:
        return len(self._tables[seq.seq_id]) * self.block_size

    def has_decode_slot(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens < self._capacity(seq)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """The reservation holds every position: only the bound is checked."""
        assert seq.num_computed_tokens + num_new_tokens <= self._capacity(seq), (
            f"sequence {seq.seq_id} outgrew its reservation")

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` gets a table from the reservation, the parent's computed blocks copied."""
        reservation = self._reservations[parent.seq_id]
        if len(reservation.spare) < reservation.blocks_per_seq:
            raise ValueError(
                f"sequence {parent.seq_id} cannot fork: its request's reservation has no "
                "blocks left for another sequence (it reserved for max_seqs sequences)"
            )
        source = self._tables[parent.seq_id]
        table = self._join(child, reservation)
        for i in range(-(-parent.num_computed_tokens // self.block_size)):
            self.state = allocator.copy(self.state, source.block(i), table.block(i))

    def free(self, seq: Sequence) -> None:
        """`seq`'s blocks go back to its group's reservation; the last sequence frees it."""
        table = self._tables.pop(seq.seq_id, None)
        if table is None:
            return
        reservation = self._reservations.pop(seq.seq_id)
        reservation.members.discard(seq.seq_id)
        reservation.spare += table.tolist()
        self._logical_blocks -= len(table)
        if not reservation.members:
            self.state = allocator.free(self.state, reservation.spare[::-1])
            reservation.spare.clear()

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False

    def swap_out(self, group: SequenceGroup) -> None:
        raise ValueError("Orca's reservations have no swap space")

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        return AllocStatus.NEVER

    def swap_in(self, group: SequenceGroup) -> None:
        raise ValueError("Orca's reservations have no swap space")

    def mark_computed(self, seq: Sequence) -> None:
        """No prefix cache, and every reserved block is kept: nothing to do."""

    def reset_prefix_cache(self) -> None:
        """No prefix cache: nothing to forget."""

    def host_pool_counts(self, block_bytes: int) -> HostPoolCounts:
        """No host pool."""
        return HostPoolCounts(block_bytes=block_bytes)

    def forget_unapplied(self, ops: BlockOps) -> None:
        """No prefix cache and no host tier: no hit can read what `ops` left undone."""

    def end_step(self) -> BlockOps:
        self.state, ops = allocator.commit(self.state)
        return ops

    # Reserved prefixes: none (BlockManager's are held in the prefix cache).

    num_reserved_blocks = 0

    def check_reservable(self, token_ids: list[int], cache_salt: str | None = None) -> None:
        raise self._no_prefix_cache()

    def reserve(self, token_ids: list[int], cache_salt: str | None = None):
        raise self._no_prefix_cache()

    def release(self, prefix_id: int) -> None:
        raise self._no_prefix_cache()

    def _no_prefix_cache(self) -> ValueError:
        return ValueError(f"allocation={self.allocation!r} keeps no prefix cache, which "
                          "holds reserved prefixes: reserve them with allocation='paged'")

    def check_invariants(self, running: list[Sequence], swapped: list[Sequence]) -> None:
        """As BlockManager.check_invariants, a reservation's spare blocks counted as held."""
        tables = [self._tables[seq.seq_id].array for seq in running]
        problems = holder_problems("device", self.state.device,
                                   [*tables, np.asarray(self.spare_blocks, np.int32)], first=1)
        logical = sum(len(table) for table in tables)
        if self._logical_blocks != logical:
            problems.append(f"logical blocks {self._logical_blocks}, tables hold {logical}")
        if problems:
            raise RuntimeError("KV block invariants violated: " + "; ".join(problems[:5]))
