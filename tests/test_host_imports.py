"""The host side (allocator, block manager, scheduler, batch builder, the simulator)
imports without the device stack, so it runs where jax, flax, transformers or torch
are missing or slow to import; so do its tests, tests/memory and tests/core. Each
check runs in a fresh interpreter: this test process has imported all of them already."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "flax", "transformers", "torch")
HOST_MODULES = (
    "jpaged.memory.allocator",
    "jpaged.memory.block_ids",
    "jpaged.memory.block_manager",
    "jpaged.memory.reserving_block_manager",
    "jpaged.core.scheduler",
    "jpaged.core.step_shapes",
    "jpaged.core.batch_builder",
    "jpaged.structured_output.compiler",
    "jpaged.structured_output.token_masks",
    "experiments.simulator",
)
HOST_TESTS = ("tests/memory", "tests/core")
# The hypothesis state machines (their test is runTest) run in the main suite; here
# collecting them shows they import without the device stack, and skipping their
# examples keeps this run short.
NOT_STATE_MACHINES = ("-k", "not runTest")
# A sitecustomize.py on PYTHONPATH installs it in every interpreter of a run: pytest's and
# the processes its tests start.
DEVICE_STACK_UNIMPORTABLE = f"""
import sys


class DeviceStackUnimportable:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {HEAVY!r}:
            raise ImportError(name + " is unimportable in this run")


sys.meta_path.insert(0, DeviceStackUnimportable())
"""


def loaded_modules(code: str) -> set[str]:
    """Run `code` in a fresh interpreter; the top-level names in its sys.modules after."""
    script = f"{code}\nimport sys\nprint(' '.join({{m.partition('.')[0] for m in sys.modules}}))"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True, timeout=120)
    return set(result.stdout.split())


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_module_loads_no_device_stack(module):
    loaded = loaded_modules(f"import {module}")
    assert module.partition(".")[0] in loaded
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_package_loads_its_names_on_first_use():
    # Importing jpaged alone loads nothing heavy; naming jpaged.LLM loads the engine.
    assert loaded_modules("import jpaged").isdisjoint(HEAVY)
    loaded = loaded_modules("import jpaged\nassert jpaged.LLM.__name__ == 'LLM'")
    assert {"jax", "flax"} <= loaded


def test_engine_and_cli_load_no_serving_stack_and_no_pytorch():
    """What `python -m jpaged generate` imports: the engine and the command line, without
    transformers, torch or the HTTP server's packages (only `serve` loads those)."""
    loaded = loaded_modules("import jpaged.__main__, jpaged.model.loader\n"
                            "from jpaged import LLM")
    assert {"jax", "flax", "tokenizers"} <= loaded
    serving_or_oracle = {"transformers", "torch", "fastapi", "uvicorn", "prometheus_client",
                         "openai"}
    assert loaded.isdisjoint(serving_or_oracle), sorted(loaded & serving_or_oracle)


def test_package_lists_and_resolves_every_public_name():
    import jpaged
    from jpaged.entrypoints.llm import LLM

    assert set(jpaged.__all__) <= set(dir(jpaged))
    for name in jpaged.__all__:
        assert getattr(jpaged, name).__name__ == name
    assert jpaged.LLM is LLM
    with pytest.raises(AttributeError, match="no_such_name"):
        jpaged.no_such_name  # noqa: B018


def test_a_deprecated_name_warns_and_resolves_to_its_new_home():
    from jpaged.core import step_shapes
    from jpaged.engine import llm_engine

    with pytest.warns(DeprecationWarning, match="llm_engine.step_shapes is deprecated: use "
                                                "jpaged.core.step_shapes.step_shapes"):
        assert llm_engine.step_shapes is step_shapes.step_shapes
    with pytest.raises(AttributeError, match="no_such_name"):
        llm_engine.no_such_name  # noqa: B018


@pytest.mark.parametrize(("old", "name", "new"), [
    ("jpaged.engine.runner", "ModelRunner", "jpaged.worker.model_runner"),
    ("jpaged.engine.runner", "start_runner", "jpaged.engine.backend_choice"),
    ("jpaged.engine.decode_loop", "LoopInput", "jpaged.worker.decode_loop"),
    ("jpaged.model.sampler", "SamplingRow", "jpaged.worker.sampling_rows"),
    ("jpaged.model.sampler", "draft_sample", "jpaged.model.verification"),
])
def test_a_moved_step_module_keeps_its_old_path_for_a_release(old, name, new):
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} is deprecated: use {new}.{name}"):
        moved = getattr(importlib.import_module(old), name)
    assert moved is getattr(importlib.import_module(new), name)


@pytest.mark.full
def test_host_tests_pass_where_the_device_stack_is_unimportable(tmp_path):
    """tests/memory and tests/core, plugins and all, with jax, flax, transformers and torch
    unimportable: every test collected passes, none is skipped (the state machines are
    collected, not run)."""
    (tmp_path / "sitecustomize.py").write_text(DEVICE_STACK_UNIMPORTABLE)
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NOT_STATE_MACHINES,
         *HOST_TESTS],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": python_path}, capture_output=True,
        text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed, \d+ deselected(, \d+ warnings?)? in .*", summary), summary
