"""The scheduler against a request-level oracle.

Every request's output tokens are fixed in advance by `token_of`, so whatever
the scheduler does (chunking, preemption by recompute or swap, forks) the
finished outputs must equal them exactly, and every block must be free again
at the end. A driver hands the scheduler those tokens through
`update_from_output`, as the engine hands it sampled ones, and checks the step
limits after every `schedule()`.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.baselines import ContiguousArena
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SampledTokens, SchedulerOutput
from jpaged.memory.block_manager import BlockManager
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus


def token_of(request: int, sample: int, position: int) -> int:
    """The token a request's sample emits at an output position."""
    return (request * 7919 + sample * 104729 + position * 31) % 32000


@dataclass(frozen=True)
class Req:
    index: int
    prompt: tuple[int, ...]
    output_len: int
    n: int = 1

    @property
    def request_id(self) -> str:
        return f"r{self.index}"

    def expected(self) -> list[list[int]]:
        return [[token_of(self.index, j, i) for i in range(self.output_len)] for j in range(self.n)]


def drawn(tokens: list[int]) -> SampledTokens:
    return SampledTokens(np.array(tokens, np.int64), np.ones(len(tokens), bool))


class Driver:
    """Runs a scheduler like an engine would, with the oracle's tokens instead of a model."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.config = scheduler.config
        self.reqs: dict[str, Req] = {}
        self.groups: dict[str, SequenceGroup] = {}
        self.outputs: list[SchedulerOutput] = []

    def add(self, req: Req) -> SequenceGroup:
        params = SamplingParams(n=req.n, max_tokens=req.output_len, ignore_eos=True)
        group = SequenceGroup(req.request_id, [Sequence(0, list(req.prompt))], params)
        self.scheduler.add_request(group)
        self.reqs[req.request_id], self.groups[req.request_id] = req, group
        return group

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self._check(output)
        self.scheduler.update_from_output(output, drawn(self._tokens(output)))
        self.outputs.append(output)
        return output

    def run(self, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def _check(self, output: SchedulerOutput) -> None:
        seqs = [seq for seq, _ in output.scheduled]
        assert len(set(map(id, seqs))) == len(seqs)
        assert len(seqs) <= self.config.max_num_seqs
        assert output.num_batched_tokens <= self.config.max_num_batched_tokens
        manager = self.scheduler.block_manager
        for seq, num_new in output.scheduled:
            assert seq.status is SequenceStatus.RUNNING
            assert 1 <= num_new <= seq.num_uncomputed_tokens
            if not self.config.enable_chunked_prefill:
                assert num_new >= seq.num_uncomputed_tokens - 1
            if isinstance(manager, BlockManager):
                slots = len(manager.block_table(seq)) * manager.block_size
                assert seq.num_computed_tokens + num_new <= slots

    def _tokens(self, output: SchedulerOutput) -> list[int]:
        """The oracle's next token for every draw: a prompt that becomes n samples draws
        n times from its one row, every other group once per running sequence."""
        tokens = []
        for group, rows in output.draws:
            req = self.reqs[group.request_id]
            for row in rows:
                seq, num_new = output.scheduled[row]
                assert seq.num_computed_tokens + num_new == len(seq), "draws before the end"
            seqs = [output.scheduled[row][0] for row in rows]
            running = group.seqs_with(SequenceStatus.RUNNING)
            if len(group.seqs) == 1 and req.n > 1:
                assert len(rows) == req.n and len(set(rows)) == 1
                samples = list(range(req.n))
            else:
                assert seqs == running, "every running sequence draws once"
                samples = [group.seqs.index(seq) for seq in seqs]
            assert len({len(seq.output_token_ids) for seq in seqs}) == 1, "samples out of lockstep"
            position = len(seqs[0].output_token_ids)
            tokens += [token_of(req.index, sample, position) for sample in samples]
        return tokens

    def outputs_of(self, request_id: str) -> list[list[int]]:
        """Output tokens per sample: a group keeps its sequences in sample order."""
        return [seq.output_token_ids for seq in self.groups[request_id].seqs]


def paged(block_size=4, num_blocks=33, num_host_blocks=0, prefix_caching=False, watermark=0.0):
    return BlockManager(
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=prefix_caching,
            watermark=watermark,
        )
    )


def make_driver(manager, **config) -> Driver:
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Driver(Scheduler(SchedulerConfig(**(defaults | config)), manager))


def random_reqs(seed: int, num: int, max_n: int = 1, max_total: int = 64) -> list[Req]:
    """Prompts from a few shared prefixes plus random tails, so prefix caching gets hits."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(50) for _ in range(rng.randrange(1, 20))) for _ in range(3)]
    reqs = []
    for index in range(num):
        tail = tuple(rng.randrange(50) for _ in range(rng.randrange(1, 20)))
        prompt = (rng.choice(prefixes) + tail)[: max_total - 1]
        output_len = rng.randrange(1, max_total - len(prompt) + 1)
        reqs.append(Req(index, prompt, output_len, rng.randrange(1, max_n + 1)))
    return reqs


