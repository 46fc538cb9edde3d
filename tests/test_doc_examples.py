"""Every Python and shell example of README.md and docs/ runs as a reader runs it.

sybil finds the fenced `python` and `bash` blocks. A page's examples run in its order in
one namespace (a later block uses what an earlier one defined), from an empty directory,
with `python` the interpreter running the tests and the models cached. A shell block runs
under `bash -e`; a `python -m jpaged serve` line in one starts the server in the
background, where the page's later blocks find it, until the page is done; `curl` fails
on an HTTP error. What an example's text promises beyond running is checked after its
page (PROMISES).

NOT_RUN lists the examples that need what a test machine lacks (a GPU, a TPU, several
hosts, the Hugging Face Hub, more than a few minutes, a model path to fill in) or that
change the repository, each with why; a fast test holds it to the pages: every example
runs or is listed, and every entry names an example. The pages run in the full tier.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SERVE = "python -m jpaged serve"
SERVER_START_S = 300
SHELL_TIMEOUT_S = 600

# (page, the example's first line): why the tests do not run it.
NOT_RUN = {
    ("README.md", 'pip install -e ".[experiments]" && python -m experiments.sweep --quick'):
        "installs the package into the environment; tests/experiments runs the quick sweep",
    ("README.md", 'pip install torch==2.13.0 && pip install -e ".[test,clients]"'):
        "installs packages and runs the whole suite, this test included",
    ("README.md", "python -m experiments.sweep"):
        "the study at its full settings: well over an hour on a CPU",
    ("docs/benchmarks.md", "python -m benchmarks.scheduler > docs/data/scheduler.json"):
        "rewrites the kept measurements and docs/results.md; tests/benchmarks runs the "
        "benchmarks, tests/test_docs.py the page's generator",
    ("docs/multihost.md", "# two processes with four simulated CPU devices each"):
        "a model path to fill in, with heads that 8 divides; tests/test_multihost.py runs "
        "the launcher's jobs on a tiny model",
    ("docs/multihost.md", "# tp_job.py: python -m jpaged.launch --num-processes 3"):
        "three processes loading SmolLM2, most of a minute; tests/test_multihost.py runs "
        "such scripts on a tiny model",
    ("docs/multihost.md", "gcloud compute tpus tpu-vm ssh my-slice"): "a TPU pod slice",
    ("docs/multihost.md", "# on host 0 (10.0.0.1) and host 1"): "two GPU hosts",
    ("docs/serving.md", "lm_eval --model local-completions --tasks hellaswag"):
        "downloads hellaswag from the Hugging Face Hub and runs for hours; "
        "tests/entrypoints runs lm-evaluation-harness on local tasks",
    ("docs/serving.md", "guidellm run --backend kind=openai_http"):
        "a load run of 30 seconds and more; tests/entrypoints runs guidellm briefly",
    ("docs/serving.md", "python -m jpaged serve --model /path/to/llama -tp 2 -dp 4"):
        "a model path to fill in, and 8 devices",
    ("docs/testing.md", "python -m pytest -q -n 2 --dist loadfile"):
        "the whole suite, this test included",
    ("docs/testing.md", "python -m tests.references.regenerate"):
        "rewrites tests/references; the full tier regenerates them and compares",
    ("docs/testing.md", "python -m benchmarks.suite_durations --full"):
        "runs the whole suite and rewrites the kept durations",
    ("docs/usage.md", "from jpaged import LLM, LoRARequest, SamplingParams"):
        "adapter directories to fill in; tests/lora holds PEFT adapters to transformers + "
        "PEFT through this API",
    ("docs/serving.md", "python -m jpaged serve --model smollm2 --enable-lora"):
        "adapter directories to fill in; tests/entrypoints/test_server_lora.py serves PEFT "
        "adapters by --lora-modules' rules",
    ("docs/usage.md", "# Proposals from a smaller model with the same vocabulary"):
        "a draft model's path to fill in; benchmarks.speculative writes such a draft and "
        "tests/speculative runs it",
    ("docs/usage.md", 'python -m jpaged generate "The capital of France is" --num-cpu-devices'):
        "tests/entrypoints/test_vllm_options.py runs this command and compares its tokens "
        "with one device's",
    ("docs/usage.md", 'llm = LLM(model="/path/to/llama", tensor_parallel_size=4)'):
        "a model path to fill in, and 8 devices; tests/multidevice runs SmolLM2 at TP 3",
}


def page_name(page: Path) -> str:
    return str(page.relative_to(REPO))


def first_line(example: Example) -> str:
    return next(line.strip() for line in str(example.parsed).splitlines() if line.strip())


def listed_reason(page: Path, example: Example) -> str | None:
    """Why NOT_RUN leaves the example out, or None."""
    line = first_line(example)
    return next((why for (name, start), why in NOT_RUN.items()
                 if name == page_name(page) and line.startswith(start)), None)


def examples(page: Path) -> list[Example]:
    """The page's python and bash examples, in order."""
    sybil = Sybil(parsers=[PythonCodeBlockParser(), CodeBlockParser("bash", run_shell)])
    return list(sybil.parse(page))


