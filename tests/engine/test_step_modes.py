"""Which step modes and features combine (jpaged.core.step_modes): every pair decided,
settings given that conflict refused before any model loads, defaults that conflict
giving way once logged and counted, and what each fallback does in a running engine.

Oracles: the settings named in docs/architecture.md's table; the engine's own behaviour
(no prefix-cache query under Orca, no decode loop run, every block kept in one group).
"""

from __future__ import annotations

import logging
import re
import types
from pathlib import Path

import pytest

from jpaged import __main__ as cli
from jpaged.core.step_modes import (
    FEATURE_PAIRS,
    TABLE,
    Feature,
    ModeFallbacks,
    Outcome,
    StepMode,
    fallback_name,
    step_mode,
)
from jpaged.engine import llm_engine, machine
from jpaged.engine.config import EngineConfig
from jpaged.engine.machine import CPU_DEFAULTS
from jpaged.engine.protocol import EngineState
from jpaged.engine.stats import CombinedStats, EngineStats
from jpaged.entrypoints.llm import LLM
from jpaged.entrypoints.metrics import EngineCollector
from jpaged.memory.reserving_block_manager import ReservingBlockManager
from jpaged.model.loader import load_model
from jpaged.sampling_params import SamplingParams
from jpaged.worker.step_runner import SingleStepRunner

REPO = Path(__file__).resolve().parents[2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 2, "model": "a-draft-model"}
# A local/global model's layer windows (KV cache groups) and an all-sliding model's.
MIXED_WINDOWS = (8, 8, None, 8)
ALL_SLIDING = (8, 8)
# The machine defaults of a machine whose default is the decode loop.
LOOP_DEFAULTS = machine.MachineDefaults(max_num_seqs=8, max_num_batched_tokens=64,
                                        kv_cache_fraction=0.25, num_decode_steps=4)
# Features a request turns on: no config can refuse them, so they never conflict.
PER_REQUEST = {Feature.BEAM_SEARCH, Feature.PARALLEL_SAMPLING, Feature.PREFILL,
               Feature.PENALTIES}
ENGINE = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=32, persistent_compilation_cache=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

# Each conflict: the settings that make it (and the model's layer windows), and the
# two settings its ValueError names.
CONFLICTS = {
    (StepMode.ASYNC_SCHEDULING, Feature.NGRAM): (
        dict(async_scheduling=True, speculative_config=NGRAM), (),
        "async_scheduling=True", "speculative_config['method']='ngram'"),
    (StepMode.ASYNC_SCHEDULING, Feature.DRAFT_MODEL): (
        dict(async_scheduling=True, speculative_config=DRAFT), (),
        "async_scheduling=True", "speculative_config['method']='draft_model'"),
    (StepMode.DECODE_LOOP, Feature.NGRAM): (
        dict(num_decode_steps=4, speculative_config=NGRAM), (),
        "num_decode_steps=4", "speculative_config['method']='ngram'"),
    (StepMode.DECODE_LOOP, Feature.DRAFT_MODEL): (
        dict(num_decode_steps=4, speculative_config=DRAFT), (),
        "num_decode_steps=4", "speculative_config['method']='draft_model'"),
    (StepMode.DECODE_LOOP, Feature.ORCA): (
        dict(num_decode_steps=4, allocation="orca-max"), (),
        "num_decode_steps=4", "allocation='orca-max'"),
    (StepMode.DECODE_LOOP, Feature.HYBRID_KV_GROUPS): (
        dict(num_decode_steps=4), MIXED_WINDOWS,
        "num_decode_steps=4", "disable_hybrid_kv_cache_manager=False"),
    (StepMode.DECODE_LOOP, StepMode.ASYNC_SCHEDULING): (
        dict(num_decode_steps=4, async_scheduling=True), (),
        "num_decode_steps=4", "async_scheduling=True"),
    (Feature.ORCA, Feature.PREFIX_CACHING): (
        dict(allocation="orca-max", enable_prefix_caching=True), (),
        "allocation='orca-max'", "enable_prefix_caching=True"),
    (Feature.ORCA, Feature.SLIDING_WINDOW): (
        dict(allocation="orca-pow2", disable_hybrid_kv_cache_manager=False), ALL_SLIDING,
        "allocation='orca-pow2'", "disable_hybrid_kv_cache_manager=False"),
    (Feature.ORCA, Feature.SWAP): (
        dict(allocation="orca-oracle", preemption_mode="swap", kv_offloading_size=0.01), (),
        "allocation='orca-oracle'", "preemption_mode='swap'"),
    (Feature.DRAFT_MODEL, Feature.TENSOR_PARALLEL): (
        dict(speculative_config=DRAFT, tensor_parallel_size=2), (),
        "speculative_config['method']='draft_model'", "tensor_parallel_size=2"),
    (Feature.DRAFT_MODEL, Feature.DATA_PARALLEL): (
        dict(speculative_config=DRAFT, data_parallel_size=2), (),
        "speculative_config['method']='draft_model'", "data_parallel_size=2"),
    (StepMode.DECODE_LOOP, Feature.LORA): (
        dict(num_decode_steps=4, enable_lora=True), (),
        "num_decode_steps=4", "enable_lora=True"),
    (Feature.DRAFT_MODEL, Feature.LORA): (
        dict(speculative_config=DRAFT, enable_lora=True), (),
        "speculative_config['method']='draft_model'", "enable_lora=True"),
}


