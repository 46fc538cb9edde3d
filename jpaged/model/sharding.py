"""Tensor parallelism: a Llama model laid out Megatron-style over a mesh's "model" axis.

Each of the N devices on the axis holds

- its q heads and their KV heads: the columns of `qkv_proj` (regrouped at load
  time into N groups [q | k | v], `LlamaConfig.shard_groups`) and the matching
  rows of `o_proj`;
- its MLP columns: the columns of `gate_up_proj` (regrouped into N groups
  [gate | up]) and the matching rows of `down_proj`;
- its KV heads' slice of the paged cache (axis 1 of [L, Hkv, blocks, bs, D]),
  the same blocks on every device, addressed by the same block tables;
- whole copies of the embedding, the LM head and the norms (replicated: no
  collective before the layers or after them, at the cost of one copy of the
  vocabulary matrices per device).

A layer then needs two collectives, both all-reduces of [T, hidden] partial
sums: after `o_proj` and after `down_proj`. Attention and `write_kv` run under
`shard_map` over KV heads, so each device runs the unchanged kernels on its
own heads.

With fewer KV heads than devices, each KV head is replicated to
N / num_kv_heads devices (as vLLM and tpu-inference do): the model is rebuilt
with N KV heads, one per device, so each device holds 1 / num_kv_heads of the
single-device cache rather than 1 / N.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.model.config import LlamaConfig
from jpaged.model.llama import LlamaForCausalLM
from kernels_pallas.online_softmax import NO_WINDOW

MODEL_AXIS = "model"

# The mesh axis of each sharded parameter's dimensions (paths end in the parameter
# name, the leading None is the stacked [num_layers] axis); the rest are replicated.
_PARAM_SPECS = {
    ("qkv_proj", "kernel"): P(None, None, MODEL_AXIS),
    ("qkv_proj", "bias"): P(None, MODEL_AXIS),
    ("o_proj", "kernel"): P(None, MODEL_AXIS, None),
    ("gate_up_proj", "kernel"): P(None, None, MODEL_AXIS),
    ("down_proj", "kernel"): P(None, MODEL_AXIS, None),
    # LoRA slots [L, S, in, R] and [L, S, R, out]: each device the factor rows or columns
    # of its own kernel's.
    ("qkv_proj", "lora_b"): P(None, None, None, MODEL_AXIS),
    ("o_proj", "lora_a"): P(None, None, MODEL_AXIS, None),
    ("gate_up_proj", "lora_b"): P(None, None, None, MODEL_AXIS),
    ("down_proj", "lora_a"): P(None, None, MODEL_AXIS, None),
}
# The parameters whose last axis holds a fused projection's output columns.
_COLUMNS = ("kernel", "bias", "lora_b")
KV_CACHE_SPEC = P(None, MODEL_AXIS)


def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`jax.shard_map` (in every jax jpaged supports, >= 0.10.2) with the replication
    checks off: the Pallas kernels inside carry no replication rules."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def model_mesh(devices: list) -> Mesh:
    """A one-axis ("model") mesh over `devices`."""
    return Mesh(np.asarray(devices), (MODEL_AXIS,))


def check_tensor_parallel(config: LlamaConfig, size: int) -> None:
    """ValueError unless a model of `config` splits over `size` devices: the query heads,
    the MLP columns and the KV heads (or, with fewer KV heads, `size`) divide evenly."""
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide the model's "
                         f"{config.num_heads} query heads")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide the model's "
                         f"intermediate size {config.intermediate_size}")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({size}) must divide the model's "
                         f"{config.num_kv_heads} KV heads or be a multiple of them")


def tensor_parallel_config(config: LlamaConfig, size: int) -> LlamaConfig:
    """The config of `config`'s model laid out over `size` devices: its fused columns in
    `size` groups, and at least `size` KV heads (each replicated when there are fewer)."""
    check_tensor_parallel(config, size)
    return dataclasses.replace(config, num_kv_heads=max(config.num_kv_heads, size),
                               shard_groups=size)


def _regroup(columns: jax.Array | np.ndarray, piece_heads: list[int], head_dim: int,
             repeats: list[int], groups: int) -> jax.Array | np.ndarray:
    """columns [..., W]: pieces of piece_heads[i] heads of head_dim columns side by side
    -> [..., W'] with each head of piece i repeated repeats[i] times, laid out as
    `groups` groups, each holding its slice of every piece in turn. A numpy array (an
    adapter's factors, read on the host) stays one: jnp would compile each op per shape."""
    xp = np if isinstance(columns, np.ndarray) else jnp
    lead = columns.shape[:-1]
    splits = np.cumsum([heads * head_dim for heads in piece_heads])[:-1]
    pieces = [
        xp.repeat(piece.reshape(*lead, heads, head_dim), repeat, axis=-2)
        .reshape(*lead, groups, -1, head_dim)
        for piece, heads, repeat in zip(xp.split(columns, splits, axis=-1), piece_heads,
                                        repeats, strict=True)
    ]
    return xp.concatenate(pieces, axis=-2).reshape(*lead, -1)


def _regrouped(path: tuple, value: jax.Array | np.ndarray, config: LlamaConfig, size: int
               ) -> jax.Array | np.ndarray:
    """A parameter of the single-device layout (shard_groups 1) in the layout of
    `tensor_parallel_config(config, size)`."""
    if path[-1] not in _COLUMNS:
        return value
    if "qkv_proj" in path:
        repeat = max(size // config.num_kv_heads, 1)
        heads = [config.num_heads, config.num_kv_heads, config.num_kv_heads]
        return _regroup(value, heads, config.head_dim, [1, repeat, repeat], size)
    if "gate_up_proj" in path:
        return _regroup(value, [config.intermediate_size] * 2, 1, [1, 1], size)
    return value


def param_sharding(path: tuple, mesh: Mesh) -> NamedSharding:
    """Where the parameter at `path` (an NNX state path) lives on the mesh."""
    names = tuple(str(part) for part in path)
    return NamedSharding(mesh, _PARAM_SPECS.get(names[-2:], P()))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The paged cache [layers_per_block, Hkv, blocks, bs, D] split by KV head."""
    return NamedSharding(mesh, KV_CACHE_SPEC)


def place_array(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`value`, which every process holds whole, laid out with `sharding`. Where the
    sharding spans processes each takes only its own devices' slices of its copy
    (`jax.device_put` would first compare the copies, gathering each whole)."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def shard_model(
    model: LlamaForCausalLM, config: LlamaConfig, mesh: Mesh
) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """`model` (single-device layout) laid out over the mesh's "model" axis, with its
    config: each parameter regrouped, then placed with `param_sharding`."""
    if config.shard_groups != 1:
        raise ValueError(f"the model is already laid out for {config.shard_groups} devices")
    size = mesh.shape[MODEL_AXIS]
    sharded_config = tensor_parallel_config(config, size)
    dtype = model.embed_tokens.embedding.get_value().dtype
    abstract = nnx.eval_shape(
        lambda: LlamaForCausalLM(sharded_config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    values = dict(nnx.to_flat_state(nnx.state(model)))

    def place(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        value = _regrouped(path, values[path].get_value(), config, size)
        return variable.replace(place_array(value, param_sharding(path, mesh)))

    return nnx.merge(graphdef, nnx.map_state(place, abstract_state)), sharded_config


def shard_attention(attention_fn: Callable, mesh: Mesh) -> Callable:
    """An attention function (ragged signature, see `LlamaForCausalLM.hidden_states`) run
    on each device's KV heads and their query heads, with the same block tables."""
    heads = P(None, MODEL_AXIS)

    def attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, layer,
                  scale, sliding_window=None, soft_cap=None):
        def local(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, layer,
                  sliding_window):
            return attention_fn(q, k_cache, v_cache, block_tables, context_lens,
                                query_start_loc, layer=layer, sliding_window=sliding_window,
                                scale=scale, soft_cap=soft_cap)

        window = NO_WINDOW if sliding_window is None else sliding_window
        in_specs = (heads, KV_CACHE_SPEC, KV_CACHE_SPEC, P(), P(), P(), P(), P())
        return shard_map(local, mesh, in_specs, heads)(
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc, layer,
            jnp.int32(window))

    return attention


def shard_write_kv(write_kv_fn: Callable, mesh: Mesh) -> Callable:
    """A `write_kv` that writes each device's KV heads into its slice of the cache."""
    heads = P(None, MODEL_AXIS)
    in_specs = (KV_CACHE_SPEC, KV_CACHE_SPEC, heads, heads, P(), P())
    return shard_map(write_kv_fn, mesh, in_specs, (KV_CACHE_SPEC, KV_CACHE_SPEC))


def bytes_per_device(array: jax.Array) -> int:
    """Bytes of `array` held on one of its devices (its first shard), read from its sharding."""
    return array.addressable_shards[0].data.nbytes


def replica_meshes(tensor_parallel_size: int, data_parallel_size: int,
                   mesh: Mesh | None = None) -> list[Mesh]:
    """One "model"-axis mesh per data-parallel replica, on disjoint devices.

    mesh: the user's own, with axes ("model",) or ("data", "model"); each row along
    "data" is a replica. Else the first tensor_parallel_size x data_parallel_size of
    `jax.devices()`, replica i on devices [i * tp, (i + 1) * tp).
    """
    if mesh is not None:
        return _split_mesh(mesh, tensor_parallel_size, data_parallel_size)
    devices = jax.devices()
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) x data_parallel_size "
            f"({data_parallel_size}) = {needed} devices exceeds the {len(devices)} available; "
            "on a CPU, simulate devices: --num-cpu-devices N on the command line, "
            "JAX_NUM_CPU_DEVICES=N in the environment, or "
            "jax.config.update('jax_num_cpu_devices', N) before JAX first runs anything"
        )
    return [model_mesh(devices[i * tensor_parallel_size:(i + 1) * tensor_parallel_size])
            for i in range(data_parallel_size)]


def _split_mesh(mesh: Mesh, tensor_parallel_size: int, data_parallel_size: int) -> list[Mesh]:
    if mesh.axis_names not in ((MODEL_AXIS,), ("data", MODEL_AXIS)):
        raise ValueError(f"mesh axes must be ('model',) or ('data', 'model'), "
                         f"got {mesh.axis_names}")
    rows = mesh.devices.reshape(-1, mesh.shape[MODEL_AXIS])
    for name, given, size in (("tensor_parallel_size", tensor_parallel_size, rows.shape[1]),
                              ("data_parallel_size", data_parallel_size, rows.shape[0])):
        if given not in (1, size):
            raise ValueError(f"{name}={given} disagrees with the mesh, whose size on that "
                             f"axis is {size}; leave it out")
    return [model_mesh(list(row)) for row in rows]


def regroup_adapter(factors: dict[str, tuple[np.ndarray, np.ndarray]], config: LlamaConfig,
                    size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """An adapter's factors (jpaged.lora.peft's layout for `config`, one device) in the
    layout of `tensor_parallel_config(config, size)`: B's columns regrouped as the
    kernel's are."""
    return {projection: (a, _regrouped((*projection.split("."), "lora_b"), b, config, size))
            for projection, (a, b) in factors.items()}
