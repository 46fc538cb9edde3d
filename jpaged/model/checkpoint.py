"""A checkpoint's tensors as jpaged's parameters: names, shapes and layouts checked, read
lazily, stacked per layer. Hugging Face directories (jpaged.model.loader) and GGUF files
(jpaged.model.gguf) both come in as Hugging Face-named tensors."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.model.config import LlamaConfig
from jpaged.model.llama import LlamaForCausalLM

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded: `path` names it, `problem` says why."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"cannot load model {path}: {problem}")
        self.path = Path(path)
        self.problem = problem


def float_dtype(dtype: Any) -> jnp.dtype:
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    return resolved


def read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(file, f"not valid JSON ({error})") from error


def llama_config(source: Path, hf_config: Mapping[str, Any]) -> LlamaConfig:
    """LlamaConfig.from_hf_config, its errors naming the file the config comes from."""
    try:
        return LlamaConfig.from_hf_config(hf_config)
    except KeyError as error:
        raise ModelLoadError(source, f"the config has no {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise ModelLoadError(source, str(error)) from error


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
    fused = FUSED_CHECKPOINT_PROBE in tensors.stored
    for path, variable in nnx.to_flat_state(state):
        for part_path, shape in _per_layer(config, path, variable.get_value().shape):
            for name, part_shape in hf_tensor_shapes(config, part_path, shape, fused).items():
                tensors.check(name, part_shape)

    def load(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        parts = _per_layer(config, path, variable.get_value().shape)
        values = [_hf_parameter(tensors, part_path, fused) for part_path, _ in parts]
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


def _hf_parameter(tensors: LazyTensors, path: tuple, fused: bool) -> np.ndarray:
    """One layer's (or a global) parameter in jpaged's layout from its Hugging Face tensors."""
    parts = [tensors[name] for name in hf_tensor_names(path, fused)]
    value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    # Hugging Face [out, in] -> nnx.Linear [in, out]
    return value.T if path[-1] == "kernel" else value


# jpaged's fused projections and the Hugging Face projections they concatenate.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# A tensor only checkpoints with fused projections have.
FUSED_CHECKPOINT_PROBE = "model.layers.0.self_attn.qkv_proj.weight"


def hf_tensor_shapes(
    config: LlamaConfig, path: tuple, shape: tuple[int, ...], fused: bool = False
) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of the tensors that make the parameter at `path`, whose
    own shape is `shape`; a fused projection stacks its parts' rows (unless `fused`: the
    checkpoint holds it whole)."""
    # Hugging Face stores Linear weights [out, in]; nnx.Linear kernels are [in, out].
    hf_shape = shape[::-1] if path[-1] == "kernel" else shape
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    rows = {"qkv_proj": (q_rows, kv_rows, kv_rows),
            "gate_up_proj": (config.intermediate_size,) * 2}.get(path[-2], hf_shape[:1])
    names = hf_tensor_names(path, fused)
    if len(names) == 1:
        rows = hf_shape[:1]
    return {name: (r, *hf_shape[1:]) for name, r in zip(names, rows, strict=True)}


def hf_tensor_names(path: tuple, fused: bool = False) -> list[str]:
    """The Hugging Face names of a parameter's tensors, in concatenation order, e.g.
    ('layers', 0, 'mlp', 'gate_up_proj', 'kernel')
    -> ['model.layers.0.mlp.gate_proj.weight', 'model.layers.0.mlp.up_proj.weight'],
    or ['model.layers.0.mlp.gate_up_proj.weight'] for a `fused` checkpoint."""
    *module, projection, leaf = path
    prefix = "" if path[0] == "lm_head" else "model."
    suffix = ".bias" if leaf == "bias" else ".weight"
    parts = (projection,) if fused else FUSED_PROJECTIONS.get(projection, (projection,))
    return [prefix + ".".join(map(str, (*module, part))) + suffix for part in parts]
