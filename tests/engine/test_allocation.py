"""Orca's reservation policies in the engine (its `allocation` setting).

Oracles: the policies' definitions (`by_definition`, from the reserving block
manager's tests), block counts derived from them, the paged engine's outputs on
the same requests (greedy, seeded samples and beam search must not depend on the
allocation), the simulator's contiguous slabs (experiments.baselines) in blocks,
and the engine's reference-count check after every step.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from experiments.baselines import ContiguousArena
from jpaged import __main__ as cli
from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.memory.reserving_block_manager import ReservingBlockManager
from jpaged.model.loader import load_model
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.memory.test_reserving_block_manager import BLOCK_SIZE, by_definition

ENGINE_MAX_MODEL_LEN = 48
NUM_BLOCKS = 49  # 48 usable: four orca-max sequences at once
# One padded shape per step kind: each engine compiles its own steps.
BUCKETS = BucketSizes(min_num_tokens=64, min_num_seqs=8, min_blocks_per_seq=16)
POLICIES = ("paged", "orca-max", "orca-pow2", "orca-oracle")


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _llm(loaded, allocation: str) -> LLM:
    return LLM("tiny", loaded=loaded, allocation=allocation, block_size=BLOCK_SIZE,
               num_blocks=NUM_BLOCKS, max_num_seqs=8, max_num_batched_tokens=64,
               max_model_len=ENGINE_MAX_MODEL_LEN, buckets=BUCKETS,
               persistent_compilation_cache=False)


def _requests(vocab_size: int) -> dict[str, tuple[list[int], SamplingParams | BeamSearchParams]]:
    rng = np.random.default_rng(3)
    requests = {}
    for i, (prompt_len, max_tokens) in enumerate([(5, 25), (13, 7), (3, 30), (20, 12), (9, 2),
                                                  (30, 18)]):
        requests[f"greedy{i}"] = (rng.integers(0, vocab_size, prompt_len).tolist(),
                                  SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True))
    requests["n3"] = (rng.integers(0, vocab_size, 6).tolist(),
                      SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True))
    requests["beam3"] = (rng.integers(0, vocab_size, 7).tolist(),
                         BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    return requests


def _reserved_blocks(policy: str, prompt: list[int], params) -> int:
    """Blocks a request holds under `policy` by its definition: one reservation per
    sample or beam."""
    output_len = params.max_tokens
    num_seqs = params.n if isinstance(params, SamplingParams) else params.beam_width
    tokens = by_definition(policy, len(prompt), output_len, ENGINE_MAX_MODEL_LEN)
    return num_seqs * math.ceil(tokens / BLOCK_SIZE)


def _serve(llm: LLM, requests) -> tuple[dict[str, list[list[int]]], list[dict[str, int]], int]:
    """Every request's token ids per sequence, the blocks each running request holds
    after every step, and the number of preemptions. Every block must be free at the
    end."""
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs, held_per_step = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = [c.token_ids for c in output.outputs]
        engine.check_invariants()
        held_per_step.append(_held_blocks(engine))
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS - 1
    assert _spare_blocks(engine.block_manager) == 0
    return outputs, held_per_step, engine.scheduler.num_preemptions


def _held_blocks(engine) -> dict[str, int]:
    """request id -> distinct device blocks its tables hold; "spare" -> blocks the
    running requests reserved outside their tables (forks to come, ended samples)."""
    manager = engine.block_manager
    held = {}
    for group in engine.scheduler.running:
        seqs = group.seqs_with(SequenceStatus.RUNNING)
        if seqs:
            held[group.request_id] = len({b for seq in seqs for b in manager.block_table(seq)})
    return held | {"spare": _spare_blocks(manager)}


def _spare_blocks(manager) -> int:
    return len(manager.spare_blocks) if isinstance(manager, ReservingBlockManager) else 0


@pytest.fixture(scope="module")
def runs(loaded):
    vocab_size = loaded[1].vocab_size
    requests = _requests(vocab_size)
    return requests, {policy: _serve(_llm(loaded, policy), requests) for policy in POLICIES}


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_outputs_equal_paged(runs, policy):
    _, results = runs
    assert results[policy][0] == results["paged"][0]


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_running_requests_hold_their_reservations(runs, policy):
    requests, results = runs
    expected = {rid: _reserved_blocks(policy, prompt, params)
                for rid, (prompt, params) in requests.items()}
    for held in results[policy][1]:
        held = dict(held)
        spare = held.pop("spare")
        for request_id, blocks in held.items():
            if request_id.startswith("greedy"):
                assert blocks == expected[request_id]
            else:
                assert blocks <= expected[request_id]
        assert sum(held.values()) + spare == sum(expected[r] for r in held)


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_the_pool_binds_admission_and_nothing_is_preempted(runs, policy):
    requests, results = runs
    _, held_per_step, num_preemptions = results[policy]
    most_running = max(len(held) - 1 for held in held_per_step)
    assert most_running < len(requests), "the pool was meant to hold back some requests"
    assert num_preemptions == 0


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_engine_blocks_equal_the_simulators_slabs(runs, policy):
    """The simulator's Orca slab for a request, in blocks, is what the engine holds."""
    requests, results = runs
    held_per_step = results[policy][1]
    for request_id, (prompt, params) in requests.items():
        if not request_id.startswith("greedy"):
            continue  # the simulator's Orca serves one sequence per request
        slabs = ContiguousArena(10_000, policy, ENGINE_MAX_MODEL_LEN)
        slab = slabs.reservation(SequenceGroup(request_id, [Sequence(0, prompt)], params))
        held = {step[request_id] for step in held_per_step if request_id in step}
        assert held == {math.ceil(slab / BLOCK_SIZE)}


@pytest.mark.parametrize("policy", ["orca-pow2", "orca-oracle"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=5),
    SamplingParams(max_tokens=5, ignore_eos=True, stop=["x"]),
    SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[3]),
    BeamSearchParams(beam_width=2, max_tokens=4),
])
def test_unknown_output_length_is_rejected_before_queueing(loaded, policy, params):
    engine = _llm(loaded, policy).engine
    with pytest.raises(ValueError, match=f"'req-7'.*{policy}.*ignore_eos"):
        engine.add_request("req-7", [1, 2, 3], params)
    assert not engine.has_unfinished_requests()


def test_a_reservation_over_the_pool_is_rejected(loaded):
    engine = _llm(loaded, "orca-max").engine
    with pytest.raises(ValueError, match=r"'wide'.*5 x 48 tokens = 60 blocks.*48 blocks"):
        engine.add_request("wide", [1, 2], SamplingParams(n=5, max_tokens=3))
    assert not engine.has_unfinished_requests()


def test_the_engine_rejects_an_unknown_allocation(loaded):
    with pytest.raises(ValueError, match="allocation.*'orca'"):
        _llm(loaded, "orca")



def test_cli_allocation_flag(tiny_llama_dir, capsys, jpaged_logger_restored):
    args = ["generate", "--raw", "--model", str(tiny_llama_dir), "--num-blocks", "40",
            "--max-model-len", "32", "--block-size", "4", "--max-tokens", "3",
            "--allocation", "orca-oracle", "the"]
    assert cli.main(args) == 1
    assert re.fullmatch(r"error: request '[^']*': allocation='orca-oracle' .*ignore_eos.*\n",
                        capsys.readouterr().err.splitlines(keepends=True)[-1])
    assert cli.main([*args, "--ignore-eos"]) == 0
