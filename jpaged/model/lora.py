"""A model with LoRA adapter slots, and adapters written into them on the device.

`with_adapter_slots` gives a loaded model the static slots of `AdapterSlots`: every
fused projection of every layer gets `LoRAWeight`s A [L, S, in, P * R] and B
[L, S, P * R, out] of zeros (jpaged.model.llama.Linear). `write_slot` puts one
adapter's factors (jpaged.lora.peft's layout) into one slot of them, a donated update
whose slot index is traced: loading another adapter compiles nothing and leaves every
compiled step as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.model.config import AdapterSlots, LlamaConfig
from jpaged.model.llama import LlamaForCausalLM, LoRAWeight

FACTORS = ("lora_a", "lora_b")


def with_adapter_slots(model: LlamaForCausalLM, config: LlamaConfig, slots: AdapterSlots
                       ) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """(`model` with zeroed adapter slots, its config); `model` keeps its parameters."""
    if config.adapter_slots is not None:
        raise ValueError("the model has adapter slots already")
    config = dataclasses.replace(config, adapter_slots=slots)
    dtype = model.embed_tokens.embedding.get_value().dtype
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    values = dict(nnx.to_flat_state(nnx.state(model)))

    def fill(path: tuple, variable: nnx.Variable) -> nnx.Variable:
        if path in values:
            return variable.replace(values[path].get_value())
        return variable.replace(jnp.zeros(variable.get_value().shape, dtype))

    return nnx.merge(graphdef, nnx.map_state(fill, state)), config


def slot_paths(state: nnx.State) -> dict[tuple[str, str], int]:
    """(fused projection "self_attn.qkv_proj", "lora_a" or "lora_b") -> the index of its
    LoRAWeight among `jax.tree.leaves(state)` (the runner's flat parameters)."""
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
             for path, _ in leaves_with_paths]
    found = {}
    for index, name in enumerate(names):
        name = tuple(part for part in name if part not in ("value", "raw_value"))
        if name[-1] in FACTORS and name[0] == "layers":
            found[".".join(name[1:-1]), name[-1]] = index
    return found


def adapter_state_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the adapter slots on one device."""
    from jpaged.model.sharding import bytes_per_device

    return sum(bytes_per_device(leaf) for leaf in jax.tree.leaves(nnx.state(model, LoRAWeight)))


def compile_slot_write(slots: jax.Array) -> None:
    """Compile the write of one adapter factor into `slots` (an adapter slot leaf), so an
    adapter's first load compiles nothing while serving (warm-up)."""
    factor = np.zeros((slots.shape[0], *slots.shape[2:]), np.float32)
    _write.lower(slots, factor, np.int32(0)).compile()


@functools.partial(jax.jit, donate_argnums=0)
def _write(slots: jax.Array, factor: jax.Array, index: jax.Array) -> jax.Array:
    """slots [L, S, ...], factor [L, ...], index int32 scalar -> slots with row `index` of
    axis 1 set to `factor`."""
    return slots.at[:, index].set(factor.astype(slots.dtype))


def write_slot(leaves: list[jax.Array], paths: Mapping[tuple[str, str], int], slot: int,
               factors: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Write an adapter's factors (projection -> (A [L, in, P * R], B [L, P * R, out]))
    into `slot` (1..S) of the flat parameter list `leaves`, in place of its leaves."""
    for (projection, factor), index in paths.items():
        value = factors[projection][FACTORS.index(factor)]
        leaves[index] = _write(leaves[index], value, np.int32(slot - 1))
