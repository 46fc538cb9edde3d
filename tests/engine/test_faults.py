"""Faults cost the request they hit, never the engine: injected failures against
transformers' greedy outputs and the KV block invariants.

Each scenario makes one runner call raise (or consumes the KV cache, or feeds
NaN) while eight requests run three at a time. The requests of the failed step
end with finish_reason "error"; after every step the blocks match the live
sequences (`LLMEngine.check_invariants`); every other request's tokens equal
transformers' greedy tokens; and the engine then serves all eight prompts again.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import SampledTokens
from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.memory.block_manager import BlockManager
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.plugins.hf_models import greedy_continuations

MAX_TOKENS = 8
BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts(loaded):
    """Eight prompts; the second and the last share a 16-token prefix (two full blocks),
    so a stale prefix cache would serve the last one wrong KV."""
    rng = np.random.default_rng(1)
    vocab = loaded[1].vocab_size
    shared = rng.integers(3, vocab, 16).tolist()
    others = [rng.integers(3, vocab, n).tolist() for n in (5, 29, 3, 12, 7, 21)]
    return [others[0], shared + [4, 5], *others[1:], shared + [6]]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return greedy_continuations(tiny_llama_dir, prompts, MAX_TOKENS)


def _llm(loaded, **kwargs) -> LLM:
    config = dict(block_size=8, num_blocks=40, max_num_seqs=3, max_num_batched_tokens=16,
                  max_model_len=64, buckets=BUCKETS, persistent_compilation_cache=False)
    return LLM("tiny", loaded=loaded, **(config | kwargs))


def fail_on_call(monkeypatch, owner, name: str, when, before_raising=None,
                 error: type[BaseException] = InjectedFault) -> list[int]:
    """Make owner.name raise `error` on the first call for which when(call number, *args)
    is true; returns a list that holds the number of that call once it fired."""
    original = getattr(owner, name)
    calls, fired = [0], []

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if not fired and when(calls[0], *args):
            fired.append(calls[0])
            if before_raising is not None:
                before_raising()
            raise error(f"{name}, call {calls[0]}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return fired


def serve(llm: LLM, prompts, params=None) -> dict[int, object]:
    """Run every prompt (with its params, greedy by default) through the engine's step
    loop, checking the block invariants after each step; the final outputs by index."""
    engine = llm.engine
    for index, (prompt, request_params) in enumerate(
            zip(prompts, params or [GREEDY] * len(prompts), strict=True)):
        engine.add_request(str(index), prompt, request_params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output
        engine.check_invariants()
    return finished


def check_recovered(llm: LLM, finished, prompts, expected, fired) -> None:
    assert fired, "the fault was never injected"
    reasons = {i: out.outputs[0].finish_reason for i, out in finished.items()}
    failed = [i for i, reason in reasons.items() if reason == "error"]
    assert failed, reasons
    assert isinstance(llm.engine.last_step_error, InjectedFault)
    for i, out in finished.items():
        if i not in failed:
            assert reasons[i] == "length"
            assert out.outputs[0].token_ids == expected[i], i
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_device_blocks
    assert not manager.state.host.refcounts.any()  # free, or holding the tier's copies
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected


def _has(phase: str):
    """Whether a call of apply_block_ops has pairs of this phase."""
    return lambda call, ops: len(getattr(ops, phase)) > 0


SWAPPING = dict(preemption_mode="swap", num_blocks=8, kv_offloading_size=0.01, max_model_len=40)
# A pool too small to keep the shared prefix: the last prompt loads it from the host tier.
TIER = dict(num_blocks=8, kv_offloading_size=0.01, max_model_len=40)
SCENARIOS = {
    # (engine options, runner call, when it raises)
    "mid_prefill": ({}, "execute", lambda call, *args: call == 2),
    "mid_decode": ({}, "execute", lambda call, *args: call == 7),
    "first_step_compile": ({}, "execute", lambda call, *args: call == 1),
    "after_copy_on_write": ({}, "apply_block_ops", _has("copies")),
    "sampler": ({}, "sample_on_device", lambda call, *args: call == 4),
    "reading_tokens": ({}, "fetch", lambda call, *args: call == 5),
    "decode_loop": ({"num_decode_steps": 4}, "decode_loop", lambda call, *args: call == 2),
    # With async scheduling a step fails while the one before it is in flight.
    "async_mid_decode": ({"async_scheduling": True}, "execute", lambda call, *args: call == 7),
    "async_reading_tokens": ({"async_scheduling": True}, "fetch",
                             lambda call, *args: call == 5),
    "swap_out": (SWAPPING, "apply_block_ops", _has("swap_out")),
    "swap_in": (SWAPPING, "apply_block_ops", _has("swap_in")),
    # Nothing is served from a copy a failed step may have left half written.
    "tier_store": (TIER, "apply_block_ops", _has("store")),
    "tier_load": (TIER, "apply_block_ops", _has("load")),
    # The store phase ran, the load phase raises (without swapping, only loads read
    # the host).
    "tier_load_mid_phases": (TIER, "_from_host", lambda call, *args: True),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_failed_step_costs_only_its_requests(loaded, prompts, expected, scenario,
                                              monkeypatch):
    options, name, when = SCENARIOS[scenario]
    llm = _llm(loaded, **options)
    fired = fail_on_call(monkeypatch, llm.engine.runner, name, when)
    # Two samples of one prompt: their first decode copies the shared last block.
    params = [GREEDY] * len(prompts)
    params[2] = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished = serve(llm, prompts, params)
    if finished[2].outputs[0].finish_reason != "error":
        assert all(o.token_ids == expected[2] for o in finished[2].outputs)
    monkeypatch.undo()
    check_recovered(llm, finished, prompts, expected, fired)


def fail_consuming_the_cache(monkeypatch, runner, call: int) -> list[int]:
    """Make the runner's `call`-th execute delete the donated KV cache, then raise."""

    def consume_cache():
        for array in jax.tree.leaves(runner.kv_cache):
            array.delete()

    return fail_on_call(monkeypatch, runner, "execute", lambda number, *args: number == call,
                        before_raising=consume_cache)


