"""A Llama-family decoder in Flax NNX that reads and writes a paged KV cache.

One module covers Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral (a sliding
window), Qwen2/2.5 (q/k/v biases), Qwen3 (RMSNorm of each query and key head),
Gemma 2 and 3 (GeGLU, sandwich norms, soft-caps, local and global layers) and Phi-3
(partial rotary, LongRoPE): RMSNorm, rotate-half RoPE, grouped-query attention with
a window per layer, gated MLP, tied or untied embeddings (LlamaConfig says which).
A step (`hidden_states`) takes a flat run of new tokens from several sequences
(prefill chunks and decodes mixed), writes their K/V into the paged cache at
`metadata.slot_mapping` and attends through the block tables; `compute_logits`
then gives the logits of the rows the sampler draws from.

Arithmetic runs in the parameters' dtype (f32 by default, bf16 optional); norm
statistics, RoPE and softmax run in f32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jpaged._deprecation import moved_names
from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.model.config import AdapterSlots, LlamaConfig
from jpaged.model.rope import apply_rope, layer_ropes, rope_tables
from kernels_pallas import quantization
from kernels_pallas.online_softmax import NO_WINDOW
from kernels_pallas.reference import ragged_paged_attention_reference, write_kv_reference

# (k_cache, v_cache), each [layers_per_block, num_kv_heads, num_blocks, block_size,
# head_dim]: one array per kind (or EncodedPages: stored values, scales if quantized),
# indexed by a layer's buffer inside the step (its layer index, or its slot in its KV
# cache group).
KVCache = tuple[quantization.Pages, quantization.Pages]
AttentionFn = Callable[..., jax.Array]
WriteKVFn = Callable[..., KVCache]
# The MLP's activations (LlamaConfig.hidden_act).
ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
__getattr__ = moved_names(__name__, {"init_kv_caches": "jpaged.model.llama:init_kv_cache"})

class RMSNorm(nnx.Module):
    """unit_offset: Gemma's norm, which scales by 1 + weight, in f32 before the cast
    back; else Llama's, weight times the normed input cast back."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, unit_offset: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if unit_offset
                                else jnp.ones((dim,), dtype))
        self.eps, self.unit_offset = eps, unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., dim] -> [..., dim] in x.dtype; the mean square is taken in f32."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


def norm(config: LlamaConfig, dim: int, dtype: jnp.dtype) -> RMSNorm:
    """The model's RMSNorm over `dim`."""
    return RMSNorm(dim, config.rms_norm_eps, dtype, config.norm_unit_offset)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), Gemma's soft cap; x itself without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


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


def dot(x: jax.Array, w: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in dtype (default x.dtype), accumulated in
    float32.

    Asking for the float32 result is what sends bfloat16 products to a CPU's
    bfloat16 dot-product instructions (AVX512-BF16): XLA's bfloat16-out product there
    runs below the float32 rate, the float32-out one above it once a step has tens of
    rows (`python -m benchmarks.matmul`). For float32 inputs it is the plain product."""
    product = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return product.astype(dtype or x.dtype)


def matmul(x: jax.Array, kernel: jax.Array | PerLayerKernels) -> jax.Array:
    """x [..., in] @ kernel [in, out] -> [..., out]; a PerLayerKernels multiplies by its
    bound layer's kernel."""
    if isinstance(kernel, PerLayerKernels):
        branches = [lambda x, w=w: dot(x, w) for w in kernel.kernels]
        return jax.lax.switch(kernel.layer, branches, x)
    return dot(x, kernel)


class LoRAWeight(nnx.Variable):
    """The LoRA factors of one projection in every adapter slot: A [slots, in, rank] or
    B [slots, rank, out] (a leading [num_layers] axis when stacked), B already scaled by
    its adapter's alpha / r. Not a Param: adapters are loaded into them while serving."""


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, adapter_slots: jax.Array) -> jax.Array:
    """The low-rank terms of a step whose tokens belong to different adapters.

    x [T, in], a [S, in, R], b [S, R, out], adapter_slots int32 [T] (slot s in 1..S uses
    row s - 1; 0, the base model, none) -> [T, out] in x.dtype, accumulated in float32.

    A masked batched product: every token goes down through every slot's A, the ranks
    of the slots it does not use are zeroed, and one product with all the B's sums what
    is left. Its cost grows with S (max_loras, a few), and it needs no sort and no
    gather of per-token weights (`python -m benchmarks.lora --products` measures it
    against lax.ragged_dot and a per-token gather).
    """
    down = jnp.einsum("ti,sir->tsr", x, a, preferred_element_type=jnp.float32)
    mine = adapter_slots[:, None] == jnp.arange(1, a.shape[0] + 1, dtype=adapter_slots.dtype)
    down = jnp.where(mine[:, :, None], down, 0.0).astype(x.dtype)
    up = jnp.einsum("tsr,sro->to", down, b, preferred_element_type=jnp.float32)
    return up.astype(x.dtype)


