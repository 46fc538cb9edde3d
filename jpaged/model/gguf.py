"""GGUF files (llama.cpp's format): metadata, tokenizer and tensors read as a Hugging Face
config and Hugging Face-named float32 tensors; a GGUF converted to a Hugging Face directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from jpaged.model.checkpoint import (
    LazyTensors,
    ModelLoadError,
    StoredTensor,
    build_model,
    float_dtype,
    llama_config,
)
from jpaged.model.config import LlamaConfig
from jpaged.model.llama import LlamaForCausalLM
from jpaged.model.tokenizer import Tokenizer, TokenizerError

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM"}
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
# Gemma's four norms per layer and its q/k norms; its ffn_norm comes before the MLP.
_GEMMA_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's layers slide but every sixth, whose RoPE base is the GGUF's; the sliding
# layers' base is not in the file (transformers' Gemma 3 default).
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def load_gguf(
    path: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[LlamaForCausalLM, LlamaConfig, Tokenizer]:
    """(model, config, tokenizer) from a llama, qwen2 or gemma3 GGUF file.

    Metadata, tokenizer and every tensor's name and shape are checked before weights are read.
    """
    path = Path(path)
    dtype = float_dtype(dtype)
    hf_config, tensors, tokenizer = read_gguf(path)
    config = llama_config(path, hf_config)
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
    layer_names = _GEMMA_LAYER_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
    by_hf_name = {_hf_name_of_gguf(t.name, layer_names): t for t in reader.tensors}
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
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value - 1  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
        return value

    stored = {name: StoredTensor(path, tuple(int(d) for d in reversed(t.shape)),
                                 partial(read, name))
              for name, t in by_hf_name.items()}
    name_in_gguf = partial(_gguf_name_of_hf, layer_names=layer_names)
    return hf_config, LazyTensors(stored, path, name_in_gguf), tokenizer


class _GGUFFileReader(GGUFReader):
    """GGUFReader that reports a truncated file as such (the original reads past the end
    without noticing and fails later with an unrelated numpy error), and reads metadata
    through a plain ndarray view of its memory map: np.memmap's per-slice bookkeeping
    made a 262,144-token vocabulary take 20 s to read."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None):
        if isinstance(self.data, np.memmap):
            self.data = self.data.view(np.ndarray)
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


def _hf_name_of_gguf(name: str, layer_names: Mapping[str, str]) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match[2] in layer_names:
        return f"model.layers.{match[1]}.{layer_names[match[2]]}.{match[3]}"
    module, _, leaf = name.rpartition(".")
    return f"{_GGUF_GLOBAL_NAMES[module]}.{leaf}" if module in _GGUF_GLOBAL_NAMES else name


def _gguf_name_of_hf(name: str, layer_names: Mapping[str, str]) -> str:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    gguf_names = {hf: gguf for gguf, hf in layer_names.items()}
    if match and match[2] in gguf_names:
        return f"blk.{match[1]}.{gguf_names[match[2]]}.{match[3]}"
    module, _, leaf = name.rpartition(".")
    gguf_globals = {hf: gguf for gguf, hf in _GGUF_GLOBAL_NAMES.items()}
    return f"{gguf_globals[module]}.{leaf}" if module in gguf_globals else name


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
    config = {
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
    return config | _gemma3_fields(path, fields, config) if arch == "gemma3" else config


def _gemma3_fields(path: Path, fields: Mapping[str, Any], config: Mapping[str, Any]
                   ) -> dict[str, Any]:
    """The Gemma 3 text config a GGUF implies, as transformers reads it: five sliding layers
    to one global, the GGUF's RoPE base on global layers, 10,000 on sliding ones."""
    layers = config["num_hidden_layers"]
    return {
        "model_type": "gemma3_text",
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _metadata(path, fields, "gemma3.attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0
                        else "sliding_attention" for i in range(layers)],
        "query_pre_attn_scalar": config["head_dim"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        },
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
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
