"""PEFT LoRA adapters read from disk and checked against the model, on the host.

An adapter directory holds adapter_config.json and adapter_model.safetensors, as PEFT's
`save_pretrained` writes them. Each targeted projection W [out, in] of layer l gets
W + scaling * B @ A with A [r, in], B [out, r] and scaling lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora). jpaged fuses q/k/v and gate/up into one projection each
(jpaged.model.llama), so an adapter becomes, per fused projection, A [L, in, P * R] with
the pieces' A's side by side and B [L, P * R, out] block-diagonal (P pieces, R =
max_lora_rank, ranks below R padded with zeros), B scaled: the layout of the device's
slots. Anything this reading cannot honour is refused with the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError, safe_open

from jpaged.lora.request import LoRARequest

if TYPE_CHECKING:
    from jpaged.model.config import LlamaConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# jpaged's fused projections and the Hugging Face projections each holds, in order.
FUSED_TARGETS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
TARGET_MODULES = tuple(name for names in FUSED_TARGETS.values() for name in names)
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Settings of PEFT's LoraConfig that change the model in ways jpaged does not apply, with
# the value that leaves the model as plain LoRA does.
_PLAIN = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
          "layers_to_transform": (None,), "layers_pattern": (None, [], ""),
          "modules_to_save": (None, []), "bias": ("none",), "fan_in_fan_out": (False, None)}


class AdapterLoadError(ValueError):
    """An adapter that cannot be served: `path` names the file, the message the field."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"cannot load LoRA adapter {path}: {problem}")
        self.path = path


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read and laid out for the slots (see the module docstring).

    factors: fused projection ("self_attn.qkv_proj", ...) -> (A f32 [L, in, P * R],
             B f32 [L, P * R, out]), B scaled; every fused projection present (zeros
             where the adapter targets none of its pieces).
    weights_hash: sha256 of the adapter's two files: prefix-cache keys carry it, so new
             weights under an old name never meet the old name's cached KV.
    """

    name: str
    int_id: int
    path: str
    rank: int
    target_modules: tuple[str, ...]
    factors: dict[str, tuple[np.ndarray, np.ndarray]]
    weights_hash: str

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the adapter's weights: (name, weights hash)."""
        return self.name, self.weights_hash

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Hugging Face projection name -> (out, in) of its weight in `config`'s model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def read_adapter(request: LoRARequest, config: LlamaConfig, max_rank: int) -> LoRAAdapter:
    """The adapter of `request` for a model of `config` (single-device layout) and slots of
    rank `max_rank`; AdapterLoadError (a ValueError) naming the file and field of anything
    it cannot serve."""
    directory = Path(request.lora_path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise AdapterLoadError(file, "no such file (a PEFT adapter directory holds "
                                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    settings = _read_config(config_file)
    rank, scaling, targets = _check_config(config_file, settings, max_rank)
    tensors = _read_tensors(weights_file, config, rank, targets)
    factors = _fused_factors(tensors, config, rank, scaling, max_rank)
    digest = hashlib.sha256(config_file.read_bytes())
    with weights_file.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(directory), rank, targets,
                       factors, digest.hexdigest())


def _read_config(file: Path) -> dict:
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterLoadError(file, f"not readable JSON ({error})") from error
    if not isinstance(settings, dict):
        raise AdapterLoadError(file, "not a JSON object")
    return settings


def _check_config(file: Path, settings: dict, max_rank: int
                  ) -> tuple[int, float, tuple[str, ...]]:
    """(rank, scaling, target modules) of a LoRA config jpaged can serve."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(file, f"peft_type {settings['peft_type']!r}: only 'LORA' is "
                                     "supported")
    for field, plain in _PLAIN.items():
        if settings.get(field) not in plain:
            raise AdapterLoadError(file, f"{field}={settings[field]!r} is not supported "
                                         f"(only {plain[0]!r})")
    rank = settings.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterLoadError(file, f"r must be an int >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterLoadError(file, f"r={rank} is above max_lora_rank={max_rank}")
    alpha = settings.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise AdapterLoadError(file, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (rank ** 0.5 if settings.get("use_rslora") else rank)
    targets = settings.get("target_modules")
    if targets == "all-linear":
        targets = TARGET_MODULES
    if not isinstance(targets, list | tuple) or not targets:
        raise AdapterLoadError(file, f"target_modules must be a list of projection names "
                                     f"among {list(TARGET_MODULES)} (or 'all-linear'), got "
                                     f"{targets!r}")
    unknown = [name for name in targets if name not in TARGET_MODULES]
    if unknown:
        raise AdapterLoadError(file, f"target_modules {unknown} are not projections of the "
                                     f"model; it has {list(TARGET_MODULES)}")
    return rank, float(scaling), tuple(dict.fromkeys(targets))


def _read_tensors(file: Path, config: LlamaConfig, rank: int, targets: tuple[str, ...]
                  ) -> dict[tuple[int, str, str], np.ndarray]:
    """(layer, projection, "A" or "B") -> the tensor, every name and shape checked."""
    shapes = projection_shapes(config)
    tensors = {}
    try:
        with safe_open(file, framework="numpy") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                match = _TENSOR_NAME.fullmatch(name)
                if match is None:
                    raise AdapterLoadError(file, f"tensor {name!r} is not a LoRA factor of a "
                                                 "decoder layer's projection")
                layer, projection, factor = int(match[1]), match[3], match[4]
                if projection not in targets or layer >= config.num_layers:
                    raise AdapterLoadError(file, f"tensor {name!r}: the model has no such "
                                                 f"projection among target_modules "
                                                 f"{list(targets)} and its {config.num_layers} "
                                                 "layers")
                out, inp = shapes[projection]
                expected = (rank, inp) if factor == "A" else (out, rank)
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected:
                    raise AdapterLoadError(file, f"tensor {name!r} has shape {shape}, the model "
                                                 f"and r={rank} need {expected}")
                tensors[layer, projection, factor] = np.asarray(handle.get_tensor(name),
                                                                np.float32)
    except (OSError, SafetensorError) as error:
        raise AdapterLoadError(file, f"not a readable safetensors file ({error})") from error
    return tensors


def _fused_factors(tensors: dict, config: LlamaConfig, rank: int, scaling: float,
                   max_rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    shapes, layers = projection_shapes(config), config.num_layers
    factors = {}
    for fused, pieces in FUSED_TARGETS.items():
        width = sum(shapes[piece][0] for piece in pieces)
        a = np.zeros((layers, shapes[pieces[0]][1], len(pieces) * max_rank), np.float32)
        b = np.zeros((layers, len(pieces) * max_rank, width), np.float32)
        column = 0
        for i, piece in enumerate(pieces):
            ranks = slice(i * max_rank, i * max_rank + rank)
            columns = slice(column, column + shapes[piece][0])
            for layer in range(layers):
                if (layer, piece, "A") in tensors and (layer, piece, "B") in tensors:
                    a[layer, :, ranks] = tensors[layer, piece, "A"].T
                    b[layer, ranks, columns] = scaling * tensors[layer, piece, "B"].T
            column = columns.stop
        factors[fused] = (a, b)
    return factors
