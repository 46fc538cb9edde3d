"""Reserved prefixes in the engine, against an engine with prefix caching off: prompts
extending a reserved prefix get the same tokens (greedy and seeded sampling), find the
prefix's full blocks cached after traffic that cycles the whole pool, and after a fault
that loses the KV cache; on a model with sliding-window layers too."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.memory.reserved_prefixes import PrefixNotCached
from jpaged.model.loader import load_model
from jpaged.outputs import ReservedPrefix
from jpaged.sampling_params import SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)
# 23 usable blocks of 8 tokens; a max_model_len sequence takes 8 of them.
CONFIG = dict(block_size=8, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, buckets=BUCKETS, persistent_compilation_cache=False)
PREFIX_LEN = 20  # two full blocks of 8 and a partial one


def _llm(loaded, **kwargs) -> LLM:
    return LLM("tiny", loaded=loaded, **(CONFIG | kwargs))


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def workload(loaded):
    """(prefix, prompts extending it, unrelated long prompts whose run cycles the pool)."""
    rng = np.random.default_rng(5)
    vocab = loaded[1].vocab_size
    prefix = rng.integers(3, vocab, PREFIX_LEN).tolist()
    prompts = [prefix + rng.integers(3, vocab, n).tolist() for n in (1, 9, 4, 17)]
    fillers = [rng.integers(3, vocab, 40).tolist() for _ in range(5)]
    return prefix, prompts, fillers


# Greedy for the first two prompts, seeded sampling for the others.
PARAMS = [GREEDY, GREEDY] + [
    SamplingParams(temperature=0.9, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
    for seed in (11, 12)]


@pytest.fixture(scope="module")
def uncached(loaded, workload):
    """The oracle: the prompts' tokens with prefix caching off."""
    _, prompts, _ = workload
    llm = _llm(loaded, enable_prefix_caching=False)
    return llm, _tokens(llm.generate(prompts, PARAMS))


