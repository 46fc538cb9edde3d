"""ModelRunner: the jit-compiled device step and the KV cache it owns.

One step is `step(params, kv_caches, input_ids, metadata) -> (last hidden, hidden,
kv_caches)` with the cache donated, so XLA writes new K/V in place. Every array
the step takes is padded to buckets by the batch builder; the runner adds
nothing but a switch between decode-only steps (one token per sequence: the
paged decode kernel) and mixed steps (the ragged kernel). The logits of the
rows in use are a separate small jitted function of each sequence's last hidden
state, so a mixed step's shape depends on its token count alone (the batch
builder pads its sequence rows to one size) while the vocabulary-wide matmul
still runs on the rows in use only. The step's final hidden states stay on the
device; `token_logprobs` reads them when a request asks for prompt
log-probabilities. Given a mesh, the runner runs a model laid out by
`jpaged.model.sharding.shard_model` on it: the cache split by KV head, attention
and `write_kv` under `shard_map`, every other array placed by XLA from the
parameters' shardings; the host side (block tables, slot mappings) is one and
the same for every device. Block copies for copy-on-write and swaps to and from a host
pool, and token sampling, run as small separate jitted functions, so they never
multiply the step's shapes.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import kernels_pallas
from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.batch_builder import bucket
from jpaged.memory.allocator import BlockOps
from jpaged.model.llama import LlamaConfig, LlamaForCausalLM, init_kv_caches, split_layer_kernels
from jpaged.model.sampler import SamplerOutput, SamplingTensors, logprob_outputs, sample
from jpaged.model.sharding import kv_cache_sharding, shard_attention, shard_write_kv

AttentionBackend = Literal["pallas", "xla", "reference"]
# (k_cache, v_cache), each [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
KVCaches = tuple[jax.Array, jax.Array]


def default_attention_backend() -> AttentionBackend:
    """Pallas kernels on accelerators; on CPU, where Pallas only interprets (slowly),
    the same tiled algorithm as an XLA loop."""
    return "xla" if jax.default_backend() == "cpu" else "pallas"


def _decode_as_ragged(decode_fn):
    """Adapt a decode op ([B, Hq, D] queries) to the ragged signature.

    In a decode-only step token i belongs to sequence i, so the first B query
    rows are the decode queries; rows past B (token padding) get zeros.
    """

    def attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, layer,
                  scale):
        num_tokens, num_seqs = q.shape[0], context_lens.shape[0]
        rows = jnp.zeros((num_seqs, *q.shape[1:]), q.dtype).at[: min(num_tokens, num_seqs)].set(
            q[:num_seqs]
        )
        out = decode_fn(rows, k_cache, v_cache, block_tables, context_lens, layer=layer,
                        scale=scale)
        return jnp.zeros_like(q).at[: min(num_tokens, num_seqs)].set(out[:num_tokens])

    return attention


def attention_functions(backend: AttentionBackend, interpret: bool = False,
                        mesh: Mesh | None = None):
    """(ragged attention, decode attention) of a backend, both with the ragged signature.

    "pallas" takes the kernel of the default device (Triton under interpret=True
    on CPU), "xla" the tiled XLA loop, "reference" the pure-JAX definition.
    With a mesh, each runs under `shard_map` on every device's own heads.
    """
    implementations = {"pallas": None, "xla": "xla", "reference": "reference"}
    if backend not in implementations:
        raise ValueError(
            f"attention_backend must be one of {sorted(implementations)}, got {backend!r}"
        )
    knobs = dict(implementation=implementations[backend], interpret=interpret)
    ragged = functools.partial(kernels_pallas.ragged_paged_attention, **knobs)
    decode = _decode_as_ragged(functools.partial(kernels_pallas.paged_decode_attention, **knobs))
    if mesh is None:
        return ragged, decode
    return shard_attention(ragged, mesh), shard_attention(decode, mesh)


def _step(graphdef, params_def, param_leaves, input_ids, kv_caches, metadata, *, attention_fn,
          write_kv_fn):
    """One model step as a pure function: (each sequence's last hidden state [B, hidden],
    hidden [T, hidden], kv_caches)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, param_leaves))
    hidden, kv_caches = model.hidden_states(
        input_ids, kv_caches, metadata, attention_fn, write_kv_fn
    )
    return hidden[metadata.logits_indices], hidden, kv_caches


