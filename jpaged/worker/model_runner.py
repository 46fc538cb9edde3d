"""ModelRunner: the jit-compiled device step and the KV cache it owns.

One step is `step(params, kv_cache, input_ids, metadata) -> (last hidden, hidden,
kv_cache)` with the cache donated, so XLA writes new K/V in place. Every array
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
the same for every device. Block operations (copies for copy-on-write, swaps to and
from the host pool, stores to and loads from the prefix cache's host tier in the same
pool: the phases of `BLOCK_OP_PHASES`) and token sampling run as small separate jitted
functions, so they never multiply the step's shapes.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels_pallas
from jpaged._deprecation import moved_names
from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.step_shapes import (
    LOGPROB_ROWS,
    op_pairs,
)
from jpaged.memory.allocator import BlockOps, BlockPool
from jpaged.memory.block_ids import BlockIdOutOfRange, check_block_ids, check_slots
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.model.llama import (
    KVCache,
    LlamaConfig,
    LlamaForCausalLM,
    init_kv_cache,
    split_layer_kernels,
)
from jpaged.model.lora import compile_slot_write, slot_paths, write_slot
from jpaged.model.sampler import SamplerOutput, SamplingTensors, logprob_outputs, sample
from jpaged.model.sharding import (
    kv_cache_sharding,
    place_array,
    shard_attention,
    shard_write_kv,
)
from jpaged.model.verification import verify
from jpaged.worker.decode_loop import LoopInput, LoopOutput, decode_loop
from jpaged.worker.host_kv import HostKV

logger = logging.getLogger("jpaged")
# The names the attention backends have: the kernels' (kernels_pallas.IMPLEMENTATIONS).
AttentionBackend = kernels_pallas.Implementation

__getattr__ = moved_names(__name__, {
    "KVCaches": "jpaged.model.llama:KVCache",
    "default_attention_backend": "jpaged.worker.model_runner:device_attention_backend",
})


def device_attention_backend() -> AttentionBackend:
    """The device's own kernel: Mosaic on a TPU, Mosaic GPU on a Hopper GPU, Triton on
    other GPUs; on CPU, where Pallas only interprets (slowly), the same tiled algorithm
    as an XLA loop."""
    return kernels_pallas.default_implementation(interpret=False)


def _decode_as_ragged(decode_fn):
    """Adapt a decode op ([B, Hq, D] queries) to the ragged signature.

    In a decode-only step token i belongs to sequence i, so the first B query
    rows are the decode queries; rows past B (token padding) get zeros.
    """

    def attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, layer,
                  scale, sliding_window=None, soft_cap=None):
        num_tokens, num_seqs = q.shape[0], context_lens.shape[0]
        rows = jnp.zeros((num_seqs, *q.shape[1:]), q.dtype).at[: min(num_tokens, num_seqs)].set(
            q[:num_seqs]
        )
        out = decode_fn(rows, k_cache, v_cache, block_tables, context_lens, layer=layer,
                        sliding_window=sliding_window, scale=scale, soft_cap=soft_cap)
        return jnp.zeros_like(q).at[: min(num_tokens, num_seqs)].set(out[:num_tokens])

    return attention


def attention_functions(backend: AttentionBackend, interpret: bool = False,
                        mesh: Mesh | None = None):
    """(ragged attention, decode attention) of a backend, both with the ragged signature.

    backend: one of kernels_pallas.IMPLEMENTATIONS: "tpu" or "triton" (a Pallas
    kernel, interpreted with interpret=True), "xla" the tiled XLA loop,
    "reference" the pure-JAX definition. With a mesh, each runs under
    `shard_map` on every device's own heads.
    """
    if backend not in kernels_pallas.IMPLEMENTATIONS:
        raise ValueError(f"attention_backend must be one of {kernels_pallas.IMPLEMENTATIONS}, "
                         f"got {backend!r}")
    knobs = dict(implementation=backend, interpret=interpret)
    ragged = functools.partial(kernels_pallas.ragged_paged_attention, **knobs)
    decode = _decode_as_ragged(functools.partial(kernels_pallas.paged_decode_attention, **knobs))
    if mesh is None:
        return ragged, decode
    return shard_attention(ragged, mesh), shard_attention(decode, mesh)


def _step(graphdef, params_def, param_leaves, input_ids, kv_cache, metadata, *, attention_fn,
          write_kv_fn, groups):
    """One model step as a pure function: (each sequence's last hidden state [B, hidden],
    hidden [T, hidden], kv_cache)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, param_leaves))
    hidden, kv_cache = model.hidden_states(
        input_ids, kv_cache, metadata, attention_fn, write_kv_fn, groups
    )
    return hidden[metadata.logits_indices], hidden, kv_cache


