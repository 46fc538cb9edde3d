"""Clients nobody here wrote, run as their users run them against the server (the
`clients` extra installs them): guidellm's load test and lm-evaluation-harness's
`local-completions` with its default tokenizer backend (the server's /tokenize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins.hf_models import oracle_torch, oracle_transformers
from tests.plugins.http_server import SERVED_MODEL, SERVER_API_KEY

# Client programs in processes of their own: the full tier.
pytestmark = pytest.mark.full

# Clients must not reach the Hugging Face hub; lm-eval sends OPENAI_API_KEY as the key.
CLIENT_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "OPENAI_API_KEY": SERVER_API_KEY}
NUM_REQUESTS = 3  # guidellm's synchronous profile: one after another
QUESTIONS = [  # a multiple-choice task: (question, choices, index of the answer)
    ("the theater in the", ["air", "theme", "other"], 0),
    ("a thin", ["the", "theme", "air"], 1),
    ("in the", ["other", "thin", "the"], 2),
    ("the other", ["theater", "air", "thin"], 0),
]


def _run(command: list[str], cwd: Path, timeout: float = 120) -> None:
    result = subprocess.run(command, cwd=cwd, env=os.environ | CLIENT_ENV, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _entry_point(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_guidellm_synchronous_profile_completes_with_the_requested_tokens(
        server, tiny_llama_dir, tmp_path):
    """guidellm's default request (chat, streaming, continuous usage stats, ignore_eos),
    a number of them rather than a duration: a loaded machine may finish none in a few
    seconds."""
    base_url, _ = server
    report = tmp_path / "guidellm.json"
    _run([_entry_point("guidellm"), "run",
          "--backend", f"kind=openai_http,target={base_url},model={SERVED_MODEL},"
                       f"api_key={SERVER_API_KEY}",
          "--profile", "kind=synchronous",
          "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
          "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=12",
          "--tokenizer", f"kind=huggingface_auto,model={tiny_llama_dir}",
          "--output", f"kind=json,path={report}", "--disable-console"], tmp_path)
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert requests["errored"] == []
    assert len(requests["successful"]) == NUM_REQUESTS
    for request in requests["successful"]:
        assert request["output_tokens"] == 12
        assert request["prompt_tokens"] >= 24  # the chat template adds its own tokens


def _write_task(directory: Path) -> None:
    data = directory / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (directory / "tiny_mc.yaml").write_text(f"""\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def _transformers_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the continuation's tokens being those the whole
    text has after the context's (lm-evaluation-harness's definition)."""
    torch = oracle_torch()
    whole = tokenizer.encode(context + continuation)
    num_context = len(tokenizer.encode(context))
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(num_context, len(whole)))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_equals_transformers(server, tiny_llama_dir, tmp_path,
                                                       batch_size):
    base_url, _ = server
    _write_task(tmp_path)
    output = tmp_path / "results"
    _run([_entry_point("lm_eval"), "--model", "local-completions",
          "--model_args", f"model={SERVED_MODEL},base_url={base_url}/v1/completions,"
                          "max_retries=1",
          "--batch_size", str(batch_size), "--tasks", "tiny_mc", "--include_path", str(tmp_path),
          "--output_path", str(output), "--log_samples"], tmp_path)
    (samples_file,) = output.rglob("samples_tiny_mc_*.jsonl")
    (results_file,) = output.rglob("results_*.json")
    transformers = oracle_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    correct = []
    for line in samples_file.read_text().splitlines():
        sample = json.loads(line)
        question, choices, answer = QUESTIONS[sample["doc_id"]]
        served = [float(resp[0][0]) for resp in sample["resps"]]
        expected = [_transformers_loglikelihood(model, tokenizer, question, " " + choice)
                    for choice in choices]
        assert served == pytest.approx(expected, abs=1e-4)
        correct.append(max(range(len(choices)), key=expected.__getitem__) == answer)
    assert len(correct) == len(QUESTIONS)
    accuracy = json.loads(results_file.read_text())["results"]["tiny_mc"]["acc,none"]
    assert accuracy == pytest.approx(sum(correct) / len(correct))