def lora_terms(x: jax.Array, a: jax.Array, b: jax.Array, adapter_slots: jax.Array) -> jax.Array:
    """`lora_delta`, skipped (zeros) in a step none of whose tokens has an adapter: the base
    model's steps on an engine with slots cost what they cost without them."""
    def none(x, a, b, adapter_slots):
        return jnp.zeros((x.shape[0], b.shape[-1]), x.dtype)

    return lax.cond(jnp.any(adapter_slots > 0), lora_delta, none, x, a, b, adapter_slots)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out] (transposed from Hugging Face's [out, in]);
    with adapter slots, + each token's adapter's x @ A @ B (`lora_terms`). pieces: the
    projections fused in it (q, k, v: 3), each with its own rank of the slots' factors."""

    def __init__(self, in_features: int, out_features: int, dtype: jnp.dtype, rngs: nnx.Rngs,
                 use_bias: bool = False, adapters: AdapterSlots | None = None,
                 pieces: int = 1):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        slots = adapters and adapters.num_slots
        rank = adapters and pieces * adapters.max_rank
        self.lora_a = LoRAWeight(jnp.zeros((slots, in_features, rank), dtype)) if adapters \
            else None
        self.lora_b = LoRAWeight(jnp.zeros((slots, rank, out_features), dtype)) if adapters \
            else None

    def __call__(self, x: jax.Array, adapter_slots: jax.Array | None = None) -> jax.Array:
        """x [..., in] -> [..., out] in x.dtype; adapter_slots int32 [T] with x [T, in]."""
        y = matmul(x, self.kernel.get_value())
        if self.lora_a is not None and adapter_slots is not None:
            y = y + lora_terms(x, self.lora_a[...], self.lora_b[...], adapter_slots)
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
        adapters = config.adapter_slots
        self.qkv_proj = Linear(hidden, qkv_width, dtype, rngs, bias, adapters, pieces=3)
        self.o_proj = Linear(config.num_heads * head_dim, hidden, dtype, rngs,
                             adapters=adapters)
        self.q_norm = norm(config, head_dim, dtype) if config.qk_norm else None
        self.k_norm = norm(config, head_dim, dtype) if config.qk_norm else None
        self.scale, self.soft_cap = config.attention_scale, config.attn_logit_softcapping

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv_cache: KVCache,
        layer: jax.Array,
        window: jax.Array,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn,
        write_kv_fn: WriteKVFn,
    ) -> tuple[jax.Array, KVCache]:
        """x [T, hidden], rope (cos, sin) f32 [T, R/2] (R = rotary_dim), kv_cache
        2 x [P, Hkv, N, bs, D] (P buffers per block), layer int32 scalar (this layer's
        buffer in the cache), window int32 scalar (its sliding window, kernels_pallas'
        NO_WINDOW for none), metadata with its KV cache group's slot_mapping [T] and
        block_tables [B, M] -> ([T, hidden], updated kv_cache)."""
        num_tokens, groups = x.shape[0], self.shard_groups
        q_heads, kv_heads = self.num_heads // groups, self.num_kv_heads // groups
        # [T, groups, heads of a group, D]: split within each group (see LlamaConfig).
        slots = metadata.adapter_slots
        qkv = self.qkv_proj(x, slots).reshape(num_tokens, groups, q_heads + 2 * kv_heads,
                                              self.head_dim)
        q, k, v = jnp.split(qkv, [q_heads, q_heads + kv_heads], axis=2)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        rotated = quantization.is_rotated(kv_cache[0].dtype)
        if rotated:
            q, k, v = (rotate(x, self.head_dim) for x in (q, k, v))
        k_cache, v_cache = write_kv_fn(*kv_cache, k, v, metadata.slot_mapping, layer)
        # Attention runs in the wider of the model's and the cache's dtypes: a float32
        # cache keeps a bfloat16 model's attention in float32, and a float32 model
        # reads a bfloat16 cache into float32 tiles instead of rounding its queries.
        # Quantized pages take any float dtype.
        query_dtype = (q.dtype if quantization.is_quantized(k_cache.dtype)
                       else jnp.promote_types(q.dtype, k_cache.dtype))
        out = attention_fn(
            q.astype(query_dtype), k_cache, v_cache, metadata.block_tables,
            metadata.context_lens, metadata.query_start_loc, layer=layer,
            sliding_window=window, scale=self.scale, soft_cap=self.soft_cap,
        )
        if rotated:
            out = rotate(out, self.head_dim, back=True)
        return self.o_proj(out.reshape(num_tokens, -1).astype(x.dtype), slots), (k_cache, v_cache)