def run_shell(example: Example) -> None:
    """A bash block: `python -m jpaged serve` lines start in the background (kept in the
    page's namespace), the rest runs under `bash -e`."""
    commands = str(example.parsed).replace("\\\n", " ").splitlines()
    script = "\n".join(c for c in commands if not c.strip().startswith(SERVE))
    for command in commands:
        if command.strip().startswith(SERVE):
            example.namespace.setdefault("servers", []).append(start_server(command))
    if script.strip():
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script],
                              env=shell_environment(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
        assert done.returncode == 0, (f"exit {done.returncode}:\n{script}\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def shell_environment() -> dict[str, str]:
    """`python` the tests' interpreter with this tree importable; `curl` failing on an
    HTTP error (the examples' own curl reports it only in the body)."""
    shims = Path.cwd() / ".shims"
    if not shims.exists():
        shims.mkdir()
        # Scripts, not links: a link to a virtual environment's python leaves the environment.
        for name, command in (("python", sys.executable),
                              ("curl", f"{program('curl')} --fail-with-body")):
            (shims / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
            (shims / name).chmod(0o755)
    path = os.pathsep.join([str(shims), os.environ.get("PATH", "")])
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": path, "PYTHONPATH": python_path}


def program(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"the examples need {name} on PATH")
    return found


def start_server(command: str) -> subprocess.Popen:
    """The server the command starts, once /health answers."""
    words = shlex.split(command)
    port = words[words.index("--port") + 1] if "--port" in words else "8000"
    log = open(Path.cwd() / f"server-{port}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen([sys.executable, *words[1:]], env=shell_environment(),
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{command} exited {process.returncode}:\n"
                        f"{Path(log.name).read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health", timeout=5):
            return process
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"{command}: no /health within {SERVER_START_S} s")


def stop_servers(namespace: dict) -> None:
    for process in namespace.get("servers", []):
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def sharing_saves_memory(namespace: dict) -> None:
    """The sharing examples: every sample answers, and sharing the prompt's full blocks
    saved KV memory."""
    output = namespace["samples"][0] if "samples" in namespace else namespace["output"]
    assert [s.text for s in output.outputs if not s.text.strip()] == []
    assert output.metrics.kv_memory_saved > 0


# What a page's text promises of its examples beyond running them.
PROMISES: dict[str, Callable[[dict], None]] = {
    "README.md": sharing_saves_memory,
    "docs/usage.md": sharing_saves_memory,
}


def test_every_entry_of_not_run_names_an_example_of_the_pages():
    found = {(page_name(page), first_line(example))
             for page in PAGES for example in examples(page)}
    listed = {key for key in NOT_RUN
              if any(name == key[0] and line.startswith(key[1]) for name, line in found)}
    assert sorted(set(NOT_RUN) - listed) == []


RUN_PAGES = [page for page in PAGES
             if any(listed_reason(page, e) is None for e in examples(page))]


@pytest.mark.full
@pytest.mark.default_model
@pytest.mark.parametrize("page", RUN_PAGES, ids=page_name)
def test_the_page_s_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    document = examples(page)
    namespace = document[0].namespace if document else {}
    try:
        for example in document:
            if listed_reason(page, example) is None:
                example.evaluate()
        PROMISES.get(page_name(page), lambda _: None)(namespace)
    finally:
        stop_servers(namespace)
        namespace.clear()
