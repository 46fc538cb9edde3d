"""Jobs of two processes on loopback (python -m jpaged.launch), four CPU devices each:
the multi-controller path of several hosts, short of the interconnect.

Each job runs tests/multidevice/multihost_worker.py in both processes. The oracle
of the tokens is the same engine on this process's one device; of the lockstep,
the two processes' records of every step.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jpaged import launch as launch_module
from jpaged.engine import mirror
from jpaged.entrypoints.llm import LLM
from tests.multidevice import multihost_worker as worker
from tests.plugins.hf_models import _save, oracle_transformers, randomize, tiny_tokenizer
from tests.plugins.http_server import http_request, wait_until_healthy

# Jobs of several processes: the full tier.
pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_TIMEOUT_S = 10
# A job that has not ended by then hangs: the launcher kills it and the test fails.
JOB_TIMEOUT_S = 240
# Where the one-device and the sharded sums, added in another order, may pick another token.
NEAR_TIE = 1e-4
# Eight query heads (two KV heads, each replicated over four devices): tensor parallel 8.
WIDE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def wide_model_dirs(tmp_path_factory) -> list[Path]:
    """A random Llama (untied) and Qwen2 (q/k/v biases, tied embeddings) of eight heads."""
    transformers = oracle_transformers()
    tokenizer = tiny_tokenizer()
    dirs = []
    for name, config_type, model_type, seed in (
            ("wide_llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, 0),
            ("wide_qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, 1)):
        config = config_type(vocab_size=len(tokenizer), **WIDE_SHAPE,
                             tie_word_embeddings=name == "wide_qwen2",
                             bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        model = randomize(model_type(config), seed)
        dirs.append(_save(model, tokenizer, tmp_path_factory.mktemp(name)))
    return dirs


def launch(mode: str, tmp_path: Path, model_dirs: list[Path]) -> tuple[int, str, list]:
    """Run the worker's job; (the launcher's status, its report, each process's record
    (None where the process wrote none))."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    command = [sys.executable, "-m", "jpaged.launch", "--num-processes", "2",
               "--devices-per-process", "4", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
               "--timeout", str(JOB_TIMEOUT_S), "--log-dir", str(tmp_path / "logs"), "--",
               worker.__file__, mode, str(out_dir), *map(str, model_dirs)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_S + 60)
    logs = "".join(f"\n--- process {i}:\n" + log(tmp_path, i)[-6000:] for i in (0, 1))
    records = [json.loads(path.read_text()) if path.exists() else None
               for path in (out_dir / f"process_{i}.json" for i in (0, 1))]
    return result.returncode, result.stderr + logs, records


def log(tmp_path: Path, process: int) -> str:
    path = tmp_path / "logs" / f"process_{process}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def one_device_outputs(model_dir: Path):
    """The worker's prompts on this process's first device, with the top-2 log-probabilities."""
    llm = LLM(str(model_dir), **worker.ENGINE)
    params = dataclasses.replace(worker.GREEDY, logprobs=2)
    prompts = [{"prompt_token_ids": prompt} for prompt in worker.PROMPTS]
    return llm.generate(prompts, params)


def assert_greedy_tokens_equal(reference, tokens: dict[str, list[int]]) -> None:
    """Tokens equal the one-device ones up to the first near tie of a sequence (after
    which its contexts differ)."""
    for index, expected in enumerate(reference):
        expected, got = expected.outputs[0], tokens[str(index)][0]
        assert len(got) == len(expected.token_ids)
        for step, (want, have) in enumerate(zip(expected.token_ids, got, strict=True)):
            if want != have:
                top = sorted((lp.logprob for lp in expected.logprobs[step].values()),
                             reverse=True)
                assert top[0] - top[1] < NEAR_TIE, (
                    f"request {index} step {step}: token {have} instead of {want}")
                break


@pytest.mark.parametrize("mode", ["tp8", "tp4dp2"])
def test_two_processes_give_one_devices_tokens_in_lockstep(mode, wide_model_dirs, tmp_path):
    """Tensor parallel 8 over both processes, or 4 within each with a data-parallel
    replica per process: greedy tokens as on one device; both processes return the
    same outputs after every step (two samples of one prompt included) and, for a
    replica spanning both, hold the same queues and block tables."""
    status, report, records = launch(mode, tmp_path, wide_model_dirs)
    assert status == 0, report
    first, second = records
    for model_dir in wide_model_dirs:
        name = model_dir.name
        assert first[name]["steps"] == second[name]["steps"]
        assert len(first[name]["steps"]) > 1
        tokens = first[name]["tokens"]
        assert sorted(tokens) == sorted([*map(str, range(len(worker.PROMPTS))), "sampled"])
        assert_greedy_tokens_equal(one_device_outputs(model_dir), tokens)
        assert [len(sample) for sample in tokens["sampled"]] == [worker.GREEDY.max_tokens] * 2
        if mode == "tp4dp2":
            # Five requests: three on process 0's replica, two on process 1's.
            assert [first[name]["local_requests"], second[name]["local_requests"]] == [[3], [2]]
        else:
            assert any(step["state"][0] for step in first[name]["steps"])  # tables compared


