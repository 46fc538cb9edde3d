"""LlamaConfig: the architecture of a Llama-family decoder, read from Hugging Face configs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# The families whose sliding_window applies (Qwen2/3 carry one that use_sliding_window
# switches on, which is refused).
WINDOWED_MODEL_TYPES = ("mistral", "phi3", *GEMMA_MODEL_TYPES)
# The MLP's activations by their transformers names: SiLU (SwiGLU) and tanh-approximated
# GELU (Gemma's GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# transformers' names of a layer's attention (`layer_types`).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (rope_type "llama3" in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Positions divided by `factor` (rope_type "linear"; Gemma 3's global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE: frequency i divided by short_factor[i], or by long_factor[i] for a
    sequence longer than original_max_position_embeddings; cos and sin times
    attention_factor."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class AdapterSlots:
    """The static LoRA slots of a model: `num_slots` adapters (vLLM's max_loras) of rank at
    most `max_rank` (max_lora_rank) held at once on the device, in every projection.

    Slot ids run 1..num_slots; slot 0 is the base model, which no array row holds: a
    token of slot 0 matches no slot and gets no low-rank term."""

    num_slots: int
    max_rank: int

    def __post_init__(self):
        for name in ("num_slots", "max_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder.

    qk_norm: Qwen3's RMSNorm of each query and key head over head_dim, before RoPE.
    sliding_window: W: a token at position p of a sliding layer sees the keys
    p - W < j <= p. layer_types: each layer's "full_attention" or "sliding_attention"
    (transformers' names); None with a window makes every layer slide (Mistral).
    local_rope_theta: the RoPE base of sliding layers, which then take no rope_scaling
    (Gemma 3's local RoPE); None: every layer has rope_theta and rope_scaling.
    partial_rotary_factor: RoPE turns the first rotary_dim = head_dim * factor
    dimensions of each head and passes the rest (Phi-3, Phi-4-mini).

    Gemma's departures from Llama (Gemma 3 adds qk_norm and local_rope_theta):
    hidden_act "gelu_pytorch_tanh" (GeGLU); norm_unit_offset, RMSNorm weights w scale
    by 1 + w; sandwich_norms, a norm after attention and around the MLP
    (post_attention_layernorm, pre_ and post_feedforward_layernorm); scale_embeddings,
    embeddings times sqrt(hidden_size) in the model's dtype; query_pre_attn_scalar,
    attention scores scaled by its inverse square root (else head_dim's);
    attn_logit_softcapping and final_logit_softcapping c, scores or logits x become
    c * tanh(x / c).

    shard_groups: the fused `qkv_proj` and `gate_up_proj` columns come in this many
    equal groups, group g holding [its q heads | its k heads | its v heads] and
    [its gate columns | its up columns] (heads and columns in order, group g the
    g-th slice of each). 1 is Hugging Face's order concatenated; tensor
    parallelism over N devices lays them out in N groups (jpaged.model.sharding),
    so that each device's contiguous slice of the columns is its own q, k, v.

    adapter_slots: the LoRA adapter slots every projection carries (jpaged.model.lora);
    None: a model without adapters.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | LinearRopeScaling | LongRopeScaling | None = None
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    shard_groups: int = 1
    adapter_slots: AdapterSlots | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings", "shard_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in "
                             f"(0, 1] and give an even rotary_dim, got {self.rotary_dim}")
        if isinstance(self.rope_scaling, LongRopeScaling):
            for name in ("short_factor", "long_factor"):
                if len(getattr(self.rope_scaling, name)) != self.rotary_dim // 2:
                    raise ValueError(f"rope {name} has {len(getattr(self.rope_scaling, name))} "
                                     f"entries, rotary_dim // 2 = {self.rotary_dim // 2} needed")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; expected one "
                             f"of {ACTIVATIONS}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 or null, got {getattr(self, name)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or null, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers (num_hidden_layers)")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types {unknown} are not supported; expected {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window "
                                 "is null")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % self.shard_groups:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of "
                                 f"shard_groups ({self.shard_groups})")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE turns."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by before the soft-cap and softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for a layer that sees every key."""
        types = self.layer_types or ("sliding_attention",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> LlamaConfig:
        """Read a Hugging Face config (a config.json dict or a transformers config).

        Accepts model_type "llama" (Llama 2/3, SmolLM2), "mistral" (a sliding window
        over every layer, or none), "qwen2" (Qwen2/2.5), "qwen3" (dense Qwen3), "gemma2"
        and "gemma3_text" (see the class docstring), with the RoPE settings in either
        transformers 4 (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`)
        or transformers 5 (`rope_parameters`, per layer type for Gemma 3) form.
        """
        d = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
        _check_supported(d)
        num_heads = d["num_attention_heads"]
        gemma = d["model_type"] in GEMMA_MODEL_TYPES
        rope, local_rope = _rope_parameters(d)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_rope_scaling(rope, d),
            local_rope_theta=local_rope,
            partial_rotary_factor=float(rope.get("partial_rotary_factor")
                                        or d.get("partial_rotary_factor") or 1.0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its configs carry no flag for them.
            attention_bias=d["model_type"] == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=d["model_type"] in ("qwen3", "gemma3_text"),
            sliding_window=(d.get("sliding_window")
                            if d["model_type"] in WINDOWED_MODEL_TYPES else None),
            layer_types=_layer_types(d),
            hidden_act=_activation(d),
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=d.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_ids_tuple(d.get("eos_token_id")),
        )


def token_ids_tuple(token_ids: int | list[int] | None) -> tuple[int, ...]:
    """A config's `eos_token_id` (an int, a list or None) as a tuple."""
    if token_ids is None:
        return ()
    return (token_ids,) if isinstance(token_ids, int) else tuple(token_ids)


def _check_supported(d: Mapping[str, Any]) -> None:
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    field = "hidden_activation" if d.get("hidden_activation") else "hidden_act"
    if _activation(d) not in ACTIVATIONS:
        raise ValueError(f"{field} {_activation(d)!r} is not supported; expected one of "
                         f"{ACTIVATIONS}")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if model_type in ("llama", "mistral", "qwen3", "phi3", *GEMMA_MODEL_TYPES) and d.get(
            "attention_bias"):
        # Their flag also adds an o_proj bias, which this model does not have.
        raise ValueError(f"attention_bias=True is not supported for model_type {model_type!r}")
    if d.get("use_sliding_window"):
        # Qwen2/Qwen3's window over the layers past max_window_layers.
        raise ValueError("use_sliding_window=True is not supported")


def _activation(d: Mapping[str, Any]) -> str:
    """The MLP's activation: Gemma names it hidden_activation, the others hidden_act."""
    return d.get("hidden_activation") or d.get("hidden_act") or "silu"


def _long_rope(rope: Mapping[str, Any], d: Mapping[str, Any]) -> LongRopeScaling:
    """Phi-3's LongRoPE, with transformers' defaults: factor max_position_embeddings /
    original_max_position_embeddings, attention_factor sqrt(1 + ln(factor) / ln(original))
    (1 for a factor <= 1)."""
    original = int(rope.get("original_max_position_embeddings")
                   or d["original_max_position_embeddings"])
    factor = rope.get("factor") or d.get("max_position_embeddings", original) / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return LongRopeScaling(tuple(map(float, rope["short_factor"])),
                           tuple(map(float, rope["long_factor"])), original,
                           float(attention_factor))


def _layer_types(d: Mapping[str, Any]) -> tuple[str, ...] | None:
    """Each layer's attention kind. Gemma 2 checkpoints of transformers 4 carry no
    layer_types: their layers alternate, sliding first."""
    if d.get("layer_types") is not None:
        return tuple(d["layer_types"])
    layers = range(d["num_hidden_layers"])
    if d["model_type"] == "gemma2":
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in layers)
    if d["model_type"] == "gemma3_text":  # five sliding layers, then a global one
        pattern = d.get("sliding_window_pattern", 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in layers)
    return None


def _rope_parameters(d: Mapping[str, Any]) -> tuple[Mapping[str, Any], float | None]:
    """(the global layers' RoPE settings, the sliding layers' own base or None).

    Gemma 3 has a RoPE per layer type: transformers 5 nests rope_parameters by layer type,
    transformers 4 gives rope_local_base_freq beside rope_theta and rope_scaling."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if d["model_type"] != "gemma3_text":
        return rope, None
    if "full_attention" in rope:
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {local['rope_type']!r} of sliding layers is not "
                             "supported; expected 'default'")
        return rope["full_attention"], float(local.get("rope_theta", 10000.0))
    return rope, float(d.get("rope_local_base_freq", 10000.0))


def _rope_scaling(rope: Mapping[str, Any], d: Mapping[str, Any]
                  ) -> Llama3RopeScaling | LinearRopeScaling | LongRopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return LinearRopeScaling(float(rope["factor"]))
    if rope_type == "longrope":
        return _long_rope(rope, d)
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; expected 'default', 'linear', "
            "'llama3' or 'longrope'"
        )
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
