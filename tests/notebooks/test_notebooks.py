"""The notebooks run top to bottom on CPU with small settings.

Each notebook is executed with nbclient in a kernel on this interpreter, with a cell
injected after its parameters cell (as papermill does) that sets the small settings. The
quickstart loads tiny random Llama and Qwen2 checkpoints written by transformers instead
of the default model. The walkthrough must draw a picture of every state it prints, and
every printed reference count must equal an independent recount of the printed block
tables.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
from collections import Counter
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

# Notebooks run in kernels of their own: the full tier.
pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "jpaged-notebook-test"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def kernel(tmp_path, monkeypatch) -> str:
    """A kernel spec for this interpreter that imports this checkout's jpaged, found first."""
    write_kernel_spec(tmp_path / "kernels" / KERNEL)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return KERNEL


def execute(name: str, parameters: str, kernel: str) -> nbformat.NotebookNode:
    """Run notebook `name` with `parameters` (code) injected after its parameters cell."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells)
              if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters'"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(parameters))
    client = NotebookClient(notebook, timeout=300, kernel_name=kernel,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells)
    return notebook


def outputs(notebook: nbformat.NotebookNode) -> list[dict]:
    return [output for cell in notebook.cells for output in cell.get("outputs", [])]


def stdout(notebook: nbformat.NotebookNode) -> str:
    return "".join(output["text"] for output in outputs(notebook)
                   if output["output_type"] == "stream" and output["name"] == "stdout")


@pytest.mark.parametrize("name", ["quickstart.ipynb", "paging_walkthrough.ipynb",
                                  "block_size_and_rate_study.ipynb"])
def test_notebooks_are_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_quickstart_runs_on_tiny_checkpoints(kernel, tiny_llama_dir, tiny_qwen2_dir):
    parameters = "\n".join([
        "from jpaged.core.step_shapes import BucketSizes",
        f"MODEL = {str(tiny_llama_dir)!r}",
        f"HF_CHECKPOINT = {str(tiny_qwen2_dir)!r}",
        "MAX_TOKENS = 8",
        # One padded step shape, so each model compiles its step once.
        "ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,",
        "                   num_blocks=64, buckets=BucketSizes(min_num_tokens=64, min_num_seqs=4))",
    ])
    notebook = execute("quickstart.ipynb", parameters, kernel)
    text = stdout(notebook)
    summary = json.loads(text[text.index("{\n"): text.index("\n}\n") + 2])
    assert summary["finished_requests"] > 0 and summary["output_tokens"] > 0
    assert 0 < summary["kv_utilization_mean"] <= summary["kv_utilization_peak"] <= 1
    # Parallel samples and beams shared blocks: the tables held more than the pool.
    assert summary["kv_blocks_logical_mean"] > summary["kv_blocks_physical_mean"]
    assert 0 < summary["kv_memory_saved"] < 1
    # Both models answered every greedy prompt.
    assert len(re.findall(r"^'[^']*' -> ", text, re.M)) == 2 * 3


def parse_states(text: str) -> list[tuple[dict[str, list[int]], dict[int, int]]]:
    """The (block tables, refcounts) pairs the walkthrough printed, in order."""
    tables = re.findall(r"^block tables: (.*)$", text, re.M)
    refcounts = re.findall(r"^refcounts: (.*)$", text, re.M)
    assert len(tables) == len(refcounts)
    return [(ast.literal_eval(t), ast.literal_eval(r)) for t, r in zip(tables, refcounts,
                                                                        strict=True)]


def test_paging_walkthrough_draws_every_state(kernel):
    notebook = execute("paging_walkthrough.ipynb", "FIGURE_DPI = 50", kernel)
    pngs = [base64.b64decode(output["data"]["image/png"]) for output in outputs(notebook)
            if "image/png" in output.get("data", {})]
    states = parse_states(stdout(notebook))
    assert len(states) >= 7 and len(pngs) == len(states)
    assert all(png.startswith(PNG_SIGNATURE) for png in pngs)
    for tables, refcounts in states:
        holders = Counter(block for table in tables.values() for block in table)
        assert refcounts == dict(holders)
        assert 0 not in holders  # the null block is never handed out
    assert states[-1] == ({}, {})
    # The story's events happened: a fork (a block with two holders), a copy-on-write
    # copy, a prefix-cache hit and an eviction.
    assert any(count >= 2 for _, refcounts in states for count in refcounts.values())
    text = stdout(notebook)
    copies = ast.literal_eval(re.search(r"^copy-on-write copies .*?: (.*)$", text, re.M)[1])
    assert len(copies) == 1
    assert int(re.search(r"hit_blocks=(\d+)", text)[1]) > 0
    assert ast.literal_eval(re.search(r"^evicted from the prefix cache: (.*)$", text, re.M)[1])


@pytest.mark.default_model
def test_block_size_and_rate_study_draws_its_figures(kernel):
    parameters = "\n".join([
        "NUM_REQUESTS = 3", "RATE_FRACTIONS = (1.0, 2.0)", "START_FRACTION = 1.0",
        "BASE_FRACTION = 1.0",
        "BLOCK_SIZES = (8, 32)",
        "SIM_REQUESTS = 60", "LENGTH_SCALE = 0.1", "MAX_MODEL_LEN = 128", "FIGURE_DPI = 50",
    ])
    notebook = execute("block_size_and_rate_study.ipynb", parameters, kernel)
    pngs = [base64.b64decode(output["data"]["image/png"]) for output in outputs(notebook)
            if "image/png" in output.get("data", {})]
    assert len(pngs) == 3 and all(png.startswith(PNG_SIGNATURE) for png in pngs)
    text = stdout(notebook)
    fragmentation = [float(f) for f in re.findall(r"internal fragmentation +([\d.]+) %", text)]
    assert len(fragmentation) == 2 and fragmentation[0] <= fragmentation[1]
    sustained = re.findall(r"^(paged|orca-\w+) +sustains ([\d.]+) requests/s", text, re.M)
    assert {policy for policy, _ in sustained} == {"paged", "orca-max", "orca-pow2",
                                                   "orca-oracle"}
    assert all(float(rate) > 0 for _, rate in sustained)
    capacities = re.findall(r"capacity ([\d.]+) requests/s", text)
    assert len(capacities) == 4 and all(float(capacity) > 0 for capacity in capacities)