def assert_all_free(manager) -> None:
    if isinstance(manager, BlockManager):
        assert manager.num_free_blocks == manager.num_device_blocks
        # No host block is held; the host tier's last stores may still wait for commit.
        assert not manager.state.host.refcounts.any()
        assert manager.logical_blocks_used == 0
    else:
        assert manager.holes == [(0, manager.num_slots)]


def assert_finished_exactly(driver: Driver, reqs: list[Req]) -> None:
    for req in reqs:
        group = driver.groups[req.request_id]
        assert all(seq.status is SequenceStatus.FINISHED_LENGTH for seq in group.seqs)
        assert driver.outputs_of(req.request_id) == req.expected()


PAGED_CASES = [
    # block_size, preemption_mode, chunked prefill, prefix caching, max parallel samples
    (4, "recompute", True, False, 1),
    (4, "recompute", False, True, 3),
    (1, "recompute", True, True, 2),
    (4, "swap", True, False, 3),
    (2, "swap", False, True, 2),
    (16, "recompute", True, True, 1),
]


@pytest.mark.parametrize("block_size,mode,chunked,prefix,max_n", PAGED_CASES)
def test_no_request_or_token_lost_under_memory_pressure(block_size, mode, chunked, prefix, max_n):
    manager = paged(
        block_size=block_size,
        num_blocks=128 // block_size + 1,
        num_host_blocks=256 // block_size if mode == "swap" else 0,
        prefix_caching=prefix,
    )
    driver = make_driver(
        manager,
        max_num_batched_tokens=64 if not chunked else 24,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
    )
    reqs = random_reqs(seed=block_size, num=40, max_n=max_n, max_total=40)
    for req in reqs:
        driver.add(req)
    driver.run()
    assert driver.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert all(not output.ignored for output in driver.outputs)
    assert_finished_exactly(driver, reqs)
    assert_all_free(manager)


class SpeculativeDriver(Driver):
    """A Driver whose decoding sequences carry up to k proposals each step, as the engine
    gives them (as many for every sequence of a group, none for a prompt's first token,
    none past max_tokens' last token or max_model_len): the oracle's next tokens with
    one wrong at a random place, or none. It verifies them as greedy decoding does:
    the leading proposals equal to the oracle's tokens are accepted, then the oracle's
    next token."""

    def __init__(self, scheduler: Scheduler, k: int, seed: int):
        super().__init__(scheduler)
        self.k, self.rng = k, random.Random(seed)
        self.num_accepted = 0

    def step(self) -> SchedulerOutput:
        self._propose()
        output = self.scheduler.schedule()
        self._check(output)
        tokens, accepted = self._verify(output)
        self.scheduler.update_from_output(output, SampledTokens(
            np.array(tokens, np.int64), np.ones(len(tokens), bool),
            num_accepted=np.array(accepted, np.int64)))
        self.outputs.append(output)
        return output

    def _propose(self) -> None:
        for group in [*self.scheduler.running, *self.scheduler.swapped]:
            req, seqs = self.reqs[group.request_id], group.unfinished_seqs()
            proposals = [self._proposals(req, group, seq) for seq in seqs]
            num = min(map(len, proposals), default=0)
            for seq, proposed in zip(seqs, proposals, strict=True):
                seq.spec_token_ids = proposed[:num]

    def _proposals(self, req: Req, group: SequenceGroup, seq: Sequence) -> list[int]:
        if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return []
        position = len(seq.output_token_ids)
        limit = min(self.k, self.config.max_model_len - len(seq), req.output_len - position - 1)
        sample = group.seqs.index(seq)
        proposed = [token_of(req.index, sample, position + j) for j in range(max(limit, 0))]
        if proposed and self.rng.random() < 0.5:
            proposed[self.rng.randrange(len(proposed))] = -1  # a wrong guess
        return proposed

    def _check(self, output: SchedulerOutput) -> None:
        for seq, num_new in output.scheduled:
            if seq.spec_token_ids:  # all of its proposals, or it would not run
                assert num_new == 1 + len(seq.spec_token_ids) and seq.num_uncomputed_tokens == 1
        verifying = {id(seq) for seq, _ in output.scheduled if seq.spec_token_ids}
        super()._check(dataclasses.replace(output, scheduled=[
            (seq, 1 if id(seq) in verifying else n) for seq, n in output.scheduled]))

    def _verify(self, output: SchedulerOutput) -> tuple[list[int], list[int]]:
        tokens, accepted = [], []
        for group, rows in output.draws:
            req = self.reqs[group.request_id]
            for index, row in enumerate(rows):
                seq = output.scheduled[row][0]
                sample = index if len(group.seqs) == 1 else group.seqs.index(seq)
                position = len(seq.output_token_ids)
                count = 0
                for j, proposal in enumerate(seq.spec_token_ids):
                    if proposal != token_of(req.index, sample, position + j):
                        break
                    count += 1
                tokens.append(token_of(req.index, sample, position + count))
                accepted.append(count)
                self.num_accepted += count
        return tokens, accepted