def _logits(graphdef, params_def, param_leaves, last_hidden, *, num_rows):
    """last_hidden [B, hidden] -> logits f32 [num_rows, vocab] of its first num_rows rows."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, param_leaves))
    return model.compute_logits(last_hidden[:num_rows])


@jax.jit
def _gather_rows(logits, rows):
    return logits[rows]


# Rows of logits materialised at once by `_token_logprobs`: bounds its memory to
# this many vocabulary-sized rows, and it compiles for this one shape whatever
# the step's token count.
_LOGPROB_ROWS = 16


@functools.partial(jax.jit, static_argnums=0, static_argnames=("num_top",))
def _token_logprobs(graphdef, params, hidden, targets, *, num_top):
    """hidden [_LOGPROB_ROWS, hidden], targets int32 [_LOGPROB_ROWS] -> logprob_outputs."""
    model = nnx.merge(graphdef, params)
    return logprob_outputs(model.compute_logits(hidden), targets, num_top)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(kv_caches: KVCaches, copies: jax.Array) -> KVCaches:
    """Copy whole blocks src -> dst in every layer.

    copies: int32 [K, 2] (src, dst); padding rows are (0, 0).
    """
    src, dst = copies[:, 0], copies[:, 1]
    return tuple(cache.at[:, :, dst].set(cache[:, :, src]) for cache in kv_caches)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_blocks(kv_caches: KVCaches, pages: KVCaches, block_ids: jax.Array) -> KVCaches:
    """Write host pages into device blocks. pages: (k, v), each [L, Hkv, K, bs, D]."""
    return tuple(
        cache.at[:, :, block_ids].set(new) for cache, new in zip(kv_caches, pages, strict=True)
    )


@jax.jit
def _read_blocks(cache: jax.Array, block_ids: jax.Array) -> jax.Array:
    """cache [L, Hkv, N, bs, D], block_ids int32 [K] -> the blocks [L, Hkv, K, bs, D]."""
    return cache[:, :, block_ids]


class ModelRunner:
    """Owns the parameters, the paged KV cache, the host swap pool and the compiled step.

    mesh: run tensor-parallel on this one-axis ("model") mesh; `model` and `config`
    must then be laid out for it (`jpaged.model.sharding.shard_model`).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: LlamaConfig,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        kv_dtype=jnp.float32,
        attention_backend: AttentionBackend | None = None,
        interpret: bool = False,
        mesh: Mesh | None = None,
    ):
        self.config = config
        self.mesh = mesh
        self.block_size = block_size
        self.attention_backend = attention_backend or default_attention_backend()
        # A sharded model keeps its stacked kernels: under lax.switch each of the
        # layers' branches would hold its own all-reduce.
        if jax.default_backend() == "cpu" and mesh is None:
            model = split_layer_kernels(model)
        self.graphdef, self.params = nnx.split(model)
        # The step takes the parameters as a flat list and the graph as a constant:
        # flattening NNX state and hashing a static graph cost milliseconds per call.
        self._param_leaves, params_def = jax.tree.flatten(self.params)
        self._new_kv_caches = functools.partial(init_kv_caches, config, num_blocks, block_size,
                                                kv_dtype)
        if mesh is not None:
            # Created in place on every device: no whole cache on one device first.
            cache_sharding = kv_cache_sharding(mesh)
            self._new_kv_caches = jax.jit(self._new_kv_caches,
                                          out_shardings=(cache_sharding, cache_sharding))
        self.kv_caches = self._new_kv_caches()
        host_shape = (config.num_layers, config.num_kv_heads, num_host_blocks, block_size,
                      config.head_dim)
        self.host_kv = (np.zeros(host_shape, kv_dtype), np.zeros(host_shape, kv_dtype))
        ragged, decode = attention_functions(self.attention_backend, interpret, mesh)
        write_kv_fn = kernels_pallas.write_kv
        if mesh is not None:
            write_kv_fn = shard_write_kv(write_kv_fn, mesh)

        def step(attention_fn):
            fn = functools.partial(_step, self.graphdef, params_def, attention_fn=attention_fn,
                                   write_kv_fn=write_kv_fn)
            return jax.jit(fn, donate_argnums=2)

        self._mixed_step = step(ragged)
        self._decode_step = step(decode)
        self._logits = jax.jit(functools.partial(_logits, self.graphdef, params_def),
                               static_argnames=("num_rows",))

    def kv_cache_lost(self) -> bool:
        """Whether a donating call consumed the KV cache without giving it back (it raised)."""
        return any(array.is_deleted() for array in jax.tree.leaves(self.kv_caches))

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed KV cache of the same shape (the host pool is kept)."""
        for array in jax.tree.leaves(self.kv_caches):
            if not array.is_deleted():
                array.delete()
        self.kv_caches = self._new_kv_caches()

    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap out, swap in, then copy-on-write copies, in that order, before the step."""
        if len(ops.swap_out):
            self._swap_out(ops.swap_out)
        if len(ops.swap_in):
            self._swap_in(ops.swap_in)
        if len(ops.copies):
            self.kv_caches = _copy_blocks(self.kv_caches, self._pad_pairs(ops.copies))

    def execute(
        self, input_ids: np.ndarray, metadata: AttentionMetadata, *, decode_only: bool,
        num_rows: int,
    ) -> tuple[jax.Array, jax.Array]:
        """Run one step. input_ids int32 [T] -> (logits f32 [num_rows, vocab] at the last
        new token of the first num_rows sequence rows, final hidden states [T, hidden]),
        both still on the device."""
        step = self._decode_step if decode_only else self._mixed_step
        last_hidden, hidden, self.kv_caches = step(
            self._param_leaves, input_ids, self.kv_caches, metadata
        )
        return self.logits(last_hidden, num_rows), hidden

    def logits(self, last_hidden: jax.Array, num_rows: int) -> jax.Array:
        """Final-normed hidden states [B, hidden] -> logits f32 [num_rows, vocab] of the
        first num_rows rows (num_rows <= B)."""
        return self._logits(self._param_leaves, last_hidden, num_rows=num_rows)

    def sample(
        self, logits: jax.Array, rows: np.ndarray, tensors: SamplingTensors, num_top: int
    ) -> SamplerOutput:
        """Draw one token per entry of `rows` (int32 [S], rows of logits [B, vocab] to
        draw from; a row may repeat: parallel samples of one prompt) -> numpy outputs."""
        # One transfer for all outputs, not one wait per array.
        return jax.device_get(sample(self.gather_rows(logits, rows), tensors, num_top))

    def gather_rows(self, logits: jax.Array, rows: np.ndarray) -> jax.Array:
        """logits [B, vocab], rows int32 [S] -> [S, vocab]: its own small compiled
        function, so the sampler compiles per S alone, not per (B, S)."""
        return _gather_rows(logits, rows)

    def token_logprobs(
        self, hidden: jax.Array, targets: np.ndarray, num_top: int
    ) -> tuple[np.ndarray, ...]:
        """Log-probabilities of `targets` (int32 [T]) under the logits of each token's
        hidden state [T, hidden], with ranks and the top `num_top`:
        (f32 [T], int32 [T], int32 [T, num_top], f32 [T, num_top])."""
        num_tokens = len(targets)
        padded = -(-num_tokens // _LOGPROB_ROWS) * _LOGPROB_ROWS
        # Chunks cut on the host: slicing the device array would compile per offset.
        rows = np.zeros((padded, hidden.shape[-1]), hidden.dtype)
        rows[:num_tokens] = np.asarray(hidden)
        padded_targets = np.zeros(padded, np.int32)
        padded_targets[:num_tokens] = targets
        chunks = [
            _token_logprobs(self.graphdef, self.params, rows[i : i + _LOGPROB_ROWS],
                            padded_targets[i : i + _LOGPROB_ROWS], num_top=num_top)
            for i in range(0, padded, _LOGPROB_ROWS)
        ]
        return tuple(jax.tree.map(lambda *parts: np.concatenate(parts)[:num_tokens], *chunks))

    def run_padding_step(
        self, num_tokens: int, num_seqs: int, num_blocks: int, decode_only: bool
    ) -> None:
        """Run (and so compile) a step of the given padded shape that only writes the null block."""
        input_ids, metadata = self._padding_inputs(num_tokens, num_seqs, num_blocks)
        logits, _ = self.execute(input_ids, metadata, decode_only=decode_only, num_rows=num_seqs)
        logits.block_until_ready()

    def compile_step(
        self, num_tokens: int, num_seqs: int, num_blocks: int, decode_only: bool
    ) -> jax.stages.Compiled:
        """The compiled model step of the given padded shape (for its `memory_analysis()`;
        `LLMEngine.warmup` compiles shapes with it in threads, filling jit's cache)."""
        step = self._decode_step if decode_only else self._mixed_step
        input_ids, metadata = self._padding_inputs(num_tokens, num_seqs, num_blocks)
        return step.lower(self._param_leaves, input_ids, self.kv_caches, metadata).compile()

    def _padding_inputs(
        self, num_tokens: int, num_seqs: int, num_blocks: int
    ) -> tuple[np.ndarray, AttentionMetadata]:
        """(input_ids, metadata) of a step of empty sequences whose tokens write the null block."""
        metadata = AttentionMetadata(
            slot_mapping=np.arange(num_tokens, dtype=np.int32) % self.block_size,
            positions=np.zeros(num_tokens, np.int32),
            block_tables=np.zeros((num_seqs, num_blocks), np.int32),
            context_lens=np.zeros(num_seqs, np.int32),
            query_start_loc=np.zeros(num_seqs + 1, np.int32),
            logits_indices=np.zeros(num_seqs, np.int32),
        )
        return np.zeros(num_tokens, np.int32), metadata

    @staticmethod
    def _pad_pairs(pairs: np.ndarray) -> np.ndarray:
        """Pad [K, 2] block pairs to a power of two with (0, 0): null block onto itself."""
        padded = np.zeros((bucket(len(pairs), 1), 2), np.int32)
        padded[: len(pairs)] = pairs
        return padded

    def _swap_out(self, pairs: np.ndarray) -> None:
        """Device blocks -> host blocks. pairs: int32 [K, 2] (device, host)."""
        device_ids = self._pad_pairs(pairs)[:, 0]
        for cache, host in zip(self.kv_caches, self.host_kv, strict=True):
            host[:, :, pairs[:, 1]] = np.asarray(_read_blocks(cache, device_ids))[:, :, :len(pairs)]

    def _swap_in(self, pairs: np.ndarray) -> None:
        """Host blocks -> device blocks. pairs: int32 [K, 2] (host, device)."""
        padded = self._pad_pairs(pairs)
        host_ids, device_ids = padded[:, 0], padded[:, 1]
        pages = tuple(host[:, :, host_ids] for host in self.host_kv)
        self.kv_caches = _write_blocks(self.kv_caches, pages, device_ids)