def test_a_kv_cache_consumed_by_donation_is_rebuilt(loaded, prompts, expected, monkeypatch):
    """The device call takes the donated cache and raises: every block's KV is gone.
    Running requests recompute, and the prefix cache forgets its blocks (the last
    prompt shares two blocks with the second, which finished before the fault)."""
    llm = _llm(loaded)
    fired = fail_consuming_the_cache(monkeypatch, llm.engine.runner, call=12)
    finished = serve(llm, prompts)
    assert finished[1].outputs[0].finish_reason == "length"
    assert finished[len(prompts) - 1].outputs[0].finish_reason == "length"
    monkeypatch.undo()
    check_recovered(llm, finished, prompts, expected, fired)


def test_a_consumed_kv_cache_of_global_and_sliding_groups_is_rebuilt(tiny_gemma3_dir,
                                                                    monkeypatch):
    """As above on a Gemma-3-shaped model, whose global and sliding layers hold their
    KV in KV cache groups of one pool: the pool is rebuilt for all groups and the
    sliding groups' released blocks come back free."""
    loaded = load_model(tiny_gemma3_dir)
    rng = np.random.default_rng(4)
    vocab = loaded[1].vocab_size
    shared = rng.integers(3, vocab, 16).tolist()
    prompts = [rng.integers(3, vocab, n).tolist() for n in (5, 29, 12, 21)]
    prompts = [prompts[0], shared + [4, 5], *prompts[1:], shared + [6]]
    expected = greedy_continuations(tiny_gemma3_dir, prompts, MAX_TOKENS)
    llm = _llm(loaded, block_size=4, num_blocks=160)
    assert llm.engine.block_manager.num_groups > 1
    fired = fail_consuming_the_cache(monkeypatch, llm.engine.runner, call=10)
    finished = serve(llm, prompts)
    monkeypatch.undo()
    check_recovered(llm, finished, prompts, expected, fired)