@pytest.mark.parametrize("block_size,mode,chunked,prefix,max_n", PAGED_CASES)
def test_speculation_loses_and_adds_no_token(block_size, mode, chunked, prefix, max_n):
    """Verified proposals under memory pressure: every request ends with the oracle's
    tokens exactly, rejected proposals leave nothing behind, every block is freed."""
    manager = paged(block_size=block_size, num_blocks=128 // block_size + 1,
                    num_host_blocks=256 // block_size if mode == "swap" else 0,
                    prefix_caching=prefix)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24 if chunked else 64,
                             max_model_len=64, enable_chunked_prefill=chunked,
                             preemption_mode=mode)
    driver = SpeculativeDriver(Scheduler(config, manager), k=3, seed=block_size)
    reqs = random_reqs(seed=block_size, num=40, max_n=max_n, max_total=40)
    for req in reqs:
        driver.add(req)
    driver.run()
    assert driver.scheduler.num_preemptions > 0 and driver.num_accepted > 0
    assert_finished_exactly(driver, reqs)
    assert_all_free(manager)


def test_a_stop_token_inside_a_verified_run_ends_it_there():
    """A stop token among the accepted proposals ends the sequence at once: the accepted
    proposals after it and the verification's token are dropped, its blocks freed."""
    manager = paged()
    driver = SpeculativeDriver(Scheduler(SchedulerConfig(8, 64, 64), manager), k=4, seed=0)
    driver.rng.random = lambda: 1.0  # every proposal right: runs of five tokens
    req = Req(0, (1, 2, 3), output_len=20)
    group = driver.add(req)
    stop = token_of(0, 0, 7)  # the third token of the second verified run
    group.stop_rule = dataclasses.replace(group.stop_rule, stop_token_ids=frozenset({stop}))
    driver.run()
    assert driver.outputs_of("r0") == [req.expected()[0][:8]]
    assert group.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    assert [n for output in driver.outputs for _, n in output.scheduled] == [3, 5, 5]
    assert_all_free(manager)


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_contiguous_baselines_serve_every_request(policy):
    reqs = random_reqs(seed=7, num=30)
    manager = ContiguousArena(200, f"orca-{policy}", 64)
    driver = make_driver(manager, max_num_batched_tokens=16)
    for req in reqs:
        driver.add(req)
    driver.run()
    assert driver.scheduler.num_preemptions == 0
    assert_finished_exactly(driver, reqs)
    assert_all_free(manager)


def test_long_prompt_is_chunked_to_the_token_budget():
    driver = make_driver(paged(), max_num_batched_tokens=16)
    req = Req(0, tuple(range(40)), output_len=3)
    driver.add(req)
    driver.run()
    assert [output.scheduled[0][1] for output in driver.outputs] == [16, 16, 8, 1, 1]
    assert_finished_exactly(driver, [req])


def test_decodes_share_the_budget_with_a_new_prefill():
    driver = make_driver(paged(num_blocks=65), max_num_batched_tokens=16)
    for index in range(3):
        driver.add(Req(index, (1, 2, 3), output_len=10))
    driver.step()  # three 3-token prefills
    newcomer = driver.add(Req(3, tuple(range(30)), output_len=2))
    output = driver.step()
    decoding = [driver.groups[f"r{index}"].seqs[0] for index in range(3)]
    assert output.scheduled == [*((seq, 1) for seq in decoding), (newcomer.seqs[0], 13)]


