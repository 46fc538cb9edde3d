"""BlockManager against brute-force models of its tables and of the KV it addresses.

The state machine drives admissions, chunked prefills and decodes, verifying
steps of speculative decoding (a decode with k proposals, of which any number is
accepted and the rest rolled back), forks
(shared or copied), beam-search steps, frees, aborts (also of sequences with
slots in the open step), swaps and recompute preemptions in any order, and
checks them against two oracles: a recount of every block table (refcounts,
free + used = total, no leak) and a model of the KV memory itself. Each step
the model applies the step's BlockOps in the documented order, then writes
every scheduled token's "K/V" (the salt and the whole token prefix up to it,
which is what real K/V depend on and what the prefix cache may share) into its
slot. Every computed position of every live sequence must then read back its
own prefix: that checks copy-on-write copies, fork copies, swaps, prefix hits,
evictions and same-step block reuse at once. With a host pool and the prefix cache
on, every registered block is also stored to the host tier and prefix hits may load
blocks back from it: the model applies those phases too, so a loaded block that
does not hold its prefix fails the same read-back. Reserved prefixes (a computed
prefix's blocks held until released) count in the recount, and their blocks must
keep holding their prefix whatever the other rules take from the pool.
"""

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.config import CacheConfig
from jpaged.memory.allocator import free_queue
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.block_table import BlockTable
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.memory.kv_cache_manager import AllocStatus
from jpaged.memory.sliding_window_tables import SlidingWindowTables
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)
RUNNING, SWAPPED, WAITING = SequenceStatus.RUNNING, SequenceStatus.SWAPPED, SequenceStatus.WAITING