def conflict_pairs() -> list[tuple]:
    """Every conflict the tables hold, as (first, second)."""
    pairs = [(mode, feature) for mode, row in TABLE.items()
             for feature, cell in row.items() if cell.outcome is Outcome.CONFLICT]
    pairs += [pair for pair, cell in FEATURE_PAIRS.items() if cell.outcome is Outcome.CONFLICT]
    return [*pairs, (StepMode.DECODE_LOOP, StepMode.ASYNC_SCHEDULING)]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_dir):
    return load_model(tiny_gemma3_dir)


def test_the_table_decides_every_mode_and_feature():
    for mode in StepMode:
        assert set(TABLE[mode]) == set(Feature), mode
        for feature, cell in TABLE[mode].items():
            if cell.outcome is not Outcome.SUPPORTED:
                assert cell.why, (mode, feature)
            if cell.outcome is Outcome.FALLBACK:
                assert cell.instead, (mode, feature)
            # A request's feature cannot be refused when the config is built.
            assert not (feature in PER_REQUEST and cell.outcome is Outcome.CONFLICT)
    assert all(cell.outcome is Outcome.SUPPORTED for cell in TABLE[StepMode.SINGLE_STEP].values())


@pytest.mark.parametrize("pair", conflict_pairs(), ids=lambda pair: fallback_name(*pair))
def test_each_conflict_raises_naming_both_settings(pair):
    settings, layer_windows, first, second = CONFLICTS[pair]
    with pytest.raises(ValueError, match="conflicts with") as raised:
        EngineConfig(**settings).with_machine_defaults(CPU_DEFAULTS, layer_windows)
    assert first in str(raised.value) and second in str(raised.value)


@pytest.mark.parametrize("pair", [pair for pair in conflict_pairs() if not CONFLICTS[pair][1]],
                         ids=lambda pair: fallback_name(*pair))
def test_settings_that_conflict_raise_before_any_model_loads(pair):
    # No model named "unloadable" exists: the config fails first.
    with pytest.raises(ValueError, match="conflicts with"):
        LLM("unloadable", **CONFLICTS[pair][0])