def test_max_num_seqs_caps_the_batch():
    driver = make_driver(paged(num_blocks=65), max_num_seqs=3)
    reqs = [Req(index, (5, 6), output_len=4) for index in range(7)]
    for req in reqs:
        driver.add(req)
    driver.run()
    assert max(len(output.scheduled) for output in driver.outputs) == 3
    assert_finished_exactly(driver, reqs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_newest_group_is_preempted(mode):
    # 6 usable blocks of 4 slots; three requests of 8 prompt tokens take 2 blocks each.
    manager = paged(num_blocks=7, num_host_blocks=16)
    driver = make_driver(manager, preemption_mode=mode)
    groups = [driver.add(Req(index, (9,) * 8, output_len=6)) for index in range(3)]
    driver.step()
    assert manager.num_free_blocks == 0
    output = driver.step()  # the oldest needs a third block for position 8
    assert output.preempted == [groups[2]]
    newest = groups[2].seqs[0]
    if mode == "recompute":
        assert newest.status is SequenceStatus.WAITING and newest.num_computed_tokens == 0
        assert driver.scheduler.waiting[0] is groups[2]
    else:
        assert newest.status is SequenceStatus.SWAPPED and newest.num_computed_tokens == 8
        assert manager.num_free_host_blocks == 16 - 2


def test_swapped_groups_resume_before_waiting_ones():
    manager = paged(num_blocks=7, num_host_blocks=16)
    driver = make_driver(manager, preemption_mode="swap")
    groups = [driver.add(Req(index, (9,) * 8, output_len=6)) for index in range(3)]
    driver.step()
    driver.step()  # swaps out groups[2]
    assert groups[2].seqs[0].status is SequenceStatus.SWAPPED
    late = Req(3, (4,), output_len=1)
    driver.add(late)
    while groups[2].seqs[0].status is SequenceStatus.SWAPPED:
        driver.step()
        assert driver.groups["r3"].seqs[0].status is SequenceStatus.WAITING
    driver.run()
    assert_finished_exactly(driver, [Req(i, (9,) * 8, output_len=6) for i in range(3)] + [late])


def test_parallel_samples_stay_in_lockstep_through_recompute():
    manager = paged(num_blocks=20)  # 19 usable blocks of 4 slots
    driver = make_driver(manager, max_num_batched_tokens=5)
    # r0 (8 to 13 blocks) is older than the 3 samples of r1 (14 blocks while they
    # share the prompt, 18 once recomputed), so r1 is preempted as r0 grows.
    reqs = [Req(0, tuple(range(30)), output_len=20), Req(1, tuple(range(10)), output_len=12, n=3)]
    for req in reqs:
        driver.add(req)
    driver.run()
    preempted = [group for output in driver.outputs for group in output.preempted]
    assert driver.groups["r1"] in preempted
    assert_finished_exactly(driver, reqs)
    assert_all_free(manager)


def test_parallel_samples_fork_at_their_first_draw_and_share_every_block():
    manager = paged(num_blocks=17)
    driver = make_driver(manager)
    group = driver.add(Req(0, tuple(range(10)), output_len=5, n=3))
    output = driver.step()  # the whole prompt: its row draws three times
    assert output.draws == [(group, (0, 0, 0))]
    parent, *children = group.seqs
    assert len(children) == 2
    for child in children:
        assert manager.block_table(child) == manager.block_table(parent)
        assert child.prompt_token_ids == parent.prompt_token_ids
        assert child.num_computed_tokens == parent.num_computed_tokens == 10
    assert [seq.output_token_ids for seq in group.seqs] == [[token_of(0, j, 0)] for j in range(3)]
    assert manager.physical_blocks_used == 3  # ceil(10 / 4), shared by all three
    assert manager.logical_blocks_used == 9


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_frees_everything(mode):
    manager = paged(num_blocks=17, num_host_blocks=64, prefix_caching=True)
    driver = make_driver(manager, preemption_mode=mode, max_num_batched_tokens=16)
    reqs = random_reqs(seed=3, num=12, max_n=3)
    for req in reqs:
        driver.add(req)
    for _ in range(12):
        driver.step()
    scheduler = driver.scheduler
    assert scheduler.num_running and (scheduler.num_waiting or scheduler.num_swapped)
    for req in reqs:
        scheduler.abort(req.request_id)
    assert not scheduler.has_unfinished_requests
    assert_all_free(manager)
    for req in reqs:
        seqs = driver.groups[req.request_id].seqs
        assert all(seq.is_finished for seq in seqs)
    assert scheduler.schedule().is_empty


def test_abort_one_request_while_others_keep_running():
    manager = paged(num_blocks=17)
    driver = make_driver(manager, max_num_batched_tokens=16)
    reqs = random_reqs(seed=5, num=10)
    for req in reqs:
        driver.add(req)
    for _ in range(3):
        driver.step()
    aborted = reqs[1].request_id
    driver.scheduler.abort(aborted)
    driver.scheduler.abort("no-such-request")
    driver.run()
    group = driver.groups[aborted]
    assert group.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert_finished_exactly(driver, [req for req in reqs if req.request_id != aborted])
    assert_all_free(manager)


def test_impossible_requests_are_rejected_and_the_rest_keep_running():
    manager = paged(num_blocks=9)  # 32 slots
    driver = make_driver(manager, max_model_len=40, max_num_batched_tokens=40)
    ok = Req(0, (1, 2, 3), output_len=5)
    driver.add(ok)
    driver.step()
    with pytest.raises(ValueError, match="max_model_len=40"):
        driver.add(Req(1, tuple(range(41)), output_len=1))
    with pytest.raises(ValueError, match="more KV blocks than the whole pool"):
        driver.add(Req(2, tuple(range(33)), output_len=1))
    with pytest.raises(ValueError, match="1 to max_model_len"):
        driver.add(Req(3, (), output_len=1))
    assert driver.scheduler.num_waiting == 0
    driver.run()
    assert_finished_exactly(driver, [ok])
    assert_all_free(manager)


def test_a_request_that_outgrows_the_whole_pool_is_ignored():
    manager = paged(num_blocks=9)  # 32 slots
    driver = make_driver(manager, max_model_len=64, max_num_batched_tokens=64)
    reqs = [Req(0, (1,) * 4, output_len=4), Req(1, (2,) * 20, output_len=30), Req(2, (3,) * 5, 6)]
    for req in reqs:
        driver.add(req)
    driver.run()
    ignored = [group for output in driver.outputs for group in output.ignored]
    assert ignored == [driver.groups["r1"]]
    assert driver.groups["r1"].seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert_finished_exactly(driver, [reqs[0], reqs[2]])
    assert_all_free(manager)


def test_bad_calls_raise_before_changing_anything():
    with pytest.raises(ValueError, match="needs a host pool, but it has no blocks"):
        make_driver(paged(), preemption_mode="swap")
    driver = make_driver(paged(num_blocks=65), max_num_seqs=2)
    group = driver.add(Req(0, (1, 2), output_len=4))
    with pytest.raises(ValueError, match="already in the scheduler"):
        driver.add(Req(0, (1, 2), output_len=4))
    driver.step()
    seq = group.seqs[0]
    other = driver.add(Req(1, (3,), output_len=4))
    with pytest.raises(ValueError, match="finished status"):
        driver.scheduler.finish_seq(group, seq, SequenceStatus.RUNNING)
    with pytest.raises(ValueError, match="not a running sequence of 'r1'"):
        driver.scheduler.finish_seq(other, seq)
    with pytest.raises(ValueError, match="not a running sequence of 'r1'"):
        driver.scheduler.finish_seq(other, other.seqs[0])  # still waiting
    assert seq.status is SequenceStatus.RUNNING and len(group.seqs) == 1
    assert driver.scheduler.num_running == 1 and driver.scheduler.num_waiting == 1


def test_finish_seq_ends_a_stopped_sample_and_frees_its_blocks():
    """What a stop string found in the text does between steps."""
    manager = paged(num_blocks=33)
    driver = make_driver(manager)
    group = driver.add(Req(0, tuple(range(9)), output_len=6, n=2))
    driver.step()
    first, second = group.seqs
    driver.scheduler.finish_seq(group, first)
    assert first.status is SequenceStatus.FINISHED_STOPPED
    assert driver.scheduler.num_running == 1
    driver.step()  # the other sample decodes on, with its own copy of the last block
    driver.scheduler.finish_seq(group, second)
    assert not driver.scheduler.has_unfinished_requests and driver.scheduler.num_running == 0
    assert_all_free(manager)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_slots=st.integers(48, 160),
    budget=st.integers(8, 48),
    max_num_seqs=st.integers(3, 8),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    prefix=st.booleans(),
)
def test_random_servers_lose_nothing(
    seed, block_size, num_slots, budget, max_num_seqs, mode, chunked, prefix
):
    manager = paged(
        block_size=block_size,
        num_blocks=num_slots // block_size + 1,
        num_host_blocks=512 // block_size if mode == "swap" else 0,
        prefix_caching=prefix,
    )
    # A group of 3 samples without shared blocks (recomputed) must fit the pool.
    max_total = min(40, (num_slots // block_size // 3) * block_size)
    driver = make_driver(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget if chunked else max_total,
        max_model_len=max_total,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
    )
    reqs = random_reqs(seed, num=12, max_n=3, max_total=max_total)
    for req in reqs:
        driver.add(req)
    driver.run()
    assert all(not output.ignored for output in driver.outputs)
    assert_finished_exactly(driver, reqs)
    assert_all_free(manager)
