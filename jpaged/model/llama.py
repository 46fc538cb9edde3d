"""A Llama-family decoder in Flax NNX that reads and writes a paged KV cache.

One module covers Llama 2/3 (llama3 RoPE scaling), SmolLM2 and Qwen2/2.5 (q/k/v
biases): RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU MLP, tied or
untied embeddings. A forward pass takes a flat run of new tokens from several
sequences (prefill chunks and decodes mixed), writes their K/V into the paged
cache at `metadata.slot_mapping`, attends through the block tables and returns
the logits of each sequence's last new token.

Arithmetic runs in the parameters' dtype (f32 by default, bf16 optional); norm
statistics, RoPE and softmax run in f32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.core.attention_metadata import AttentionMetadata
from kernels_pallas.reference import ragged_paged_attention_reference, write_kv_reference

# (k_cache, v_cache) of every layer, each [num_layers, num_kv_heads, num_blocks, block_size,
# head_dim]: one array per kind, indexed by layer inside the step.
KVCache = tuple[jax.Array, jax.Array]
AttentionFn = Callable[..., jax.Array]
WriteKVFn = Callable[..., KVCache]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (rope_type "llama3" in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder.

    shard_groups: the fused `qkv_proj` and `gate_up_proj` columns come in this many
    equal groups, group g holding [its q heads | its k heads | its v heads] and
    [its gate columns | its up columns] (heads and columns in order, group g the
    g-th slice of each). 1 is Hugging Face's order concatenated; tensor
    parallelism over N devices lays them out in N groups (jpaged.model.sharding),
    so that each device's contiguous slice of the columns is its own q, k, v.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    shard_groups: int = 1

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
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % self.shard_groups:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of "
                                 f"shard_groups ({self.shard_groups})")

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> LlamaConfig:
        """Read a Hugging Face config (a config.json dict or a transformers config).

        Accepts model_type "llama" (Llama 2/3, SmolLM2) and "qwen2" (Qwen2/2.5), with
        the RoPE settings in either transformers 4 (`rope_theta`, `rope_scaling`) or
        transformers 5 (`rope_parameters`) form.
        """
        d = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
        _check_supported(d)
        num_heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_rope_scaling(rope),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its configs carry no flag for them.
            attention_bias=d["model_type"] == "qwen2" or bool(d.get("attention_bias", False)),
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
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; expected 'silu'")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if model_type == "llama" and d.get("attention_bias"):
        # Llama's flag also adds an o_proj bias, which this model does not have.
        raise ValueError("attention_bias=True is not supported for model_type 'llama'")
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported")


def _rope_scaling(rope: Mapping[str, Any]) -> Llama3RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; expected 'default' or 'llama3'"
        )
    return Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 [head_dim // 2]: the angle per position of each rotated pair.

    With llama3 scaling, wavelengths longer than the original context divided by
    low_freq_factor are slowed down by `factor`, those shorter than it divided by
    high_freq_factor are kept, and the band between interpolates smoothly.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    inv_freq = 1.0 / np.float32(config.rope_theta) ** exponents
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor,
                      interpolated)
    scaled = np.where(wavelen < original / scaling.high_freq_factor, inv_freq, scaled)
    return scaled.astype(np.float32)


def rotary_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions int32 [T], inv_freq f32 [D/2] -> (cos, sin), each f32 [T, D/2]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE: x [T, H, D], cos/sin f32 [T, D/2] -> [T, H, D] in x.dtype.

    Pairs are (i, i + D/2), Hugging Face's layout (GGUF's interleaved layout is
    converted at load time).
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x.dtype; the mean square is taken in f32."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PerLayerKernels:
    """The [in, out] kernels of one projection in every layer, as separate arrays.

    A scanned layer that multiplies by `stacked[layer]` makes XLA on CPU copy that
    layer's weights out of the stack before each matmul, which doubles a decode
    step's memory traffic. `lax.switch` over separate arrays multiplies by the
    chosen array in place. `layer` is None at rest and the scan's layer index
    once bound with `at`.
    """

    kernels: tuple[jax.Array, ...]
    layer: jax.Array | None = None

    def at(self, layer: jax.Array) -> PerLayerKernels:
        return PerLayerKernels(self.kernels, layer)


def matmul(x: jax.Array, kernel: jax.Array | PerLayerKernels) -> jax.Array:
    """x [..., in] @ kernel [in, out] -> [..., out]; a PerLayerKernels multiplies by its
    bound layer's kernel."""
    if isinstance(kernel, PerLayerKernels):
        branches = [lambda x, w=w: x @ w for w in kernel.kernels]
        return jax.lax.switch(kernel.layer, branches, x)
    return x @ kernel


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out] (transposed from Hugging Face's [out, in])."""

    def __init__(self, in_features: int, out_features: int, dtype: jnp.dtype, rngs: nnx.Rngs,
                 use_bias: bool = False):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., out] in x.dtype."""
        y = matmul(x, self.kernel.get_value())
        return y if self.bias is None else y + self.bias[...]


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = head_dim
        self.shard_groups = config.shard_groups
        # q, k and v as one matmul: one pass over x and fewer, larger weight reads.
        qkv_width = (config.num_heads + 2 * config.num_kv_heads) * head_dim
        self.qkv_proj = Linear(hidden, qkv_width, dtype, rngs, bias)
        self.o_proj = Linear(config.num_heads * head_dim, hidden, dtype, rngs)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv_cache: KVCache,
        layer: jax.Array,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn,
        write_kv_fn: WriteKVFn,
    ) -> tuple[jax.Array, KVCache]:
        """x [T, hidden], rope (cos, sin) f32 [T, D/2], kv_cache 2 x [L, Hkv, N, bs, D],
        layer int32 scalar (this layer's index into the cache)
        -> ([T, hidden], updated kv_cache)."""
        num_tokens, groups = x.shape[0], self.shard_groups
        q_heads, kv_heads = self.num_heads // groups, self.num_kv_heads // groups
        # [T, groups, heads of a group, D]: split within each group (see LlamaConfig).
        qkv = self.qkv_proj(x).reshape(num_tokens, groups, q_heads + 2 * kv_heads, self.head_dim)
        q, k, v = jnp.split(qkv, [q_heads, q_heads + kv_heads], axis=2)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_cache, v_cache = write_kv_fn(*kv_cache, k, v, metadata.slot_mapping, layer)
        out = attention_fn(
            q, k_cache, v_cache, metadata.block_tables, metadata.context_lens,
            metadata.query_start_loc, layer=layer, scale=self.head_dim**-0.5,
        )
        return self.o_proj(out.reshape(num_tokens, -1)), (k_cache, v_cache)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        # gate and up as one matmul, as q/k/v above.
        self.shard_groups = config.shard_groups
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype, rngs)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """SwiGLU: x [T, hidden] -> [T, hidden]."""
        num_tokens = x.shape[0]
        # [T, groups, 2 * columns of a group]: split within each group (see LlamaConfig).
        gate_up = self.gate_up_proj(x).reshape(num_tokens, self.shard_groups, -1)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return self.down_proj((jax.nn.silu(gate) * up).reshape(num_tokens, -1))


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv_cache: KVCache,
        layer: jax.Array,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn,
        write_kv_fn: WriteKVFn,
    ) -> tuple[jax.Array, KVCache]:
        """x [T, hidden] -> ([T, hidden], updated kv_cache); see Attention for the rest."""
        attn_out, kv_cache = self.self_attn(
            self.input_layernorm(x), rope, kv_cache, layer, metadata, attention_fn, write_kv_fn
        )
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


def _stacked_layers(config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose every parameter has a leading [num_layers] axis."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, dtype, layer_rngs)

    return make(rngs)


def _is_per_layer(value: Any) -> bool:
    return isinstance(value, PerLayerKernels)


def _holds_per_layer_kernels(path: tuple, variable: nnx.Variable) -> bool:
    return _is_per_layer(variable.get_value())


def split_layer_kernels(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` with every stacked layer kernel [num_layers, in, out] as PerLayerKernels:
    the layout for CPU steps (see PerLayerKernels). `model` itself is left as it is."""
    graphdef, state = nnx.split(model)

    def split(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        value = variable.get_value()
        if path[0] != "layers" or path[-1] != "kernel" or _is_per_layer(value):
            return variable
        # Sliced on the host: slicing on the device would compile one op per shape.
        host = np.asarray(value)
        return variable.replace(PerLayerKernels(tuple(jnp.asarray(w) for w in host)))

    return nnx.merge(graphdef, nnx.map_state(split, state))


class LlamaForCausalLM(nnx.Module):
    """Llama-family causal LM over a paged KV cache.

    Parameter names follow Hugging Face's (`embed_tokens`, `layers.self_attn.o_proj`,
    ...), except that q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj`
    (their Hugging Face tensors concatenated on the output axis); Linear kernels are
    stored [in, out], transposed from Hugging Face's. `layers` is one DecoderLayer
    whose parameters are stacked over the layers ([num_layers, ...]): the step runs
    them with `jax.lax.scan`, so it compiles one layer, not num_layers copies.
    `split_layer_kernels` turns the stacked matmul kernels into separate per-layer
    arrays (PerLayerKernels), which the same scan multiplies by without copying:
    the layout the runner takes on CPU.

    To jit a step as a pure function with the cache donated, split the module once
    and merge inside the traced function (this is what `forward` does):

        graphdef, state = nnx.split(model)
        step = jax.jit(forward, static_argnums=0, donate_argnums=3)
        logits, kv_caches = step(graphdef, state, input_ids, kv_caches, metadata)

    Pass `attention_fn` / `write_kv_fn` through `functools.partial(forward, ...)`
    before jitting to pick another attention backend.
    """

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = _stacked_layers(config, dtype, rngs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, rngs)

    def __call__(
        self,
        input_ids: jax.Array,
        kv_caches: KVCache,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn = ragged_paged_attention_reference,
        write_kv_fn: WriteKVFn = write_kv_reference,
    ) -> tuple[jax.Array, KVCache]:
        """One step: (logits f32 [B, vocab] at metadata.logits_indices, updated kv_caches).

        Arguments as in `hidden_states`.
        """
        hidden, new_caches = self.hidden_states(
            input_ids, kv_caches, metadata, attention_fn, write_kv_fn
        )
        return self.compute_logits(hidden[metadata.logits_indices]), new_caches

    def hidden_states(
        self,
        input_ids: jax.Array,
        kv_caches: KVCache,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn = ragged_paged_attention_reference,
        write_kv_fn: WriteKVFn = write_kv_reference,
    ) -> tuple[jax.Array, KVCache]:
        """One step over a flat run of new tokens (T padded tokens, B padded sequences).

        input_ids: int32 [T]
        kv_caches: (k_cache, v_cache), each [num_layers, num_kv_heads, num_blocks,
                   block_size, head_dim]
        metadata:  AttentionMetadata of this step (positions, slot_mapping, ...).
        attention_fn(q [T, Hq, D], k_cache, v_cache, block_tables, context_lens,
                     query_start_loc, *, layer, scale) -> [T, Hq, D]
        write_kv_fn(k_cache, v_cache, k [T, Hkv, D], v, slot_mapping, layer)
                     -> (k_cache, v_cache)
        returns    (final-normed hidden states [T, hidden_size], updated kv_caches).

        The layers run under `jax.lax.scan` with the whole cache in the carry: each
        layer writes and reads its own [layer] slice through the kernels' `layer`
        argument, so a donated cache is updated in place, never sliced or copied.
        """
        rope = rotary_tables(metadata.positions, rope_inverse_frequencies(self.config))
        layer_graph, per_layer, stacked = nnx.split(self.layers, _holds_per_layer_kernels, ...)

        def run_layer(carry, layer_and_params):
            x, kv_caches = carry
            layer, params = layer_and_params
            bound = jax.tree.map(lambda k: k.at(layer), per_layer, is_leaf=_is_per_layer)
            decoder = nnx.merge(layer_graph, bound, params)
            return decoder(x, rope, kv_caches, layer, metadata, attention_fn, write_kv_fn), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (x, kv_caches), _ = jax.lax.scan(
            run_layer, (self.embed_tokens(input_ids), kv_caches), (layer_ids, stacked)
        )
        return self.norm(x), kv_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden states [N, hidden_size] -> logits f32 [N, vocab]."""
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)


def forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    input_ids: jax.Array,
    kv_caches: KVCache,
    metadata: AttentionMetadata,
    attention_fn: AttentionFn = ragged_paged_attention_reference,
    write_kv_fn: WriteKVFn = write_kv_reference,
) -> tuple[jax.Array, KVCache]:
    """`LlamaForCausalLM.__call__` as a pure function of (graphdef, state, ...), for jax.jit.

    Shapes as in `LlamaForCausalLM.__call__`; graphdef is static, kv_caches may be donated.
    """
    model = nnx.merge(graphdef, state)
    return model(input_ids, kv_caches, metadata, attention_fn, write_kv_fn)


def init_kv_caches(
    config: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype = jnp.float32
) -> KVCache:
    """A zeroed paged cache (k_cache, v_cache), each
    [num_layers, num_kv_heads, num_blocks, block_size, head_dim] in `dtype`."""
    shape = (config.num_layers, config.num_kv_heads, num_blocks, block_size, config.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
