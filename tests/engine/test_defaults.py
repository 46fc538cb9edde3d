"""The engine's defaults: the KV pool rule the README states, checked against that
statement computed here from the model as transformers holds it, and the limits a
config leaves to the machine."""

from __future__ import annotations

import pytest
import torch
import transformers

from jpaged.engine import machine
from jpaged.engine.config import EngineConfig
from jpaged.engine.kv_cache_sizing import MemoryFigures, kv_cache_budget
from jpaged.engine.machine import ACCELERATOR_DEFAULTS, CPU_DEFAULTS
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model

BLOCK_SIZE = 8
MAX_MODEL_LEN = 64
GIB = 2**30


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir) -> dict:
    """Weight bytes and KV bytes per token of the float32 model, from transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return {
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "bytes_per_token": 2 * config.num_hidden_layers * config.num_key_value_heads
        * head_dim * 4,
    }


def _engine_blocks(loaded, monkeypatch, *, free_bytes: int, accelerator: bool,
                   total_bytes: int = 80 * GIB, **kwargs) -> LLM:
    monkeypatch.setattr(machine, "free_device_memory", lambda device=None: free_bytes)
    monkeypatch.setattr(machine, "total_device_memory", lambda device=None: total_bytes)
    monkeypatch.setattr(machine, "on_accelerator", lambda: accelerator)
    llm = LLM("tiny", loaded=loaded, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
              persistent_compilation_cache=False, **kwargs)
    return llm.engine


def _expected_blocks(oracle, *, free_bytes: int, accelerator: bool, max_num_seqs: int,
                     total_bytes: int = 80 * GIB, kv_cache_memory_bytes=None,
                     gpu_memory_utilization=None, kv_cache_fraction=None) -> int:
    """The README's rule, in whole blocks plus the null block's place, capped at
    max_num_seqs full-length sequences."""
    block_bytes = oracle["bytes_per_token"] * BLOCK_SIZE
    blocks_per_seq = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    elif gpu_memory_utilization is not None:
        # vLLM's meaning: this share of the whole device, the weights inside it.
        budget = int(gpu_memory_utilization * total_bytes) - oracle["weight_bytes"]
    elif kv_cache_fraction is not None:
        budget = int(kv_cache_fraction * free_bytes)
    elif accelerator:
        budget = int(0.9 * free_bytes)
    else:
        budget = min(max(oracle["weight_bytes"], blocks_per_seq * block_bytes),
                     int(0.25 * free_bytes))
    return min(budget // block_bytes, max_num_seqs * blocks_per_seq + 1)


CASES = {
    # A CPU with plenty of RAM: the pool holds as many bytes as the weights.
    "cpu, weights bind": dict(free_bytes=64 * GIB, accelerator=False),
    # A CPU short of RAM: a quarter of what is free.
    "cpu, free memory binds": dict(free_bytes=1_000_000, accelerator=False),
    # An accelerator: 0.9 of the free device memory, capped at max_num_seqs sequences.
    "accelerator": dict(free_bytes=1_500_000, accelerator=True),
    "accelerator, max_num_seqs binds": dict(free_bytes=64 * GIB, accelerator=True),
    "explicit fraction": dict(free_bytes=3_000_000, accelerator=False, kv_cache_fraction=0.5),
    "explicit bytes": dict(free_bytes=64 * GIB, accelerator=True, kv_cache_memory_bytes=300_000),
    # The device's whole memory, not what is free, less the weights.
    "gpu_memory_utilization": dict(free_bytes=1_000, accelerator=True, total_bytes=4_000_000,
                                   gpu_memory_utilization=0.5),
    "gpu_memory_utilization on a CPU": dict(free_bytes=64 * GIB, accelerator=False,
                                            total_bytes=3_000_000, gpu_memory_utilization=0.5),
    "explicit max_num_seqs": dict(free_bytes=64 * GIB, accelerator=False, max_num_seqs=2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kv_pool_follows_the_stated_rule(loaded, oracle, monkeypatch, case):
    engine = _engine_blocks(loaded, monkeypatch, **case)
    defaults = ACCELERATOR_DEFAULTS if case["accelerator"] else CPU_DEFAULTS
    max_num_seqs = case.get("max_num_seqs", defaults.max_num_seqs)
    expected = _expected_blocks(oracle, **case | {"max_num_seqs": max_num_seqs})
    assert engine.kv_cache_info.num_blocks == expected
    assert engine.block_manager.num_free_blocks == expected - 1
    assert engine.kv_cache_info.bytes_per_token == oracle["bytes_per_token"]


def test_cpu_weights_rule_holds_a_useful_pool(loaded, oracle, monkeypatch):
    """With the CPU defaults on this model the weights bound, neither cap does."""
    engine = _engine_blocks(loaded, monkeypatch, free_bytes=64 * GIB, accelerator=False)
    block_bytes = oracle["bytes_per_token"] * BLOCK_SIZE
    assert engine.kv_cache_info.num_blocks == oracle["weight_bytes"] // block_bytes


def test_cpu_pool_holds_at_least_one_full_sequence():
    config = EngineConfig().with_machine_defaults(CPU_DEFAULTS)
    memory = MemoryFigures(free_bytes=64 * GIB, weight_bytes=1_000, on_accelerator=False)
    assert kv_cache_budget(config, memory, sequence_bytes=50_000) == 50_000


@pytest.mark.parametrize("accelerator", [False, True])
def test_unset_limits_take_the_machines_defaults(loaded, monkeypatch, accelerator):
    defaults = ACCELERATOR_DEFAULTS if accelerator else CPU_DEFAULTS
    engine = _engine_blocks(loaded, monkeypatch, free_bytes=64 * GIB, accelerator=accelerator)
    assert engine.scheduler.config.max_num_seqs == defaults.max_num_seqs
    assert engine.scheduler.config.max_num_batched_tokens == defaults.max_num_batched_tokens
    engine = _engine_blocks(loaded, monkeypatch, free_bytes=64 * GIB, accelerator=accelerator,
                            max_num_seqs=3, max_num_batched_tokens=40)
    assert (engine.scheduler.config.max_num_seqs,
            engine.scheduler.config.max_num_batched_tokens) == (3, 40)


BAD_VALUES = [
    ("kv_cache_fraction", 0.0, ValueError, r"kv_cache_fraction must be in \(0, 1\], got 0.0"),
    ("kv_cache_fraction", 1.5, ValueError, r"kv_cache_fraction must be in \(0, 1\], got 1.5"),
    ("kv_cache_fraction", "half", ValueError, r"kv_cache_fraction must be in \(0, 1\], got 'half'"),
    ("kv_cache_memory_bytes", 0, ValueError, r"kv_cache_memory_bytes must be >= 1 bytes, got 0"),
    ("kv_cache_memory_bytes", 2.5e8, TypeError,
     r"kv_cache_memory_bytes must be an int number of bytes \(2 \* 2\*\*30 is 2 GiB\), got "
     r"float 250000000.0"),
    ("gpu_memory_utilization", 1.5, ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
    ("swap_space", -1, ValueError, r"swap_space must be a number of GiB >= 0, got -1"),
    ("num_gpu_blocks_override", 1, ValueError, r"num_gpu_blocks_override must be >= 2, got 1"),
    ("preemption_mode", "swapping", ValueError, r"preemption_mode must be 'recompute' or 'swap'"),
    ("enforce_eager", "yes", TypeError, r"enforce_eager must be a bool, got str"),
    ("num_blocks", 1, ValueError, r"num_blocks must be >= 2, got 1"),
    ("max_num_seqs", 0, ValueError, r"max_num_seqs must be >= 1, got 0"),
    ("max_num_batched_tokens", -4, ValueError, r"max_num_batched_tokens must be >= 1, got -4"),
    ("max_model_len", True, TypeError, r"max_model_len must be an int, got bool"),
]


@pytest.mark.parametrize(("name", "value", "error", "message"), BAD_VALUES)
def test_bad_limits_are_refused_before_loading(name, value, error, message):
    # No model named "unloadable" exists: the config fails first.
    with pytest.raises(error, match=message):
        LLM("unloadable", **{name: value})


def test_gpu_memory_utilization_below_the_weights_is_refused(loaded, oracle, monkeypatch):
    total = oracle["weight_bytes"] * 2
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.4 leaves no room .* raise "
                                         r"it, or give kv_cache_memory_bytes"):
        _engine_blocks(loaded, monkeypatch, free_bytes=64 * GIB, accelerator=True,
                       total_bytes=total, gpu_memory_utilization=0.4)


def test_num_gpu_blocks_override_is_the_pool_with_its_null_block(loaded, monkeypatch):
    engine = _engine_blocks(loaded, monkeypatch, free_bytes=64 * GIB, accelerator=False,
                            num_gpu_blocks_override=21)
    assert engine.kv_cache_info.num_blocks == 21
    assert engine.block_manager.num_free_blocks == 20


HOST_POOLS = {
    "swap alone takes vLLM's 4 GiB": (dict(preemption_mode="swap"), 4.0),
    "swap_space": (dict(preemption_mode="swap", swap_space=0.001), 0.001),
    "swap_space and the prefix tier share one pool": (
        dict(swap_space=0.001, kv_offloading_size=0.002), 0.003),
    "the prefix tier alone": (dict(kv_offloading_size=0.002), 0.002),
    "none": ({}, 0.0),
}


@pytest.mark.parametrize(("settings", "gib"), HOST_POOLS.values(), ids=HOST_POOLS.keys())
def test_host_pool_holds_swap_space_plus_kv_offloading_size(loaded, oracle, monkeypatch,
                                                            settings, gib):
    engine = _engine_blocks(loaded, monkeypatch, free_bytes=64 * GIB, accelerator=False,
                            **settings)
    host_block_bytes = oracle["bytes_per_token"] * BLOCK_SIZE
    assert engine.kv_cache_info.num_host_blocks == int(gib * GIB) // host_block_bytes


def test_unknown_option_names_the_closest():
    with pytest.raises(TypeError, match=r"no option 'gpu_memory_utilisation'; did you mean "
                                        r"'gpu_memory_utilization'\?"):
        LLM("unloadable", gpu_memory_utilisation=0.9)
    with pytest.raises(TypeError, match=r"no option 'swap_spaces'; did you mean 'swap_space'"):
        EngineConfig(swap_spaces=1)


def test_deprecated_kv_cache_memory_is_bytes_too():
    with pytest.warns(DeprecationWarning, match=r"use kv_cache_memory_bytes \(bytes"):
        config = EngineConfig(kv_cache_memory=300_000)
    assert config.kv_cache_memory_bytes == 300_000
    with pytest.raises(ValueError, match="both size the KV pool"):
        EngineConfig(kv_cache_memory_bytes=300_000, gpu_memory_utilization=0.5)