def process_exits(report: str) -> dict[int, tuple[int, float]]:
    """{process: (exit status, seconds after the start)} from the launcher's report."""
    return {int(process): (int(status), float(seconds)) for process, status, seconds in
            re.findall(r"process (\d) exited with status (\d+) after ([\d.]+) s", report)}


@pytest.mark.parametrize("exiting", [0, 1])
def test_a_process_that_exits_stops_the_other(exiting, wide_model_dirs, tmp_path):
    """One process exits mid-run (process 0 also hosts the coordinator): the other stops
    itself (the launcher kills no one) with JAX's error naming a dead task, within the
    heartbeat timeout and a margin."""
    status, report, _ = launch(f"exit:{exiting}", tmp_path, wide_model_dirs[:1])
    assert status == worker.EXIT_STATUS, report
    exits = process_exits(report)
    other = 1 - exiting
    assert exits[exiting][0] == worker.EXIT_STATUS, report
    assert exits[other][0] not in (0, 128 + 9), report  # failed, not killed (SIGKILL)
    assert exits[other][1] - exits[exiting][1] < HEARTBEAT_TIMEOUT_S + 15, report
    assert not re.search(r"jpaged.launch: .*killing", report)
    assert "another task died" in log(tmp_path, other), report


@pytest.mark.parametrize("mode, message", [
    ("diverge", r"LockstepError: step 1: processes \[1\] planned another step"),
    ("diverge-dp", r"LockstepError: processes \[1\] routed other requests"),
])
def test_processes_given_different_requests_stop_at_once(mode, message, wide_model_dirs,
                                                         tmp_path):
    """Process 1 gets another last prompt (TP 8: before the first step runs), or one more
    request (TP 4 x DP 2: when the first step's outputs are exchanged): both processes
    raise LockstepError, rather than wait in collectives that never meet or return
    what the other did not run."""
    status, report, records = launch(mode, tmp_path, wide_model_dirs[:1])
    assert status == 1, report
    assert records == [None, None]
    for process in (0, 1):
        assert re.search(message, log(tmp_path, process)), report


def test_a_server_on_process_0_runs_its_requests_on_both(wide_model_dirs, tmp_path):
    """`serve --distributed`, tensor parallel 4 x data parallel 2 over the two processes:
    completions as on one device, before and after an idle spell longer than the
    heartbeat; SIGTERM to the launcher stops process 0's server, which stops process 1."""
    model_dir, port = wide_model_dirs[0], launch_module.free_port()
    engine = {"block-size": 8, "num-blocks": 48, "max-num-seqs": 4,
              "max-num-batched-tokens": 64, "max-model-len": 128}
    command = [sys.executable, "-m", "jpaged.launch", "--num-processes", "2",
               "--devices-per-process", "4", "--timeout", str(JOB_TIMEOUT_S),
               "--log-dir", str(tmp_path / "logs"), "--", "-m", "jpaged", "serve",
               "--distributed", "--model", str(model_dir), "--port", str(port),
               "--tensor-parallel-size", "4", "--data-parallel-size", "2",
               *(f"--{name}={value}" for name, value in engine.items())]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base_url, launcher, timeout=JOB_TIMEOUT_S)
        reference = [o.outputs[0].text for o in one_device_outputs(model_dir)]
        texts = []
        for index, prompt in enumerate(worker.PROMPTS):
            if index == 2:
                time.sleep(mirror.HEARTBEAT_S + 1)
            body = {"model": str(model_dir), "prompt": prompt, "temperature": 0,
                    "max_tokens": worker.GREEDY.max_tokens, "ignore_eos": True}
            reply = http_request(base_url, "POST", "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
            assert reply.status == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
        assert texts == reference
        launcher.send_signal(signal.SIGTERM)
        _, report = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    report += "".join(f"\n--- process {i}:\n" + log(tmp_path, i)[-6000:] for i in (0, 1))
    statuses = {process: status for process, (status, _) in process_exits(report).items()}
    assert statuses == {0: 128 + signal.SIGTERM, 1: 0}, report