def _logits(graphdef, params_def, param_leaves, last_hidden, *, num_rows):
    """last_hidden [B, hidden] -> logits f32 [num_rows, vocab] of its first num_rows rows."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, param_leaves))
    return model.compute_logits(last_hidden[:num_rows])


def _all_logits(graphdef, params_def, param_leaves, last_hidden):
    """last_hidden [B, hidden] -> logits f32 [B, vocab]."""
    return _logits(graphdef, params_def, param_leaves, last_hidden,
                   num_rows=last_hidden.shape[0])


# Distinct models (or backends, meshes, KV layouts) whose compiled steps a process keeps:
# the engines a sweep or a notebook builds one after another reuse them.
STEP_FUNCTIONS_CACHE_SIZE = 8


@dataclass(frozen=True)
class StepFunctions:
    """The jitted device functions of one model graph on one attention backend, mesh and
    KV cache layout; each keeps its compiled executables per input shape and dtype.

    mixed_step, decode_step: (param leaves, input_ids, kv_cache (donated), metadata)
                             -> (last hidden, hidden, kv_cache), with the ragged and
                             the decode kernel
    logits:                  (param leaves, last hidden [B, hidden], num_rows)
    decode_loop:             (param leaves, kv_cache (donated), pool, LoopInput, ...)
    """

    mixed_step: Callable
    decode_step: Callable
    logits: Callable
    decode_loop: Callable

    def step(self, decode_only: bool) -> Callable:
        return self.decode_step if decode_only else self.mixed_step


@functools.lru_cache(maxsize=STEP_FUNCTIONS_CACHE_SIZE)
def step_functions(graphdef: nnx.GraphDef, params_def, backend: AttentionBackend,
                   interpret: bool, mesh: Mesh | None, groups: KVCacheGroups,
                   cache_layout: tuple) -> StepFunctions:
    """The step functions of every runner with this model graph, parameter structure,
    attention backend, mesh, KV cache groups and cache layout (each leaf's shape and
    dtype: `_leaf_layouts`): built once, so a second engine of the same model and pool
    compiles nothing its shapes already compiled. Each function keeps an executable per
    shape it ran; an engine of another pool size shares none of them, so the pool is part
    of the key and the cache's bound holds the executables a process keeps."""
    del cache_layout  # a key only: the functions take the cache as an argument
    ragged, decode = attention_functions(backend, interpret, mesh)
    write_kv_fn = kernels_pallas.write_kv if mesh is None else shard_write_kv(
        kernels_pallas.write_kv, mesh)

    def model_step(attention_fn):
        return functools.partial(_step, graphdef, params_def, attention_fn=attention_fn,
                                 write_kv_fn=write_kv_fn, groups=groups)

    logits_fn = functools.partial(_all_logits, graphdef, params_def)
    return StepFunctions(
        mixed_step=jax.jit(model_step(ragged), donate_argnums=2),
        decode_step=jax.jit(model_step(decode), donate_argnums=2),
        logits=jax.jit(functools.partial(_logits, graphdef, params_def),
                       static_argnames=("num_rows",)),
        decode_loop=jax.jit(functools.partial(decode_loop, model_step(decode), logits_fn),
                            donate_argnums=1,
                            static_argnames=("num_steps", "num_top", "block_size")),
    )