def rotate(x: jax.Array, head_dim: int, back: bool = False) -> jax.Array:
    """x [..., head_dim] times quantization.rotation(head_dim) (or its transpose, back),
    in f32 at full precision (a TPU's default would round to bfloat16), in x's dtype."""
    r = quantization.rotation(head_dim)
    product = jnp.matmul(x.astype(jnp.float32), r.T if back else r,
                         precision=lax.Precision.HIGHEST)
    return product.astype(x.dtype)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        # gate and up as one matmul, as q/k/v above.
        self.shard_groups = config.shard_groups
        adapters = config.adapter_slots
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype, rngs,
                                   adapters=adapters, pieces=2)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype, rngs,
                                adapters=adapters)
        self.activation = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: jax.Array, adapter_slots: jax.Array | None = None) -> jax.Array:
        """SwiGLU or GeGLU: x [T, hidden] -> [T, hidden]; adapter_slots int32 [T] or None."""
        num_tokens = x.shape[0]
        # [T, groups, 2 * columns of a group]: split within each group (see LlamaConfig).
        gate_up = self.gate_up_proj(x, adapter_slots).reshape(num_tokens, self.shard_groups, -1)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return self.down_proj((self.activation(gate) * up).reshape(num_tokens, -1),
                              adapter_slots)