def test_a_reserved_prefix_serves_every_extension_however_full_the_pool_was(
        loaded, workload, uncached):
    prefix, prompts, fillers = workload
    llm = _llm(loaded)
    reserved = llm.reserve_prefix(prefix)
    assert reserved == ReservedPrefix(1, PREFIX_LEN, 16, 2)
    assert not llm.engine.has_unfinished_requests()  # its prefill ran, and nobody saw it
    llm.generate(fillers, GREEDY)  # 5 x 6 blocks through the 21 left: the pool cycles
    llm.engine.check_invariants()
    outputs = llm.generate(prompts, PARAMS)
    assert _tokens(outputs) == uncached[1]
    assert [o.num_cached_tokens for o in outputs] == [16] * len(outputs)
    assert llm.engine.state().kv_blocks_reserved == 2
    assert llm.engine.stats.summary()["kv_blocks_reserved"] == 2

    # Released, its blocks are evicted by the same traffic.
    llm.release_prefix(reserved)
    assert llm.engine.state().kv_blocks_reserved == 0
    llm.generate(fillers, GREEDY)
    again = llm.generate(prompts[0], GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == uncached[1][0]
    with pytest.raises(ValueError, match="no prefix 1 is reserved"):
        llm.release_prefix(reserved)


def test_bad_prefixes_are_refused_and_change_nothing(loaded, workload, uncached):
    prefix, prompts, _ = workload
    off, _ = uncached
    with pytest.raises(ValueError, match="prefix caching is off"):
        off.reserve_prefix(prefix)
    llm = _llm(loaded)
    manager = llm.engine.block_manager
    short = llm.reserve_prefix(prefix[:5])  # shorter than a block: holds nothing
    assert short == ReservedPrefix(1, 5, 0, 0) and manager.num_reserved_blocks == 0
    # Reservations may hold 23 - 8 = 15 blocks: two of 7 leave room for none of 2.
    held = [llm.reserve_prefix(list(range(start, start + 56))) for start in (3, 100)]
    free = manager.num_free_blocks
    for bad, error, message in [
        (3.5, TypeError, "text or a list of token ids"),
        ((1, 2), TypeError, "text or a list of token ids"),
        ([1, "a"], TypeError, "token ids must be ints, got 'a'"),
        ([], ValueError, "empty prefix"),
        ([10**6], ValueError, "outside the vocabulary"),
        (list(range(3, 67)), ValueError, "64 tokens leaves no room within max_model_len=64"),
        (prefix, ValueError, r"20 tokens needs 2 blocks; beside the 14 .* the 15 blocks"),
    ]:
        with pytest.raises(error, match=message):
            llm.reserve_prefix(bad)
    for reserved in held:
        llm.release_prefix(reserved)
    with pytest.raises(TypeError, match="cache_salt must be a str"):
        llm.reserve_prefix(prefix, cache_salt=1)
    llm.engine.add_request("user", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="1 requests are in flight"):
        llm.reserve_prefix(prefix)
    llm.engine.abort("user")
    with pytest.raises(ValueError, match="no prefix 7 is reserved"):
        llm.release_prefix(7)
    assert manager.num_free_blocks == free + 14
    assert [r.prefix for r in manager.reserved_prefixes] == [short]
    assert not llm.engine.has_unfinished_requests()
    orca = _llm(loaded, allocation="orca-max")
    with pytest.raises(ValueError, match="keeps no prefix cache"):
        orca.reserve_prefix(prefix)


def _lose_kv_cache_on_call(monkeypatch, runner, call: int) -> list[int]:
    """The runner's `call`-th execute consumes the donated KV cache, then raises."""
    original, calls, fired = runner.execute, [0], []

    def execute(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            for array in jax.tree.leaves(runner.kv_cache):
                array.delete()
            fired.append(call)
            raise RuntimeError("the device lost the KV cache")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    return fired


def test_a_prefix_whose_kv_a_fault_lost_is_computed_again(loaded, workload, uncached,
                                                         monkeypatch, caplog):
    """The step that loses the KV cache loses the reserved blocks: the prefix's prompt runs
    again beside the recomputing requests, and its new blocks are held under its id."""
    prefix, prompts, fillers = workload
    llm = _llm(loaded)
    reserved = llm.reserve_prefix(prefix)
    engine = llm.engine
    fired = _lose_kv_cache_on_call(monkeypatch, engine.runner, call=3)
    for i, prompt in enumerate([*prompts, *fillers[:2]]):
        engine.add_request(str(i), prompt, GREEDY)
    finished = {}
    with caplog.at_level("INFO", logger="jpaged"):
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.request_id.isdigit()  # no internal request's output
                if output.finished:
                    finished[int(output.request_id)] = output
            engine.check_invariants()
    assert fired and "reserved prefix 1: its KV recomputed, 2 blocks held again" in caplog.text
    for i in range(len(prompts)):
        if finished[i].outputs[0].finish_reason != "error":
            assert finished[i].outputs[0].token_ids == uncached[1][i]
    assert engine.block_manager.num_reserved_blocks == 2
    monkeypatch.undo()
    llm.generate(fillers, GREEDY)
    outputs = llm.generate(prompts, PARAMS)
    assert _tokens(outputs) == uncached[1]
    assert [o.num_cached_tokens for o in outputs] == [16] * len(prompts)
    llm.release_prefix(reserved)


def test_a_lost_prefix_runs_again_if_evicted_and_stays_lost_if_its_step_fails(
        loaded, workload, monkeypatch, caplog):
    """The two other ends of a recomputation (the prefix cache reset by hand here, as a
    lost KV cache resets it): blocks gone before they could be held (a full pool under
    async scheduling) run the prefix again; a step that fails without losing the cache
    leaves it lost, holding nothing, until released."""
    prefix, _, _ = workload
    llm = _llm(loaded)
    engine, manager = llm.engine, llm.engine.block_manager
    reserved = llm.reserve_prefix(prefix)
    restore, evicted = manager.restore, []

    def restore_once_evicted(prefix_id):
        if not evicted:
            evicted.append(prefix_id)
            raise PrefixNotCached("evicted before the host could hold them")
        return restore(prefix_id)

    monkeypatch.setattr(manager, "restore", restore_once_evicted)
    manager.reset_prefix_cache()
    engine.prefix_requests.recompute_lost()
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert evicted == [1] and manager.num_reserved_blocks == 2

    manager.reset_prefix_cache()
    engine.prefix_requests.recompute_lost()
    monkeypatch.setattr(engine.runner, "execute", _raise)
    with caplog.at_level("ERROR", logger="jpaged"):
        while engine.has_unfinished_requests():
            engine.step()
    assert "reserved prefix 1: recomputing its KV failed" in caplog.text
    assert manager.num_reserved_blocks == 0
    assert [r.is_lost for r in manager.reserved_prefixes] == [True]
    engine.check_invariants()
    llm.release_prefix(reserved)
    assert len(manager.reserved_prefixes) == 0


def _raise(*args, **kwargs):
    raise RuntimeError("a step failed; the KV cache survived")


def window_blocks(end: int, window: int, block_size: int) -> int:
    """Blocks holding the keys before `end` that a query at `end` reads under
    transformers' window (i - W < j <= i)."""
    return len({j // block_size for j in range(max(0, end - window + 1), end)})


def test_sliding_window_groups_hold_the_window_of_the_prefix_end(tiny_gemma3_dir):
    """Tiny Gemma 3 (window 8 on three of four layers, each group one layer): the global
    group holds every full block of the prefix, each sliding group those its window
    reads from the first token after them; prompts extending it then hit them."""
    loaded = load_model(tiny_gemma3_dir)
    rng = np.random.default_rng(6)
    vocab = loaded[1].vocab_size
    prefix = rng.integers(3, vocab, 22).tolist()  # 5 full blocks of 4
    prompts = [prefix + rng.integers(3, vocab, n).tolist() for n in (2, 11)]
    fillers = [rng.integers(3, vocab, 30).tolist() for _ in range(4)]
    config = dict(block_size=4, num_blocks=50, max_num_batched_tokens=16, max_model_len=48)
    expected = _tokens(_llm(loaded, enable_prefix_caching=False, **config).generate(
        prompts, GREEDY))
    llm = _llm(loaded, **config)
    manager = llm.engine.block_manager
    num_sliding = manager.num_groups - 1
    assert num_sliding == 3
    reserved = llm.reserve_prefix(prefix)
    assert reserved.num_cached_tokens == 20
    assert reserved.num_blocks == 5 + num_sliding * window_blocks(20, 8, 4)
    llm.generate(fillers, GREEDY)
    llm.engine.check_invariants()
    outputs = llm.generate(prompts, GREEDY)
    assert _tokens(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [20, 20]