def test_a_conflict_with_the_models_windows_raises_before_its_weights_load(
        tiny_gemma3_dir, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(llm_engine, "load_model", load_model)
    with pytest.raises(ValueError, match="num_decode_steps=4 conflicts with the model's local "
                                         "and global layers in KV cache groups"):
        LLM(str(tiny_gemma3_dir), num_decode_steps=4)


# Each default that gives way: the settings given, the model's layer windows, what the
# log says once, and the settings resolved.
DEFAULT_FALLBACKS = {
    "decode_loop/ngram": (
        dict(speculative_config=NGRAM), (),
        "num_decode_steps=4 (the default) gives way to speculative_config['method']='ngram'",
        dict(num_decode_steps=1)),
    "decode_loop/orca": (
        dict(allocation="orca-max"), (),
        "num_decode_steps=4 (the default) gives way to allocation='orca-max'",
        dict(num_decode_steps=1, enable_prefix_caching=False)),
    "decode_loop/async_scheduling": (
        dict(async_scheduling=True), (),
        "num_decode_steps=4 (the default) gives way to async_scheduling=True",
        dict(num_decode_steps=1)),
    "decode_loop/hybrid_kv_groups": (
        dict(), MIXED_WINDOWS,
        "num_decode_steps=4 (the default) gives way to the model's local and global layers",
        dict(num_decode_steps=1, disable_hybrid_kv_cache_manager=False)),
    "prefix_caching/orca": (
        dict(allocation="orca-max", num_decode_steps=1), (),
        "enable_prefix_caching=True (the default) gives way to allocation='orca-max'",
        dict(enable_prefix_caching=False)),
    "sliding_window/orca": (
        dict(allocation="orca-max", num_decode_steps=1), MIXED_WINDOWS,
        "disable_hybrid_kv_cache_manager=False (the default) gives way to "
        "allocation='orca-max'", dict(disable_hybrid_kv_cache_manager=True)),
}


@pytest.mark.parametrize("name", DEFAULT_FALLBACKS)
def test_a_default_that_conflicts_gives_way_logged_once_and_counted(name, caplog):
    settings, layer_windows, message, resolved = DEFAULT_FALLBACKS[name]
    fallbacks = ModeFallbacks()
    config = EngineConfig(**settings)
    with caplog.at_level(logging.INFO, logger="jpaged"):
        for _ in range(2):
            resolved_config = config.with_machine_defaults(LOOP_DEFAULTS, layer_windows,
                                                           fallbacks)
    assert fallbacks.counts[name] == 2
    logged = [record.getMessage() for record in caplog.records]
    assert len([line for line in logged if line.startswith(message)]) == 1, logged
    for field, value in resolved.items():
        assert getattr(resolved_config, field) == value, field
        assert type(getattr(resolved_config, field)) is type(value)


def test_left_to_the_engine_the_settings_resolve_to_their_types():
    config = EngineConfig().with_machine_defaults(CPU_DEFAULTS)
    assert config.enable_prefix_caching is True
    assert config.disable_hybrid_kv_cache_manager is False
    assert config.num_decode_steps == CPU_DEFAULTS.num_decode_steps
    assert step_mode(config) is StepMode.SINGLE_STEP
    assert step_mode(EngineConfig(async_scheduling=True).with_machine_defaults(
        CPU_DEFAULTS)) is StepMode.ASYNC_SCHEDULING
    assert step_mode(EngineConfig().with_machine_defaults(LOOP_DEFAULTS)) is StepMode.DECODE_LOOP
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool or None, got str"):
        EngineConfig(enable_prefix_caching="yes")


def test_a_step_fallback_is_logged_the_first_time_and_counted_every_time(caplog):
    fallbacks = ModeFallbacks()
    with caplog.at_level(logging.INFO, logger="jpaged"):
        for _ in range(3):
            fallbacks.note(StepMode.DECODE_LOOP, Feature.BEAM_SEARCH)
        fallbacks.note(StepMode.ASYNC_SCHEDULING, Feature.PENALTIES)
        fallbacks.note(Feature.NGRAM, Feature.BEAM_SEARCH)
    assert fallbacks.counts == {"decode_loop/beam_search": 3, "async_scheduling/penalties": 1,
                                "ngram/beam_search": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "decode loop with beam search: a step with a beam search runs as a single step "
        "(beams are chosen on the host)",
        "async scheduling with penalties: a step that draws with penalties is finished "
        "before the next step is scheduled (the next draw's penalties count its tokens)",
        "n-gram speculation with beam search: a beam search gets no proposals (its beams "
        "are chosen on the host)"]


def test_prefix_caching_left_to_the_engine_stays_off_under_orca(llama, caplog):
    prompt = list(range(1, 17))  # four full blocks, then the same prompt again
    with caplog.at_level(logging.INFO, logger="jpaged"):
        llm = LLM("tiny", loaded=llama, allocation="orca-max", **ENGINE)
        llm.generate([prompt, prompt], GREEDY)
        llm.generate([prompt], GREEDY)
    engine = llm.engine
    assert isinstance(engine.block_manager, ReservingBlockManager)
    assert engine.config.enable_prefix_caching is False
    summary = engine.stats.summary()
    assert engine.block_manager.prefix_cache_stats.query_tokens == 0
    assert summary["prefix_cache_hit_rate"] == 0.0
    assert summary["mode_fallbacks"] == {"prefix_caching/orca": 1}
    assert engine.state().mode_fallbacks == {"prefix_caching/orca": 1}
    assert sum("gives way to allocation='orca-max'" in r.message for r in caplog.records) == 1


def test_a_default_decode_loop_gives_way_to_speculation(llama, monkeypatch):
    monkeypatch.setattr(machine, "machine_defaults", lambda: LOOP_DEFAULTS)
    engine = LLM("tiny", loaded=llama, speculative_config=NGRAM, **ENGINE).engine
    loops = []
    engine.runner.decode_loop = lambda *args, **kwargs: loops.append(args)
    repeating = [5, 6, 7, 5, 6, 7, 5, 6]
    engine.add_request("0", repeating, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.config.num_decode_steps == 1 and not loops
    summary = engine.stats.summary()
    assert summary["step_mode"] == StepMode.SINGLE_STEP.value
    assert summary["mode_fallbacks"] == {"decode_loop/ngram": 1}


def test_window_freeing_left_to_the_engine_keeps_every_block_under_orca(gemma3):
    llm = LLM("tiny", loaded=gemma3, allocation="orca-max", **ENGINE)
    engine = llm.engine
    assert engine.config.disable_hybrid_kv_cache_manager is True
    assert engine.runner.groups.num_groups == 1
    (output,) = llm.generate([list(range(1, 20))], GREEDY)
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_device_blocks
    assert engine.stats.summary()["mode_fallbacks"] == {"prefix_caching/orca": 1,
                                                        "sliding_window/orca": 1}


def test_a_default_decode_loop_gives_way_to_kv_cache_groups(gemma3, monkeypatch):
    monkeypatch.setattr(machine, "machine_defaults", lambda: LOOP_DEFAULTS)
    engine = LLM("tiny", loaded=gemma3, **ENGINE).engine
    assert engine.runner.groups.num_groups > 1
    assert engine.config.num_decode_steps == 1 and type(engine.core.step_runner) is SingleStepRunner
    assert engine.stats.summary()["mode_fallbacks"] == {"decode_loop/hybrid_kv_groups": 1}


def test_counts_add_up_over_replicas_and_reach_the_metrics():
    replicas = []
    for counts in ({"decode_loop/beam_search": 2}, {"decode_loop/beam_search": 1,
                                                     "prefix_caching/orca": 1}):
        fallbacks = ModeFallbacks()
        fallbacks.counts.update(counts)
        replicas.append(EngineStats(step_mode=StepMode.DECODE_LOOP, mode_fallbacks=fallbacks))
    summary = CombinedStats(tuple(replicas)).summary()
    assert summary["mode_fallbacks"] == {"decode_loop/beam_search": 3, "prefix_caching/orca": 1}
    assert summary["step_mode"] == "decode loop"
    state = EngineState.total([EngineState(mode_fallbacks=dict(r.mode_fallbacks.counts))
                               for r in replicas])
    families = {f.name: f for f in EngineCollector(types.SimpleNamespace(state=state)).collect()}
    samples = {s.labels["fallback"]: s.value for s in families["jpaged:mode_fallbacks"].samples
               if s.name.endswith("_total")}
    assert samples == {"decode_loop/beam_search": 3, "prefix_caching/orca": 1}


def test_the_command_line_leaves_window_freeing_to_the_engine():
    parser = cli._parser()
    assert parser.parse_args(["generate", "x"]).disable_hybrid_kv_cache_manager is None
    assert parser.parse_args(["generate", "--disable-hybrid-kv-cache-manager", "x"]
                             ).disable_hybrid_kv_cache_manager is True


def test_the_docs_table_states_the_tables_outcomes():
    """docs/architecture.md renders TABLE (a row per feature, a column per mode) and the
    feature pairs that do not simply combine."""
    page = (REPO / "docs" / "architecture.md").read_text()
    section = page.split("## Step modes and features", 1)[1].split("\n## ", 1)[0]
    features = {feature.value: feature for feature in Feature}
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in features:
            rows[features[cells[0]]] = [cell.split(":")[0] for cell in cells[1:]]
    assert set(rows) == set(Feature)
    for feature, outcomes in rows.items():
        assert outcomes == [TABLE[mode][feature].outcome.value for mode in StepMode], feature
    for (first, second), cell in FEATURE_PAIRS.items():
        stated = re.search(rf"{re.escape(first.value)} with {re.escape(second.value)}: (\w+)",
                           section)
        assert stated and stated[1] == cell.outcome.value, (first, second)