class DecoderLayer(nnx.Module):
    """Llama's pre-norm layer: x + attn(norm(x)), then + mlp(post_attention_layernorm(x)).
    With sandwich_norms (Gemma) post_attention_layernorm normalizes the attention's
    output instead, and pre_ and post_feedforward_layernorm wrap the MLP."""

    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden = config.hidden_size
        self.input_layernorm = norm(config, hidden, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = norm(config, hidden, dtype)
        self.mlp = MLP(config, dtype, rngs)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(config, hidden, dtype)
            self.post_feedforward_layernorm = norm(config, hidden, dtype)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv_cache: KVCache,
        layer: jax.Array,
        window: jax.Array,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn,
        write_kv_fn: WriteKVFn,
    ) -> tuple[jax.Array, KVCache]:
        """x [T, hidden] -> ([T, hidden], updated kv_cache); see Attention for the rest."""
        attn_out, kv_cache = self.self_attn(
            self.input_layernorm(x), rope, kv_cache, layer, window, metadata, attention_fn,
            write_kv_fn,
        )
        if not self.sandwich:
            x = x + attn_out
            mlp_out = self.mlp(self.post_attention_layernorm(x), metadata.adapter_slots)
            return x + mlp_out, kv_cache
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x), metadata.adapter_slots)
        return x + self.post_feedforward_layernorm(mlp_out), kv_cache


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

    A step is `hidden_states` (every layer over the step's new tokens, writing their
    K/V into the paged cache and attending through the block tables) followed by
    `compute_logits` on the rows to sample from. The runner (jpaged.worker.model_runner)
    jits it as a pure function with the cache donated: it splits the module once
    and merges inside the traced function,

        graphdef, state = nnx.split(model)

        def step(state, input_ids, kv_cache, metadata):
            model = nnx.merge(graphdef, state)
            hidden, kv_cache = model.hidden_states(input_ids, kv_cache, metadata,
                                                   attention_fn, write_kv_fn)
            return model.compute_logits(hidden[metadata.logits_indices]), kv_cache

        logits, kv_cache = jax.jit(step, donate_argnums=2)(state, input_ids, kv_cache,
                                                           metadata)

    with `attention_fn` / `write_kv_fn` from kernels_pallas (the pure-JAX references
    by default).
    """

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = _stacked_layers(config, dtype, rngs)
        self.norm = norm(config, config.hidden_size, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, rngs)

    def hidden_states(
        self,
        input_ids: jax.Array,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        attention_fn: AttentionFn = ragged_paged_attention_reference,
        write_kv_fn: WriteKVFn = write_kv_reference,
        groups: KVCacheGroups | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """One step over a flat run of new tokens (T padded tokens, B padded sequences).

        input_ids: int32 [T]
        kv_cache: (k_cache, v_cache), each [layers_per_block, num_kv_heads, num_blocks,
                   block_size, head_dim]
        metadata:  AttentionMetadata of this step (positions, slot_mapping, ...).
        groups:    the KV cache groups the cache holds (None: one group of all layers);
                   layer i reads and writes buffer layer_slots[i] through the block
                   tables of group layer_groups[i].
        attention_fn(q [T, Hq, D], k_cache, v_cache, block_tables, context_lens,
                     query_start_loc, *, layer, sliding_window, scale, soft_cap)
                     -> [T, Hq, D]
        write_kv_fn(k_cache, v_cache, k [T, Hkv, D], v, slot_mapping, layer)
                     -> (k_cache, v_cache)
        returns    (final-normed hidden states [T, hidden_size], updated kv_cache).

        The layers run under `jax.lax.scan` with the whole cache in the carry: each
        layer writes and reads its own buffer through the kernels' `layer` argument, so
        a donated cache is updated in place, never sliced or copied.
        """
        groups = groups or KVCacheGroups.of(self.config.layer_windows, free_windows=False)
        cos, sin = rope_tables(self.config, metadata)  # [K, T, rotary_dim / 2]
        layer_graph, per_layer, stacked = nnx.split(self.layers, _holds_per_layer_kernels, ...)

        def run_layer(carry, layer_and_params):
            x, kv_cache = carry
            layer, group, slot, window, rope_id, params = layer_and_params
            bound = jax.tree.map(lambda k: k.at(layer), per_layer, is_leaf=_is_per_layer)
            decoder = nnx.merge(layer_graph, bound, params)
            group_metadata = metadata._replace(block_tables=metadata.block_tables[group],
                                               slot_mapping=metadata.slot_mapping[group])
            return decoder(x, (cos[rope_id], sin[rope_id]), kv_cache, slot, window,
                           group_metadata, attention_fn, write_kv_fn), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        group_ids = jnp.asarray(groups.layer_groups, jnp.int32)
        slots = jnp.asarray(groups.layer_slots, jnp.int32)
        windows = jnp.asarray([NO_WINDOW if w is None else w for w in self.config.layer_windows],
                              jnp.int32)
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
        (x, kv_cache), _ = jax.lax.scan(
            run_layer, (x, kv_cache),
            (layer_ids, group_ids, slots, windows, jnp.asarray(layer_ropes(self.config)),
             stacked))
        return self.norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden states [N, hidden_size] -> logits f32 [N, vocab]."""
        if self.config.tie_word_embeddings:
            head = self.embed_tokens.embedding[...].T
        else:
            head = self.lm_head.kernel[...]
        logits = dot(hidden, head, jnp.float32)
        return soft_cap(logits, self.config.final_logit_softcapping)


def init_kv_cache(
    config: LlamaConfig, num_blocks: int, block_size: int, dtype: jnp.dtype = jnp.float32,
    layers_per_block: int | None = None,
) -> KVCache:
    """A zeroed paged cache (k_cache, v_cache), each
    [layers_per_block, num_kv_heads, num_blocks, block_size, head_dim] in `dtype`
    (layers_per_block of the KV cache groups; None: every layer's); a quantized or
    2-byte float dtype gives EncodedPages (quantization.zeros)."""
    buffers = layers_per_block or config.num_layers
    shape = (buffers, config.num_kv_heads, num_blocks, block_size, config.head_dim)
    return quantization.zeros(shape, dtype), quantization.zeros(shape, dtype)