def cdiv(a, b):
    return -(-a // b)


FULL_ATTENTION = [(None,)]
SLIDING_WINDOW = [(1,), (3,), (7,)]
MIXED_GROUPS = [(None, 3), (None, 3, 3, 7), (None, None, 2, 2, 2, 2), (3, 7)]
LAYER_WINDOWS = [*FULL_ATTENTION * 2, *SLIDING_WINDOW, *MIXED_GROUPS]
"""Models' layer windows: one group without a window or with one, global and windowed
groups (Gemma-like), and two windows with no global group."""
MAX_CHUNK = 9  # the most tokens a `schedule` rule computes of a sequence in one step
MAX_PROPOSALS = 4  # the most proposals a `speculate` rule verifies per sequence


def setup_strategies(layer_windows):
    """The state machine's setup drawn over the models of `layer_windows`."""
    return dict(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 40),
        num_host_blocks=st.integers(0, 20),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
        share_blocks=st.booleans(),
        layer_windows=st.sampled_from(layer_windows),
        pass_groups=st.booleans(),
    )


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(**setup_strategies(LAYER_WINDOWS))
    def setup(self, block_size, num_blocks, num_host_blocks, caching, watermark, share_blocks,
              layer_windows, pass_groups=True):
        """pass_groups: a model of one group may also come as the config's window alone."""
        groups = KVCacheGroups.of(layer_windows)
        config = CacheConfig(block_size, num_blocks, num_host_blocks, caching, watermark,
                             share_blocks, groups.windows[0], max_num_batched_tokens=MAX_CHUNK)
        if pass_groups or groups.num_groups > 1:
            self.bm = BlockManager(config, groups)
        else:
            self.bm = BlockManager(config)
        self.windows = groups.windows
        # Each group's tables are of its attention type; only a lone group's grow in a
        # decode loop on the device.
        assert [isinstance(tables, SlidingWindowTables) for tables in self.bm.group_tables] == [
            window is not None for window in self.windows]
        assert self.bm.adopts_device_blocks == (len(self.windows) == 1)
        self.table_lens: dict[int, list[int]] = {}  # see expected_table_lens
        self.share_blocks = share_blocks
        self.bs, self.num_blocks, self.num_host_blocks = block_size, num_blocks, num_host_blocks
        self.groups: list[SequenceGroup] = []
        self.next_id = 0
        self.device_kv: dict[int, tuple] = {}
        self.host_kv: dict[int, tuple] = {}
        self.pending: list[tuple[Sequence, int]] = []
        self.written_now: set[int] = set()  # device blocks this step's swap-in or copies write
        self.owing: set[int] = set()  # children forked without sharing, not yet appended
        self.finished: list[tuple[list[int], str | None]] = []  # computed tokens, salt
        self.reserved: dict[int, tuple[list[int], str | None]] = {}  # id -> prefix, salt

    # Helpers ---------------------------------------------------------------------

    def kv(self, group, seq, position):
        """What position's slot holds: its prefix, proposals included (a verifying step
        writes their K/V before it knows which it keeps)."""
        return group.cache_salt, tuple((seq.token_ids + seq.spec_token_ids)[: position + 1])

    def tables(self, seq):
        """seq's device table in each KV cache group, as lists."""
        return [table.tolist() for table in self.bm.block_tables(seq)]

    def host_tables_of(self, seq):
        return [table.tolist() for table in self.bm.host_block_tables(seq)]

    def num_released(self, seq, g):
        """Leading blocks of group g that no query from seq's next token on reads: those
        wholly before key position num_computed_tokens - W + 1."""
        window = self.windows[g]
        if window is None:
            return 0
        return max(0, seq.num_computed_tokens - window + 1) // self.bs

    def expected_table_lens(self, seq):
        """The entries of seq's table in each group, by definition: at admission every
        block of its tokens in a global group and its prefix hits in a windowed one
        (chunks add the rest), then every block up to the furthest slot a step asked
        for (rejected proposals' included); a fork's child has its parent's."""
        return self.table_lens[seq.seq_id]

    def admitted(self, seq):
        self.table_lens[seq.seq_id] = [
            cdiv(len(seq), self.bs) if window is None else seq.num_computed_tokens // self.bs
            for window in self.windows]

    def appended(self, seq, num_new):
        reach = cdiv(seq.num_computed_tokens + num_new, self.bs)
        self.table_lens[seq.seq_id] = [max(n, reach) for n in self.table_lens[seq.seq_id]]

    def most_blocks(self, num_tokens, num_new):
        """The blocks a sequence of num_tokens may hold in all groups at once when a step
        computes num_new of its tokens: all of a global group's, and of a windowed one's
        those from the window before the first new token to the last new one."""
        blocks = cdiv(num_tokens, self.bs)
        return sum(blocks if w is None else min(blocks, cdiv(w - 1 + num_new, self.bs) + 1)
                   for w in self.windows)

    def live(self, status):
        return [(g, s) for g in self.groups for s in g.seqs if s.status is status]

    def busy(self, group):
        return any(seq in group.seqs for seq, _ in self.pending)

    def groups_with(self, status, idle=True):
        return [g for g in self.groups if g.seqs_with(status) and not (idle and self.busy(g))]

    def decoding_groups(self):
        """Idle groups whose running sequences all have only their last token to compute."""
        return [g for g in self.groups_with(RUNNING)
                if all(s.num_uncomputed_tokens == 1 for s in g.seqs_with(RUNNING))]

    def beam_groups(self):
        """Idle groups with at least two running sequences: room for a beam-search step."""
        return [g for g in self.groups_with(RUNNING) if len(g.seqs_with(RUNNING)) > 1]

    def beams_beside_pending(self):
        """Running sequences whose group has another sequence with slots in the open step."""
        pending = {seq for seq, _ in self.pending}
        return [
            (g, s)
            for g, s in self.live(RUNNING)
            if any(other in pending and other is not s for other in g.seqs)
        ]

    def note_copies(self, seq, tables_before):
        """Add the blocks of seq's tables that this step's copies fill to `written_now`.

        An entry that differs from `tables_before` under a computed token is a
        copy: the manager copies blocks with KV, never empty ones.
        """
        for before_table, table in zip(tables_before, self.tables(seq), strict=True):
            for i, (before, now) in enumerate(zip(before_table, table, strict=False)):
                if before != now and i * self.bs < seq.num_computed_tokens:
                    self.written_now.add(now)

    def fork_seq(self, group, parent):
        """Fork `parent` as the engine does: the child shares every block; without
        sharing it owes their copies to its next append."""
        child = Sequence(
            self.next_id,
            list(parent.prompt_token_ids),
            list(parent.output_token_ids),
            RUNNING,
            parent.num_computed_tokens,
        )
        self.next_id += 1
        self.bm.fork(parent, child)
        self.table_lens[child.seq_id] = list(self.table_lens[parent.seq_id])
        group.seqs.append(child)
        assert self.tables(child) == self.tables(parent)
        if not self.share_blocks:
            self.owing.add(child.seq_id)

    def drop(self, group, seq):
        """Free a pruned beam at once: it leaves its group and the open step."""
        self.bm.free(seq)
        group.seqs.remove(seq)
        self.pending = [(s, n) for s, n in self.pending if s is not seq]

    def device_tables(self):
        """The blocks of the running sequences' tables in every group, released entries
        left out (each checked to be the null block, and to be the only null entries)."""
        tables = []
        for _, seq in self.live(RUNNING):
            for g, table in enumerate(self.tables(seq)):
                released = self.num_released(seq, g)
                assert table[:released] == [0] * released, (seq.seq_id, g, table, released)
                assert 0 not in table[released:], "the null block is handed out"
                tables.append(table[released:])
        return tables

    def host_tables(self):
        return [table for _, s in self.live(SWAPPED) for table in self.host_tables_of(s)]

    def expected_append_blocks(self, seqs, num_new):
        """Blocks append_slots consumes, by replaying it on a copy of the refcounts."""
        refcounts, needed = {}, 0
        for seq, n in zip(seqs, num_new, strict=True):
            for table in self.tables(seq):
                first = seq.num_computed_tokens // self.bs
                last = (seq.num_computed_tokens + n - 1) // self.bs
                needed += max(0, last + 1 - len(table))
                copied = table[:] if seq.seq_id in self.owing else table[first : last + 1]
                for block in copied:
                    count = refcounts.setdefault(block, self.bm.refcount(block))
                    if count > 1:
                        needed += 1
                        refcounts[block] = count - 1
        return needed

    # Rules -----------------------------------------------------------------------

    @rule(prompt=TOKENS, salt=st.sampled_from([None, "tenant"]))
    def add_request(self, prompt, salt):
        self.add(prompt, salt)

    @precondition(lambda self: self.live(RUNNING))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def add_follow_up(self, data, extra):
        """A prompt that continues a running sequence's computed tokens: the prefix
        cache's case, with hits that reach past a window."""
        group, seq = data.draw(st.sampled_from(self.live(RUNNING)))
        self.add(seq.token_slice(0, seq.num_computed_tokens) + extra, group.cache_salt)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def add_next_round(self, data, extra):
        """A prompt that continues a finished sequence's tokens, as a conversation's next
        round: its blocks may have left the device and wait in the host tier."""
        tokens, salt = data.draw(st.sampled_from(self.finished))
        self.add(tokens + extra, salt)

    @precondition(lambda self: self.finished or self.live(RUNNING))
    @rule(data=st.data())
    def reserve(self, data):
        """Reserve a finished or running sequence's computed tokens, or a prefix of them:
        refused (a ValueError) when a full block is no longer on the device or the
        reservations would hold too much, and then nothing changes."""
        computed = self.finished + [(seq.token_slice(0, seq.num_computed_tokens),
                                     group.cache_salt) for group, seq in self.live(RUNNING)]
        tokens, salt = data.draw(st.sampled_from(computed))
        if not tokens:
            return
        tokens = tokens[: data.draw(st.integers(1, len(tokens)))]
        refcounts = self.bm.state.device.refcounts.copy()
        try:
            prefix = self.bm.reserve(tokens, salt)
        except ValueError:
            np.testing.assert_array_equal(self.bm.state.device.refcounts, refcounts)
            return
        assert prefix.num_cached_tokens == len(tokens) // self.bs * self.bs
        self.reserved[prefix.prefix_id] = (tokens, salt)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def release(self, data):
        prefix_id = data.draw(st.sampled_from(sorted(self.reserved)))
        self.bm.release(prefix_id)
        del self.reserved[prefix_id]
        with pytest.raises(ValueError, match=f"no prefix {prefix_id} is reserved"):
            self.bm.release(prefix_id)

    def reserved_blocks(self):
        """The blocks each reservation holds, per group, as lists."""
        return [group.tolist() for group in self.bm.reserved_prefixes.held()]

    def check_reserved_contents(self):
        """Each reservation's blocks hold its prefix: in group 0 every full block, in a
        windowed group the full blocks in the window of the prefix's end."""
        for reservation in self.bm.reserved_prefixes:
            tokens, salt = self.reserved[reservation.prefix_id]
            num_full = len(tokens) // self.bs
            for g, blocks in enumerate(reservation.blocks):
                window = self.windows[g]
                first = 0 if g == 0 or window is None else (
                    max(0, num_full * self.bs - window + 1) // self.bs)
                assert len(blocks) == num_full - first, (g, len(blocks), num_full, first)
                for i, block in enumerate(blocks.tolist(), start=first):
                    for offset in range(self.bs):
                        position = i * self.bs + offset
                        assert self.device_kv.get(block * self.bs + offset) == (
                            salt, tuple(tokens[: position + 1])), (g, i)

    def add(self, prompt, salt):
        group = SequenceGroup(str(self.next_id), [Sequence(self.next_id, prompt)], cache_salt=salt)
        self.next_id += 1
        capacity = self.bm.num_device_blocks - self.bm.watermark_blocks
        status = self.bm.can_allocate(group)
        assert (status is AllocStatus.NEVER) == (self.most_blocks(len(prompt), MAX_CHUNK)
                                                 > capacity)
        if status is AllocStatus.NEVER:
            self.bm.free(group.seqs[0])
        else:
            self.groups.append(group)

    @precondition(lambda self: self.groups_with(WAITING))
    @rule(data=st.data())
    def admit(self, data):
        group = data.draw(st.sampled_from(self.groups_with(WAITING)))
        if self.bm.can_allocate(group) is not AllocStatus.OK:
            return
        self.bm.allocate(group)
        for seq in group.seqs_with(WAITING):
            for window, table in zip(self.windows, self.tables(seq), strict=True):
                if window is None:
                    assert len(table) == cdiv(len(seq), self.bs)
                else:  # a windowed table starts with its prefix hits; chunks add the rest
                    assert len(table) * self.bs == seq.num_computed_tokens
            assert seq.num_computed_tokens % self.bs == 0
            assert seq.num_computed_tokens <= len(seq) - 1
            if not self.bm.enable_prefix_caching:
                assert seq.num_computed_tokens == 0
            self.admitted(seq)
            seq.status = RUNNING

    @precondition(lambda self: self.groups_with(RUNNING))
    @rule(data=st.data(), chunk=st.integers(1, MAX_CHUNK))
    def schedule(self, data, chunk):
        group = data.draw(st.sampled_from(self.groups_with(RUNNING)))
        seqs = group.seqs_with(RUNNING)
        num_new = [min(chunk, seq.num_uncomputed_tokens) for seq in seqs]
        fits = self.expected_append_blocks(seqs, num_new) <= self.bm.num_free_blocks
        if len(set(num_new)) == 1:
            assert self.bm.can_append_slots(group, num_new[0]) == fits
        if not fits:
            return
        for seq, n in zip(seqs, num_new, strict=True):
            tables_before = self.tables(seq)
            self.bm.append_slots(seq, n)
            self.appended(seq, n)
            self.owing.discard(seq.seq_id)
            self.note_copies(seq, tables_before)
            start = seq.num_computed_tokens
            for g, table in enumerate(self.tables(seq)):
                written = {table[p // self.bs] for p in range(start, start + n)}
                assert all(self.bm.refcount(block) == 1 for block in written)
                window = self.windows[g]
                if window is not None:  # the window before the chunk, and the chunk
                    # Slots past the chunk are rejected proposals' (kept for the next).
                    reach = min(len(table), cdiv(start + n, self.bs))
                    held = reach - self.num_released(seq, g)
                    assert held <= cdiv(window - 1 + n, self.bs) + 1, (g, held, n)
            self.pending.append((seq, n))

    @precondition(lambda self: self.decoding_groups())
    @rule(data=st.data(), k=st.integers(1, MAX_PROPOSALS))
    def speculate(self, data, k):
        """A verifying step: every running sequence of a group gets slots for its last
        token and k proposals (the engine gives a group's sequences as many each)."""
        group = data.draw(st.sampled_from(self.decoding_groups()))
        seqs = group.seqs_with(RUNNING)
        fits = self.expected_append_blocks(seqs, [1 + k] * len(seqs)) <= self.bm.num_free_blocks
        assert self.bm.can_append_slots(group, 1 + k) == fits
        if not fits:
            return
        for seq in seqs:
            seq.spec_token_ids = data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k))
            tables_before = self.tables(seq)
            self.bm.append_slots(seq, 1 + k)
            self.appended(seq, 1 + k)
            self.owing.discard(seq.seq_id)
            self.note_copies(seq, tables_before)
            self.pending.append((seq, 1 + k))

    @precondition(lambda self: self.groups_with(RUNNING))
    @rule(data=st.data())
    def fork(self, data):
        group = data.draw(st.sampled_from(self.groups_with(RUNNING)))
        self.fork_seq(group, data.draw(st.sampled_from(group.seqs_with(RUNNING))))

    @precondition(lambda self: self.beam_groups())
    @rule(data=st.data())
    def drop_beam(self, data):
        """One beam-search step between device steps: prune beams, fork survivors in their place."""
        group = data.draw(st.sampled_from(self.beam_groups()))
        beams = group.seqs_with(RUNNING)
        num_dropped = data.draw(st.integers(1, len(beams) - 1))
        dropped = data.draw(st.permutations(beams))[:num_dropped]
        for beam in dropped:
            self.drop(group, beam)
        survivors = [beam for beam in beams if beam not in dropped]
        for _ in dropped:
            self.fork_seq(group, data.draw(st.sampled_from(survivors)))

    @precondition(lambda self: self.beams_beside_pending())
    @rule(data=st.data())
    def drop_beam_mid_step(self, data):
        """Prune a beam while others of its group have slots in the open step."""
        group, beam = data.draw(st.sampled_from(self.beams_beside_pending()))
        self.drop(group, beam)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort_mid_step(self, data):
        """Abort a request in any state: waiting, swapped, or with slots in the open step."""
        group = data.draw(st.sampled_from(self.groups))
        for seq in group.seqs:
            self.bm.free(seq)
        self.pending = [(s, n) for s, n in self.pending if s not in group.seqs]
        self.groups.remove(group)

    @precondition(lambda self: self.groups_with(RUNNING) or self.groups_with(SWAPPED))
    @rule(data=st.data())
    def finish(self, data):
        candidates = self.groups_with(RUNNING) + self.groups_with(SWAPPED)
        group = data.draw(st.sampled_from(candidates))
        seq = data.draw(st.sampled_from(group.unfinished_seqs()))
        self.bm.free(seq)
        self.finished.append((seq.token_slice(0, seq.num_computed_tokens), group.cache_salt))
        seq.status = SequenceStatus.FINISHED_STOPPED
        if group.is_finished:
            self.groups.remove(group)

    @precondition(lambda self: self.groups_with(RUNNING))
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self.groups_with(RUNNING)))
        seqs = group.seqs_with(RUNNING)
        distinct = {block for seq in seqs for table in self.tables(seq) for block in table} - {0}
        fits = len(distinct) <= self.bm.num_free_host_blocks
        # The step's swap-in or copies write those blocks, after its swap-outs.
        clash = not distinct.isdisjoint(self.written_now | self.loaded_now())
        assert self.bm.can_swap_out(group) == (fits and not clash)
        if fits and clash:
            with pytest.raises(ValueError, match="written by this step"):
                self.bm.swap_out(group)
        elif fits:
            self.bm.swap_out(group)
            for seq in seqs:
                seq.status = SWAPPED

    @precondition(lambda self: self.groups_with(SWAPPED))
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.groups_with(SWAPPED)))
        seqs = group.seqs_with(SWAPPED)
        required = len({block for seq in seqs for table in self.host_tables_of(seq)
                        for block in table})
        status = self.bm.can_swap_in(group)
        capacity = self.bm.num_device_blocks - self.bm.watermark_blocks
        assert (status is AllocStatus.NEVER) == (required > capacity)
        if status is AllocStatus.OK:
            assert self.bm.num_free_blocks - required >= self.bm.watermark_blocks
            self.bm.swap_in(group)
            self.written_now.update(b for seq in seqs for table in self.tables(seq)
                                    for b in table)
            for seq in seqs:
                seq.status = RUNNING

    @precondition(lambda self: self.groups_with(RUNNING))
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        group = data.draw(st.sampled_from(self.groups_with(RUNNING)))
        for seq in group.unfinished_seqs():
            self.bm.free(seq)
            self.owing.discard(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = WAITING

    @rule(data=st.data())
    def end_step(self, data):
        ops = self.bm.end_step()
        self.apply_block_ops(ops)
        # Committed: before mark_computed stores the next step's tier copies.
        self.check_committed_state()
        for seq, n in self.pending:
            group = next(g for g in self.groups if seq in g.seqs)
            for table in self.tables(seq):
                for position in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                    block = table[position // self.bs]
                    assert self.bm.state.device.refcounts[block] == 1, "write into a shared block"
                    slot = block * self.bs + position % self.bs
                    self.device_kv[slot] = self.kv(group, seq, position)
            if seq.spec_token_ids:  # the first `accepted` proposals stay, then a new token
                accepted = data.draw(st.integers(0, len(seq.spec_token_ids)))
                seq.num_computed_tokens += 1 + accepted
                seq.output_token_ids += seq.spec_token_ids[:accepted]
                seq.spec_token_ids = []
            else:
                seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):
                seq.append_token(data.draw(st.integers(0, 2)))
            self.bm.mark_computed(seq)
        self.pending.clear()
        self.written_now.clear()
        self.check_kv_contents()
        self.check_reserved_contents()
        self.bm.check_invariants([s for _, s in self.live(RUNNING)],
                                 [s for _, s in self.live(SWAPPED)])

    def loaded_now(self):
        """Device blocks this step loads from the host tier, as the open step recorded."""
        ops = self.bm.state.ops
        return set(ops.load[: ops.sizes[3], 1].tolist())

    def apply_block_ops(self, ops):
        # A phase is one scatter on the device, which leaves a repeated destination's
        # value undefined; across phases a second write would clobber the first.
        device_writes = (ops.swap_in[:, 1].tolist() + ops.load[:, 1].tolist()
                         + ops.copies[:, 1].tolist())
        assert len(set(device_writes)) == len(device_writes), "a device block written twice"
        host_writes = ops.swap_out[:, 1].tolist() + ops.store[:, 1].tolist()
        assert len(set(host_writes)) == len(host_writes), "a host block written twice"
        if len(ops.load):
            event("a prefix hit loaded from the host tier")
        bs = self.bs
        for pairs, source, dest in ((ops.swap_out, self.device_kv, self.host_kv),
                                    (ops.store, self.device_kv, self.host_kv),
                                    (ops.swap_in, self.host_kv, self.device_kv),
                                    (ops.load, self.host_kv, self.device_kv)):
            for block, other in pairs.tolist():
                for offset in range(bs):
                    dest[other * bs + offset] = source.get(block * bs + offset)
        sources = {
            (src, offset): self.device_kv.get(src * bs + offset)
            for src, _ in ops.copies.tolist()
            for offset in range(bs)
        }
        for src, dst in ops.copies.tolist():
            for offset in range(bs):
                self.device_kv[dst * bs + offset] = sources[src, offset]

    def check_kv_contents(self):
        for status, kv, tables_of in (
            (RUNNING, self.device_kv, self.tables),
            (SWAPPED, self.host_kv, self.host_tables_of),
        ):
            for group, seq in self.live(status):
                for g, table in enumerate(tables_of(seq)):
                    # A host table holds the blocks only, without the released entries.
                    released = self.num_released(seq, g)
                    offset = released if status is SWAPPED else 0
                    for position in range(released * self.bs, seq.num_computed_tokens):
                        block = table[position // self.bs - offset]
                        slot = block * self.bs + position % self.bs
                        assert kv.get(slot) == self.kv(group, seq, position), (
                            seq.seq_id, g, position)

    def check_committed_state(self):
        state = self.bm.state
        used = np.bincount(sum(self.device_tables() + self.reserved_blocks(), []),
                           minlength=self.num_blocks)
        np.testing.assert_array_equal(state.device.refcounts, used)
        free = free_queue(state.device)
        assert sorted(free) == [b for b in range(1, self.num_blocks) if used[b] == 0]
        assert self.bm.physical_blocks_used == np.count_nonzero(used)
        assert self.bm.num_free_blocks + self.bm.physical_blocks_used == self.num_blocks - 1
        host_used = np.bincount(sum(self.host_tables(), []), minlength=self.num_host_blocks)
        np.testing.assert_array_equal(state.host.refcounts, host_used)
        assert state.host.num_free == np.count_nonzero(host_used == 0)

    @invariant()
    def no_blocks_past_the_proposals(self):
        """A table reaches no further than the sequence's last token and the most
        proposals a step verifies: rejected proposals leave their blocks for the next
        ones, never more."""
        if not hasattr(self, "bm"):
            return
        for _, seq in self.live(RUNNING):
            for table in self.tables(seq):
                assert len(table) <= cdiv(len(seq) + MAX_PROPOSALS, self.bs), (
                    seq.seq_id, len(table), len(seq))

    @invariant()
    def tables_are_as_long_as_their_definition(self):
        """Each group's table of a live sequence has its expected entries
        (expected_table_lens); those before the window of its next token are released:
        null on the device, left out of a host table (whose pool has no null block)."""
        if not hasattr(self, "bm"):
            return
        for status, tables_of in ((RUNNING, self.tables), (SWAPPED, self.host_tables_of)):
            for _, seq in self.live(status):
                for g, (table, expected) in enumerate(zip(
                        tables_of(seq), self.expected_table_lens(seq), strict=True)):
                    released = self.num_released(seq, g)
                    if status is SWAPPED:
                        assert len(table) == expected - released, (seq.seq_id, g, table)
                        continue
                    assert len(table) == expected, (seq.seq_id, g, table, expected)
                    assert table[:released] == [0] * released, (seq.seq_id, g, table)
                    assert 0 not in table[released:], (seq.seq_id, g, table)

    @invariant()
    def decode_slot_claims_hold(self):
        """has_decode_slot promises a private, existing slot for the next token."""
        if not hasattr(self, "bm"):
            return
        holders = np.bincount(sum(self.device_tables(), []), minlength=self.num_blocks)
        for _, seq in self.live(RUNNING):
            index = seq.num_computed_tokens // self.bs
            owned = all(index < len(table) and holders[table[index]] == 1
                        for table in self.tables(seq))
            if self.bm.has_decode_slot(seq):
                assert owned, "a decode slot claimed that is missing or shared"

    @invariant()
    def refcounts_count_table_entries(self):
        if not hasattr(self, "bm"):
            return
        tables = self.device_tables()
        entries = sum(tables, [])
        counts = np.bincount(entries + sum(self.reserved_blocks(), []),
                             minlength=self.num_blocks)
        for block in range(self.num_blocks):
            assert self.bm.refcount(block) == counts[block]
        host_counts = np.bincount(sum(self.host_tables(), []), minlength=self.num_host_blocks)
        for block in range(self.num_host_blocks):
            assert self.bm.host_refcount(block) == host_counts[block]
        assert self.bm.logical_blocks_used == len(entries)
        assert self.bm.num_free_blocks + np.count_nonzero(counts) <= self.num_blocks - 1
        for _, seq in self.live(RUNNING):
            for table in self.tables(seq):
                assert len(table) >= cdiv(seq.num_computed_tokens, self.bs)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for group in self.groups:
            for seq in group.seqs:
                self.bm.free(seq)
        for prefix_id in list(self.reserved):
            self.bm.release(prefix_id)
        self.bm.end_step()
        assert self.bm.num_free_blocks == self.num_blocks - 1, "leaked device blocks"
        assert self.bm.num_free_host_blocks == self.num_host_blocks, "leaked host blocks"
        assert not self.bm.state.device.refcounts.any()
        assert self.bm.logical_blocks_used == 0


class TestBlockManager(BlockManagerMachine.TestCase):
    settings = settings(max_examples=40, stateful_step_count=200, deadline=None)


# Long runs reach what short ones rarely do: a beam forked, scheduled and pruned
# in one step while another request swaps in through a nearly full pool.
@pytest.mark.full
class TestBlockManagerLongRuns(BlockManagerMachine.TestCase):
    settings = settings(max_examples=250, stateful_step_count=200, deadline=None)


def make_manager(**overrides):
    config = dict(block_size=4, num_blocks=9, num_host_blocks=8, watermark=0.0)
    return BlockManager(CacheConfig(**{**config, **overrides}))


def running_group(manager, seq_id, prompt, salt=None):
    group = SequenceGroup(str(seq_id), [Sequence(seq_id, prompt)], cache_salt=salt)
    manager.allocate(group)
    group.seqs[0].status = RUNNING
    return group


def test_can_allocate_is_never_beyond_the_pool_and_keeps_the_watermark():
    manager = make_manager(num_blocks=11, watermark=0.2)  # 10 usable, 2 kept back
    too_long = SequenceGroup("a", [Sequence(0, list(range(33)))])  # 9 blocks
    assert manager.can_allocate(too_long) is AllocStatus.NEVER
    running_group(manager, 1, list(range(100, 120)))  # 5 blocks
    fits = SequenceGroup("b", [Sequence(2, list(range(200, 212)))])  # 3 blocks: 5 - 3 >= 2
    later = SequenceGroup("c", [Sequence(3, list(range(300, 316)))])  # 4 blocks: 5 - 4 < 2
    assert manager.can_allocate(fits) is AllocStatus.OK
    assert manager.can_allocate(later) is AllocStatus.LATER


def test_allocate_beyond_free_blocks_raises_before_any_change():
    manager = make_manager(num_blocks=4)
    group = SequenceGroup("a", [Sequence(0, list(range(13)))])
    with pytest.raises(ValueError, match="needs 4 free blocks, only 3"):
        manager.allocate(group)
    assert manager.num_free_blocks == 3 and manager.logical_blocks_used == 0


def test_copy_on_write_after_fork_copies_the_partial_block():
    manager = make_manager()
    group = running_group(manager, 0, list(range(6)))
    parent = group.seqs[0]
    manager.append_slots(parent, 6)
    manager.end_step()
    parent.num_computed_tokens = 6
    child = Sequence(1, list(parent.prompt_token_ids), [], RUNNING, 6)
    manager.fork(parent, child)
    group.seqs.append(child)
    assert manager.physical_blocks_used == 2 and manager.logical_blocks_used == 4
    shared_last = manager.block_table(parent)[1]
    manager.append_slots(parent, 1)
    manager.append_slots(child, 1)
    ops = manager.end_step()
    private = manager.block_table(parent)[1]
    assert ops.copies.tolist() == [[shared_last, private]]
    assert manager.block_table(child)[1] == shared_last  # the last writer keeps it
    assert manager.block_table(parent)[0] == manager.block_table(child)[0]


def test_can_append_slots_lets_the_last_writer_keep_a_shared_block():
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    group = running_group(manager, 0, list(range(6)))  # 2 blocks
    parent = group.seqs[0]
    manager.append_slots(parent, 6)
    parent.num_computed_tokens = 6
    group.seqs.append(Sequence(1, list(range(6)), [], RUNNING, 6))
    manager.fork(parent, group.seqs[1])
    # Both write into the shared second block: one copy, not two.
    assert manager.num_free_blocks == 1
    assert manager.can_append_slots(group, 1)
    assert not manager.can_append_slots(group, 3)  # plus a third block each
    third = Sequence(2, list(range(6)), [], RUNNING, 6)
    manager.fork(parent, third)
    group.seqs.append(third)
    assert not manager.can_append_slots(group, 1)  # three writers need two copies


def test_decode_slot_is_recognised_until_the_block_fills_or_is_shared():
    manager = make_manager()
    group = running_group(manager, 0, list(range(5)))
    seq = group.seqs[0]
    manager.append_slots(seq, 5)
    manager.end_step()
    seq.num_computed_tokens = 5
    seq.append_token(1)
    assert manager.has_decode_slot(seq)  # position 5 lies in the second, private block
    seq.num_computed_tokens = len(manager.block_table(seq)) * manager.block_size
    assert not manager.has_decode_slot(seq)  # the next token starts a new block
    seq.num_computed_tokens = 5
    child = Sequence(1, list(seq.prompt_token_ids), list(seq.output_token_ids), RUNNING, 5)
    manager.fork(seq, child)
    assert not manager.has_decode_slot(seq) and not manager.has_decode_slot(child)


def test_swap_moves_shared_blocks_once_and_back():
    manager = make_manager()
    group = running_group(manager, 0, list(range(8)))
    parent = group.seqs[0]
    child = Sequence(1, list(parent.prompt_token_ids), [], RUNNING, 0)
    manager.fork(parent, child)
    group.seqs.append(child)
    device_table = list(manager.block_table(parent))
    manager.swap_out(group)
    ops = manager.end_step()
    assert ops.swap_out[:, 0].tolist() == device_table
    assert manager.num_free_blocks == 8 and manager.num_free_host_blocks == 6
    for seq in group.seqs:
        seq.status = SWAPPED
    host_table = list(manager.host_block_table(parent))
    assert host_table == manager.host_block_table(child) and len(set(host_table)) == 2
    manager.swap_in(group)
    ops = manager.end_step()
    assert ops.swap_in[:, 0].tolist() == host_table
    assert ops.swap_in[:, 1].tolist() == manager.block_table(parent) == manager.block_table(child)
    assert manager.num_free_host_blocks == 8


def test_block_table_grows_and_reads_like_a_list():
    table = BlockTable([3, 1])
    model = [3, 1]
    for blocks in ([4], list(range(5, 25)), [], [9, 9]):
        table.extend(blocks)
        model += blocks
        assert table == model and len(table) == len(model) and list(table) == model
        assert table.array.dtype == np.int32 and not table.array.flags.writeable
        np.testing.assert_array_equal(table.array, model)
    copy = table.copy()
    table.replace(0, 77)
    assert table[0] == 77 and table[-1] == 9 and copy[0] == 3 and table[1:3] == [1, 4]


def test_free_unknown_sequence_is_a_no_op():
    manager = make_manager()
    manager.free(Sequence(5, [1, 2, 3]))
    assert manager.num_free_blocks == 8


def forked_pair(manager, num_tokens):
    """A computed parent of `num_tokens` prompt tokens and a child forked from it."""
    group = running_group(manager, 0, list(range(num_tokens)))
    parent = group.seqs[0]
    manager.append_slots(parent, num_tokens)
    manager.end_step()
    parent.num_computed_tokens = num_tokens
    child = Sequence(1, list(parent.prompt_token_ids), [], RUNNING, num_tokens)
    manager.fork(parent, child)
    group.seqs.append(child)
    return group


def test_fork_without_sharing_copies_every_block_before_the_first_write():
    manager = make_manager(num_blocks=12, share_blocks=False)
    parent, child = forked_pair(manager, 14).seqs  # 3 full blocks and 2 tokens
    assert manager.end_step().copies.size == 0  # shared until the child runs
    assert not manager.has_decode_slot(child)
    assert manager.can_append_slots(SequenceGroup("c", [child]), 1)
    parent_table = manager.block_table(parent).tolist()
    manager.append_slots(child, 1)
    ops = manager.end_step()
    child_table = manager.block_table(child).tolist()
    assert set(child_table).isdisjoint(parent_table)
    assert ops.copies.tolist() == [[p, c] for p, c in zip(parent_table, child_table, strict=True)]
    assert manager.physical_blocks_used == manager.logical_blocks_used == 8
    child.num_computed_tokens += 1
    assert manager.has_decode_slot(child)  # private from now on


def test_fork_with_sharing_takes_no_blocks():
    manager = make_manager(num_blocks=12)
    parent, child = forked_pair(manager, 14).seqs
    assert manager.end_step().copies.size == 0
    assert manager.block_table(child) == manager.block_table(parent)
    assert manager.physical_blocks_used == 4 < manager.logical_blocks_used == 8


def test_copies_owed_without_sharing_count_against_the_pool():
    manager = make_manager(num_blocks=7, share_blocks=False)  # 6 usable blocks
    group = forked_pair(manager, 12)  # 3 blocks, both sequences computed
    # Each writes a fourth block; the child also copies the three it shares: 5 > 3 free.
    assert manager.num_free_blocks == 3
    assert not manager.can_append_slots(group, 1)
    parent, child = group.seqs
    manager.free(parent)  # the parent gone, the child holds the blocks alone
    assert manager.can_append_slots(SequenceGroup("c", [child]), 1)
    manager.append_slots(child, 1)
    assert manager.end_step().copies.size == 0


def test_a_fork_of_a_fork_in_one_step_copies_from_the_first_parent():
    manager = make_manager(share_blocks=False)
    parent, child = forked_pair(manager, 6).seqs
    manager.end_step()
    manager.append_slots(child, 1)  # the child copies the parent's two blocks
    grandchild = Sequence(2, list(child.prompt_token_ids), [], RUNNING, 6)
    manager.fork(child, grandchild)
    manager.append_slots(grandchild, 1)  # and its child copies those copies
    ops = manager.end_step()
    # All copies read before any is written: the second generation reads the originals.
    assert ops.copies[:, 0].tolist() == manager.block_table(parent).tolist() * 2


def test_a_beam_pruned_mid_step_keeps_its_copy_destination_from_the_steps_swap_in():
    manager = make_manager(num_blocks=4, num_host_blocks=1)  # 3 usable blocks
    swapped = running_group(manager, 5, [7, 7, 7, 7])
    manager.swap_out(swapped)
    swapped.seqs[0].status = SWAPPED
    manager.end_step()
    parent, child = forked_pair(manager, 6).seqs  # blocks 2, 3; block 1 is free
    manager.append_slots(parent, 1)  # copy-on-write of the shared last block into block 1
    manager.append_slots(child, 1)
    manager.free(parent)  # pruned before the step runs; the copy into block 1 still runs
    if manager.can_swap_in(swapped) is AllocStatus.OK:
        manager.swap_in(swapped)
    ops = manager.end_step()
    assert len(ops.copies) == 1
    # Swap-in runs before copies: a shared destination would end up with the copy's KV.
    assert set(ops.swap_in[:, 1].tolist()).isdisjoint(ops.copies[:, 1].tolist())
    assert manager.can_swap_in(swapped) is AllocStatus.OK  # block 1 is free after the step


def test_calls_that_need_the_other_side_of_a_swap_raise():
    manager = make_manager()
    group = running_group(manager, 0, list(range(6)))
    seq = group.seqs[0]
    manager.append_slots(seq, 6)
    manager.end_step()
    seq.num_computed_tokens = 6
    manager.swap_out(group)  # the caller has not marked seq SWAPPED yet
    for call in (
        lambda: manager.block_table(seq),
        lambda: manager.append_slots(seq, 3),
        lambda: manager.mark_computed(seq),
        lambda: manager.fork(seq, Sequence(1, list(range(6)))),
        lambda: manager.swap_out(group),
    ):
        with pytest.raises(ValueError, match="sequence 0 is swapped out"):
            call()
    seq.status = SWAPPED
    manager.swap_in(group)
    for call in (lambda: manager.host_block_table(seq), lambda: manager.swap_in(group)):
        with pytest.raises(ValueError, match="sequence 0 is on the device"):
            call()
    manager.free(seq)
    manager.end_step()
    assert manager.num_free_blocks == 8 and manager.num_free_host_blocks == 8


@pytest.mark.parametrize("chunk", [256, 4096])
def test_a_windowed_sequence_holds_only_its_window_as_it_grows(chunk):
    """A 4,096-token sequence with a 512-token window (Gemma 3's) over 16-token blocks:
    while a step computes C tokens, the table holds at most ceil((W - 1 + C) / 16) + 1
    blocks, each block it left is free in the pool, and its leading entries are the null
    block exactly as far as the window has passed."""
    window, block_size, length = 512, 16, 4096
    manager = BlockManager(CacheConfig(block_size=block_size, num_blocks=300, watermark=0.0,
                                       sliding_window=window, enable_prefix_caching=False))
    group = SequenceGroup("a", [Sequence(0, list(range(600)))])
    manager.allocate(group)
    seq = group.seqs[0]
    seq.status = RUNNING
    while len(seq) <= length:
        num_new = min(chunk, seq.num_uncomputed_tokens)
        manager.append_slots(seq, num_new)
        table = manager.block_table(seq).tolist()
        held = [block for block in table if block != 0]
        assert len(held) <= cdiv(window - 1 + num_new, block_size) + 1
        assert manager.num_free_blocks == 299 - len(held)
        manager.end_step()
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == len(seq):
            seq.append_token(7)
        manager.mark_computed(seq)
        first_key = max(0, seq.num_computed_tokens - window + 1)
        released = manager.block_table(seq).tolist()[: first_key // block_size]
        assert released == [0] * (first_key // block_size)
        manager.check_invariants([seq], [])