def _leaf_layouts(tree) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype name) of each leaf of a pytree of arrays or shape structs."""
    return tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in jax.tree.leaves(tree))


@jax.jit
def _feed_tokens(input_ids, tokens, sources):
    return jnp.where(sources >= 0, tokens[jnp.maximum(sources, 0)], input_ids)


@jax.jit
def _gather_rows(logits, rows):
    return logits[rows]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("num_top",))
def _token_logprobs(graphdef, params, hidden, targets, *, num_top):
    """hidden [LOGPROB_ROWS, hidden], targets int32 [LOGPROB_ROWS] -> logprob_outputs."""
    model = nnx.merge(graphdef, params)
    return logprob_outputs(model.compute_logits(hidden), targets, num_top)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(kv_cache: KVCache, copies: jax.Array) -> KVCache:
    """Copy whole blocks src -> dst in every layer.

    copies: int32 [K, 2] (src, dst); padding rows are (0, 0).
    """
    src, dst = copies[:, 0], copies[:, 1]
    # Every leaf: a quantized cache's scales move with their values.
    return jax.tree.map(lambda cache: cache.at[:, :, dst].set(cache[:, :, src]), kv_cache)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_blocks(kv_cache: KVCache, pages: KVCache, block_ids: jax.Array) -> KVCache:
    """Write host pages into device blocks. pages: like kv_cache, with K blocks
    ([L, Hkv, K, bs, D], and the scales [L, Hkv, K, bs] of quantized pages)."""
    return jax.tree.map(lambda cache, new: cache.at[:, :, block_ids].set(new), kv_cache, pages)


@jax.jit
def _read_blocks(cache: jax.Array, block_ids: jax.Array) -> jax.Array:
    """cache [L, Hkv, N, ...] (pages or their scales), block_ids int32 [K] -> the blocks
    [L, Hkv, K, ...]."""
    return cache[:, :, block_ids]


# The pools a block operation's ids index.
DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class BlockOpPhase:
    """One phase of a step's block operations (jpaged.memory.allocator.BlockOps).

    name:        the BlockOps field of the phase's pairs, int32 [K, 2] (source,
                 destination).
    source:      the pool the pairs' first column indexes (DEVICE or HOST).
    destination: the pool their second column indexes.
    move:        the name of the runner's method that moves them, move(pairs) (K >= 1,
                 every id checked).
    """

    name: str
    source: str
    destination: str
    move: str


class ModelRunner:
    """Owns the parameters, the paged KV cache, the host pool (swap space and the prefix
    cache's host tier, jpaged.worker.host_kv) and the compiled step.

    mesh: run tensor-parallel on this one-axis ("model") mesh; `model` and `config`
    must then be laid out for it (`jpaged.model.sharding.shard_model`).
    groups: the KV cache groups the cache is laid out for (None: one group of all
    layers, every block kept).
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
        groups: KVCacheGroups | None = None,
        logit_rows_per_seq: int = 1,
    ):
        self.config = config
        # Rows of logits a step gathers per padded sequence row (1 + k with speculative
        # decoding: a row's proposals are checked too).
        self.logit_rows_per_seq = logit_rows_per_seq
        # The model's activations (hidden states); the cache may hold another dtype.
        self.hidden_dtype = model.embed_tokens.embedding.get_value().dtype
        self.groups = groups or KVCacheGroups.of(config.layer_windows, free_windows=False)
        self.mesh = mesh
        self._replicated = None if mesh is None else NamedSharding(mesh, P())
        self.block_size = block_size
        self.attention_backend = attention_backend or device_attention_backend()
        # A sharded model keeps its stacked kernels: under lax.switch each of the
        # layers' branches would hold its own all-reduce.
        if jax.default_backend() == "cpu" and mesh is None:
            model = split_layer_kernels(model)
        self.graphdef, self.params = nnx.split(model)
        # The step takes the parameters as a flat list and the graph as a constant:
        # flattening NNX state and hashing a static graph cost milliseconds per call.
        self._param_leaves, self._params_def = jax.tree.flatten(self.params)
        params_def = self._params_def
        # Where each LoRA slot array sits among the leaves (none without adapter slots).
        self._adapter_leaves = slot_paths(self.params) if config.adapter_slots else {}
        self._new_kv_cache = functools.partial(init_kv_cache, config, num_blocks, block_size,
                                                kv_dtype, self.groups.layers_per_block)
        if mesh is not None:
            # Created in place on every device: no whole cache on one device first.
            cache_sharding = kv_cache_sharding(mesh)
            self._new_kv_cache = jax.jit(self._new_kv_cache,
                                          out_shardings=(cache_sharding, cache_sharding))
        self.kv_cache = self._new_kv_cache()
        # The pools' sizes, which every block id the device gets is checked against.
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.pool_sizes = {DEVICE: num_blocks, HOST: num_host_blocks}
        layout = jax.eval_shape(self._new_kv_cache)
        self.host_kv = HostKV([(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(layout)],
                              num_host_blocks)
        # Jitted once per model, backend, mesh and cache layout in a process: engines
        # built one after another (a sweep, a notebook) reuse each other's compiled steps.
        self.functions = step_functions(self.graphdef, params_def, self.attention_backend,
                                         interpret, mesh, self.groups, _leaf_layouts(layout))

    @property
    def kv_caches(self) -> KVCache:
        """Deprecated: `kv_cache`."""
        warnings.warn("ModelRunner.kv_caches is deprecated: use ModelRunner.kv_cache",
                      DeprecationWarning, stacklevel=2)
        return self.kv_cache

    def kv_cache_lost(self) -> bool:
        """Whether a donating call consumed the KV cache without giving it back (it raised)."""
        return any(array.is_deleted() for array in jax.tree.leaves(self.kv_cache))

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed KV cache of the same shape (the host pool is kept)."""
        for array in jax.tree.leaves(self.kv_cache):
            if not array.is_deleted():
                array.delete()
        self.kv_cache = self._new_kv_cache()

    def apply_block_ops(self, ops: BlockOps) -> None:
        """The phases of `ops` that have pairs, in the order of BLOCK_OP_PHASES (swap-out,
        store, swap-in, load, copies), before the step.

        Raises BlockIdOutOfRange, moving nothing, if an op names a block outside its pool.
        """
        phases = [(phase, getattr(ops, phase.name)) for phase in BLOCK_OP_PHASES]
        phases = [(phase, pairs) for phase, pairs in phases if len(pairs)]
        if not phases:
            return  # most steps: nothing to check or move
        self.check_block_ops(ops)
        for phase, pairs in phases:
            getattr(self, phase.move)(pairs)

    def check_block_ops(self, ops: BlockOps) -> None:
        """Raise BlockIdOutOfRange unless every block of `ops` lies in its pool: the
        device would clamp or drop an id past it, and numpy wraps a negative one."""
        for phase in BLOCK_OP_PHASES:
            pairs = getattr(ops, phase.name)
            for column, pool in enumerate((phase.source, phase.destination)):
                # The device's ids are plain "block ids" in the message.
                check_block_ids(pairs[:, column], self.pool_sizes[pool],
                                "" if pool == DEVICE else pool)

    def load_adapters(self, loads) -> None:
        """Write each (slot, adapter) of `loads` (jpaged.lora.slots) into its slot: a
        donated update of the slot arrays, which compiles nothing new."""
        for slot, adapter in loads:
            write_slot(self._param_leaves, self._adapter_leaves, slot, adapter.factors)
        if loads:
            self.params = jax.tree.unflatten(self._params_def, self._param_leaves)

    def slot_write_compiles(self) -> list[Callable[[], None]]:
        """Compile jobs of `load_adapters`' writes, one per adapter slot leaf (none
        without adapter slots)."""
        return [functools.partial(compile_slot_write, self._param_leaves[index])
                for index in self._adapter_leaves.values()]

    def with_adapter_slots(self, metadata: AttentionMetadata,
                           adapter_slots: np.ndarray | None) -> AttentionMetadata:
        """`metadata` with each token's adapter slot (int32 [T]; None: the base model's)
        where the model has adapter slots, so every step of it has one input layout."""
        if not self._adapter_leaves:
            return metadata
        if adapter_slots is None:
            adapter_slots = np.zeros(len(metadata.positions), np.int32)
        return metadata._replace(adapter_slots=adapter_slots)

    def check_metadata(self, metadata: AttentionMetadata) -> None:
        """Raise BlockIdOutOfRange unless the step's slots and block-table entries lie in
        the pool (the host's numpy arrays; arrays already on the device are not read
        back)."""
        if isinstance(metadata.slot_mapping, np.ndarray):
            check_slots(metadata.slot_mapping, self.num_blocks, self.block_size)
        if isinstance(metadata.block_tables, np.ndarray):
            check_block_ids(metadata.block_tables, self.num_blocks)

    def execute(
        self, input_ids: np.ndarray, metadata: AttentionMetadata, *, decode_only: bool,
        num_rows: int,
    ) -> tuple[jax.Array, jax.Array]:
        """Run one step. input_ids int32 [T] -> (logits f32 [num_rows, vocab] at the tokens
        of the first num_rows entries of metadata.logits_indices, final hidden states
        [T, hidden]), both still on the device."""
        last_hidden, hidden = self.advance(input_ids, metadata, decode_only=decode_only)
        return self.logits(last_hidden, num_rows), hidden

    def advance(self, input_ids: np.ndarray, metadata: AttentionMetadata, *,
                decode_only: bool) -> tuple[jax.Array, jax.Array]:
        """Run one step for its K/V alone: (the hidden states at metadata.logits_indices,
        final hidden states [T, hidden]) without logits. Raises BlockIdOutOfRange,
        running nothing, for a slot or table entry outside the pool."""
        self.check_metadata(metadata)
        step = self.functions.step(decode_only)
        last_hidden, hidden, self.kv_cache = step(
            self._param_leaves, self.on_device(input_ids), self.kv_cache, metadata
        )
        return last_hidden, hidden

    def on_device(self, value: np.ndarray | jax.Array) -> jax.Array:
        """`value` laid out as the step's arrays on the device are (its outputs, and the
        input ids async scheduling feeds it): replicated over the mesh, if any. jit
        compiles per input layout, so host inputs and warm-up's zeros take this one."""
        if self._replicated is None:
            return jnp.asarray(value)
        return place_array(value, self._replicated)

    def logits(self, last_hidden: jax.Array, num_rows: int) -> jax.Array:
        """Final-normed hidden states [B, hidden] -> logits f32 [num_rows, vocab] of the
        first num_rows rows (num_rows <= B)."""
        return self.functions.logits(self._param_leaves, last_hidden, num_rows=num_rows)

    def decode_loop(self, pool: BlockPool, inputs: LoopInput, *, num_steps: int,
                    num_top: int) -> LoopOutput:
        """Up to num_steps decode steps of `inputs` on the device, allocating from `pool`
        (jpaged.worker.decode_loop) -> its numpy outputs.

        Raises BlockIdOutOfRange for an entry of inputs.block_tables outside the pool
        (running nothing), or when the loop reports a block it took or used outside it
        (a corrupt pool: the loop stopped writing there).
        """
        check_block_ids(inputs.block_tables, self.num_blocks)
        output, self.kv_cache = self.functions.decode_loop(
            self._param_leaves, self.kv_cache, pool, inputs, num_steps=num_steps,
            num_top=num_top, block_size=self.block_size)
        output = self.fetch(output)
        if output.out_of_range:
            raise _loop_error(output, self.num_blocks)
        return output

    def compile_decode_loop(self, pool: BlockPool, inputs: LoopInput, *, num_steps: int,
                            num_top: int) -> jax.stages.Compiled:
        """The compiled loop for the shapes of `pool` and `inputs` (warm-up's threads)."""
        return self.functions.decode_loop.lower(
            self._param_leaves, self.kv_cache, pool, inputs, num_steps=num_steps,
            num_top=num_top, block_size=self.block_size).compile()

    def sample(
        self, logits: jax.Array, rows: np.ndarray, tensors: SamplingTensors, num_top: int
    ) -> SamplerOutput:
        """Draw one token per entry of `rows` (int32 [S], rows of logits [B, vocab] to
        draw from; a row may repeat: parallel samples of one prompt) -> numpy outputs."""
        return self.fetch(self.sample_on_device(logits, rows, tensors, num_top))

    @staticmethod
    def fetch(outputs):
        """Wait for device outputs (a pytree of arrays) and read them as numpy arrays, in
        one transfer: where the host waits for the device."""
        return jax.device_get(outputs)

    def sample_on_device(
        self, logits: jax.Array, rows: np.ndarray, tensors: SamplingTensors, num_top: int
    ) -> SamplerOutput:
        """`sample`, its outputs left on the device (nothing waits for them); rows that
        carry proposals are verified (jpaged.model.verification)."""
        draw = sample if tensors.proposals is None else verify
        return draw(self.gather_rows(logits, rows), tensors, num_top)

    def feed_tokens(self, input_ids: np.ndarray, tokens: jax.Array, sources: np.ndarray
                    ) -> jax.Array:
        """input_ids int32 [T] with entry t replaced by tokens[sources[t]] where
        sources[t] >= 0: a step's inputs drawn by the step before it, never leaving the
        device (async scheduling). tokens: int32 [S] (a sampler's)."""
        return _feed_tokens(input_ids, tokens, sources)

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
        padded = -(-num_tokens // LOGPROB_ROWS) * LOGPROB_ROWS
        # Chunks cut on the host: slicing the device array would compile per offset.
        rows = np.zeros((padded, hidden.shape[-1]), hidden.dtype)
        rows[:num_tokens] = np.asarray(hidden)
        padded_targets = np.zeros(padded, np.int32)
        padded_targets[:num_tokens] = targets
        chunks = [
            _token_logprobs(self.graphdef, self.params, rows[i : i + LOGPROB_ROWS],
                            padded_targets[i : i + LOGPROB_ROWS], num_top=num_top)
            for i in range(0, padded, LOGPROB_ROWS)
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
        step = self.functions.step(decode_only)
        input_ids, metadata = self._padding_inputs(num_tokens, num_seqs, num_blocks)
        return step.lower(self._param_leaves, self.on_device(input_ids), self.kv_cache,
                          metadata).compile()

    def _padding_inputs(
        self, num_tokens: int, num_seqs: int, num_blocks: int
    ) -> tuple[np.ndarray, AttentionMetadata]:
        """(input_ids, metadata) of a step of empty sequences whose tokens write the null block."""
        num_groups = self.groups.num_groups
        metadata = AttentionMetadata(
            slot_mapping=np.tile(np.arange(num_tokens, dtype=np.int32) % self.block_size,
                                 (num_groups, 1)),
            positions=np.zeros(num_tokens, np.int32),
            block_tables=np.zeros((num_groups, num_seqs, num_blocks), np.int32),
            context_lens=np.zeros(num_seqs, np.int32),
            query_start_loc=np.zeros(num_seqs + 1, np.int32),
            logits_indices=np.zeros(num_seqs * self.logit_rows_per_seq, np.int32),
        )
        return np.zeros(num_tokens, np.int32), self.with_adapter_slots(metadata, None)

    @staticmethod
    def _pad_pairs(pairs: np.ndarray) -> np.ndarray:
        """Pad [K, 2] block pairs to a power of two with (0, 0): null block onto itself."""
        padded = np.zeros((op_pairs(len(pairs)), 2), np.int32)
        padded[: len(pairs)] = pairs
        return padded

    def _copy(self, pairs: np.ndarray) -> None:
        """Device blocks -> device blocks. pairs: int32 [K, 2] (source, destination)."""
        self.kv_cache = _copy_blocks(self.kv_cache, self._pad_pairs(pairs))

    def _to_host(self, pairs: np.ndarray) -> None:
        """Device blocks -> host blocks (a swap-out, or a store to the host tier).
        pairs: int32 [K, 2] (device, host)."""
        device_ids = self._pad_pairs(pairs)[:, 0]
        self.host_kv.write(pairs[:, 1], [
            np.asarray(_read_blocks(cache, device_ids))[:, :, :len(pairs)]
            for cache in jax.tree.leaves(self.kv_cache)])

    def _from_host(self, pairs: np.ndarray) -> None:
        """Host blocks -> device blocks (a swap-in, or a load from the host tier).
        pairs: int32 [K, 2] (host, device)."""
        padded = self._pad_pairs(pairs)
        pages = jax.tree.unflatten(jax.tree.structure(self.kv_cache),
                                   self.host_kv.read(padded[:, 0]))
        self.kv_cache = _write_blocks(self.kv_cache, pages, padded[:, 1])


# The phases in the order a step applies them: the blocks that leave the device
# (swap-out, store) are read before any device block is written (swap-in, load,
# copies), and the copies come last, so they may copy a block a swap-in or load just
# filled. A new phase is an entry here, with a BlockOps field of its name and its move.
BLOCK_OP_PHASES = (
    BlockOpPhase("swap_out", DEVICE, HOST, "_to_host"),
    BlockOpPhase("store", DEVICE, HOST, "_to_host"),
    BlockOpPhase("swap_in", HOST, DEVICE, "_from_host"),
    BlockOpPhase("load", HOST, DEVICE, "_from_host"),
    BlockOpPhase("copies", DEVICE, DEVICE, "_copy"),
)


def _loop_error(output: LoopOutput, num_blocks: int) -> BlockIdOutOfRange:
    """The error of a decode loop whose out_of_range flag is set, naming the id it left in
    its block tables when there is one."""
    try:
        check_block_ids(output.block_tables, num_blocks)
    except BlockIdOutOfRange as error:
        return BlockIdOutOfRange(f"decode loop: {error}", error.value, num_blocks)
    return BlockIdOutOfRange(
        f"decode loop: a row's position passed its block table (a pool of {num_blocks} "
        "blocks)", None, num_blocks)