def test_generate_raises_the_step_error_and_withdraws_its_requests(
        loaded, prompts, expected, monkeypatch):
    llm = _llm(loaded)
    fail_on_call(monkeypatch, llm.engine.runner, "execute", lambda call, *args: call == 3)
    with pytest.raises(InjectedFault):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_an_interrupt_leaves_the_engine_consistent(loaded, prompts, expected, monkeypatch):
    llm = _llm(loaded)
    fail_on_call(monkeypatch, llm.engine.runner, "execute", lambda call, *args: call == 5,
                 error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_a_rejected_prompt_withdraws_the_prompts_before_it(loaded, prompts, expected):
    llm = _llm(loaded)
    too_long = list(range(3, 3 + 65))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([*prompts[:3], too_long], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(prompts[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:2]
    assert llm.engine.stats.num_finished == 2


def test_nan_logits_end_only_their_request(tiny_llama_dir, prompts, expected):
    """A token whose embedding is NaN poisons every sequence that holds it."""
    model, config, tokenizer = load_model(tiny_llama_dir)
    poisoned = 2
    assert all(poisoned not in prompt for prompt in prompts)
    table = model.embed_tokens.embedding
    table[...] = table[...].at[poisoned].set(jnp.nan)
    llm = _llm((model, config, tokenizer))
    inputs = [*prompts[:4], [7, poisoned, 9], *prompts[4:]]
    finished = serve(llm, inputs)
    reasons = [finished[i].outputs[0].finish_reason for i in range(len(inputs))]
    assert reasons == ["length"] * 4 + ["error"] + ["length"] * (len(prompts) - 4)
    survivors = [finished[i].outputs[0].token_ids for i in range(len(inputs)) if i != 4]
    assert survivors == expected
    assert llm.engine.last_step_error is None


def break_pallas_kernels(monkeypatch) -> None:
    """The Pallas kernels ("tpu", "triton") fail to lower;
    the "xla" and "reference" implementations of the same ops still work. Runners get
    their step functions from a cache of the test's own: one built earlier for the same
    model and backend holds the working kernels, one built here the broken ones."""
    import kernels_pallas
    from jpaged.worker import model_runner as runner

    monkeypatch.setattr(runner, "step_functions", functools.lru_cache(
        maxsize=runner.STEP_FUNCTIONS_CACHE_SIZE)(runner.step_functions.__wrapped__))
    for name in ("ragged_paged_attention", "paged_decode_attention"):
        op = getattr(kernels_pallas, name)

        def failing(*args, op=op, implementation=None, **kwargs):
            if implementation in ("tpu", "triton"):
                raise NotImplementedError("lowering is not supported for this kernel")
            return op(*args, implementation=implementation, **kwargs)

        monkeypatch.setattr(kernels_pallas, name, failing)


def test_the_default_kernel_falls_back_to_xla(loaded, prompts, expected, monkeypatch, caplog):
    monkeypatch.setattr("jpaged.engine.backend_choice.device_attention_backend", lambda: "triton")
    break_pallas_kernels(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="jpaged"):
        llm = _llm(loaded, interpret=True)
    assert llm.engine.runner.attention_backend == "xla"
    assert "lowering is not supported" in caplog.text
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_a_requested_kernel_that_cannot_compile_raises(loaded, monkeypatch):
    break_pallas_kernels(monkeypatch)
    with pytest.raises(RuntimeError, match="attention_backend='triton'.*lowering is not"):
        _llm(loaded, attention_backend="triton", interpret=True)


def test_kernel_limits_are_checked_at_start(loaded, monkeypatch, caplog):
    # The Triton kernel (on CPU under interpret mode) needs block_size a power of two.
    monkeypatch.setattr("jax.default_backend", lambda: "cpu")
    with pytest.raises(ValueError, match="Triton kernel needs block_size a power of two, got 12"):
        _llm(loaded, attention_backend="triton", interpret=True, block_size=12)
    monkeypatch.setattr("jpaged.engine.backend_choice.device_attention_backend", lambda: "triton")
    with caplog.at_level(logging.WARNING, logger="jpaged"):
        llm = _llm(loaded, interpret=True, block_size=12)
    assert llm.engine.runner.attention_backend == "xla"
    assert "power of two, got 12" in caplog.text


def test_a_swapped_group_that_can_never_return_does_not_stall_the_queue():
    """A newer group grows to nearly the whole pool, is swapped out for an older one,
    and can then never swap back in beside the watermark: it must finish (as
    ignored) so that the waiting queue behind it moves."""
    # 10 usable blocks of 2 tokens; admissions and swap-ins keep 3 free.
    manager = BlockManager(CacheConfig(block_size=2, num_blocks=11, num_host_blocks=16,
                                       enable_prefix_caching=False, watermark=0.3))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64, preemption_mode="swap"), manager)
    older = SequenceGroup("older", [Sequence(0, [1])])
    newer = SequenceGroup("newer", [Sequence(1, list(range(1, 13)))])
    for group in (older, newer):
        scheduler.add_request(group)
    waiting = SequenceGroup("waiting", [Sequence(2, [5])])
    for _ in range(20):
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, SampledTokens(np.full(plan.num_draws, 7),
                                                         np.ones(plan.num_draws, bool)))
        if newer in scheduler.swapped and waiting not in scheduler.waiting:
            scheduler.add_request(waiting)
        if waiting.seqs[0].status is SequenceStatus.RUNNING:
            break
    assert newer.seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert waiting.seqs[0].status is SequenceStatus.RUNNING


def test_the_old_name_pallas_still_picks_the_devices_kernel(loaded, monkeypatch):
    """attention_backend='pallas' (deprecated) is the device's Pallas kernel: Triton here,
    interpreted on a CPU, and its limits."""
    monkeypatch.setattr("jax.default_backend", lambda: "cpu")
    with pytest.warns(DeprecationWarning, match="'pallas' is deprecated"), \
            pytest.raises(ValueError, match="Triton kernel needs block_size a power of two"):
        _llm(loaded, attention_backend="pallas", interpret=True, block_size=12)
