"""How many KV blocks an engine's pool gets: the budget rule, and the pool it reports."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.engine import lockstep, machine
from jpaged.engine.config import EngineConfig
from jpaged.engine.machine import ACCELERATOR_DEFAULTS, CPU_DEFAULTS
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.model.lora import adapter_state_bytes
from jpaged.model.sharding import bytes_per_device
from kernels_pallas.quantization import SCALE_DTYPE, is_quantized


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV pool's size, as reported at start-up (per device, with tensor parallelism).

    bytes_per_token: K and V of one token in every layer (with their scales, if
    quantized). groups: how the layers share the blocks; a block holds block_size
    tokens of the layers_per_block layers of one group (all layers without groups).
    dtype: the name of what the pages store (EngineConfig.kv_cache_dtype, resolved).
    num_host_blocks: blocks of the host pool (swap space and the prefix cache's host
    tier), each holding a device block of every device (`num_shards` of them).
    adapter_bytes: the LoRA adapter slots' bytes, taken off the budget the pool is sized
    from (0 without LoRA).
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    groups: KVCacheGroups
    dtype: str = "float32"
    num_host_blocks: int = 0
    num_shards: int = 1
    adapter_bytes: int = 0

    @property
    def block_bytes(self) -> int:
        layers = len(self.groups.layer_groups)
        return self.bytes_per_token * self.groups.layers_per_block // layers * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block: a device block of every device."""
        return self.block_bytes * self.num_shards

    def __str__(self) -> str:
        groups, layout = self.groups, ""
        if groups.num_groups > 1:
            windows = ", ".join("global" if w is None else f"window {w}" for w in groups.windows)
            layout = (f"; {groups.num_groups} groups of {groups.layers_per_block} layers: "
                      f"{windows}")
        host = ""
        if self.num_host_blocks:
            host = (f"; host pool (swap space and prefix cache tier): {self.num_host_blocks} "
                    f"blocks, {self.num_host_blocks * self.host_block_bytes / 2**20:.1f} MiB")
        adapters = (f"; LoRA adapter slots: {self.adapter_bytes / 2**20:.1f} MiB"
                    if self.adapter_bytes else "")
        return (
            f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} tokens, "
            f"{self.num_bytes / 2**20:.1f} MiB of {self.dtype} ({self.bytes_per_token} bytes "
            f"per token{layout}){host}{adapters}"
        )


@dataclass(frozen=True)
class MemoryFigures:
    """What the KV pool's size depends on, measured once the model is loaded."""

    free_bytes: int
    weight_bytes: int
    on_accelerator: bool
    total_bytes: int = 0


def kv_cache_budget(config: EngineConfig, memory: MemoryFigures, sequence_bytes: int) -> int:
    """Bytes the KV pool may take, the first rule that applies:

    1. `kv_cache_memory_bytes` bytes, if given;
    2. `gpu_memory_utilization` of the device's whole memory less the weights, if
       given (vLLM's meaning: the engine's share of the device, weights included);
    3. `kv_cache_fraction` of the free memory, if given;
    4. on an accelerator, ACCELERATOR_DEFAULTS.kv_cache_fraction (0.9) of the
       device memory free after loading the model, as vLLM's gpu_memory_utilization;
    5. on a CPU, as many bytes as the model's weights (at least one full-length
       sequence, `sequence_bytes`), at most CPU_DEFAULTS.kv_cache_fraction (0.25)
       of the free host memory: the pool and the weights share the host's RAM,
       so a process holds about twice its weights, whatever the machine's size.
    """
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if config.gpu_memory_utilization is not None:
        return _utilization_budget(config.gpu_memory_utilization, memory)
    if config.kv_cache_fraction is not None:
        return int(config.kv_cache_fraction * memory.free_bytes)
    if memory.on_accelerator:
        return int(ACCELERATOR_DEFAULTS.kv_cache_fraction * memory.free_bytes)
    return min(max(memory.weight_bytes, sequence_bytes),
               int(CPU_DEFAULTS.kv_cache_fraction * memory.free_bytes))


def _utilization_budget(utilization: float, memory: MemoryFigures) -> int:
    share = int(utilization * memory.total_bytes)
    if share <= memory.weight_bytes:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: "
            f"{utilization} of the device's {memory.total_bytes / 2**30:.2f} GiB is "
            f"{share / 2**30:.2f} GiB and the weights take {memory.weight_bytes / 2**30:.2f} "
            "GiB; raise it, or give kv_cache_memory_bytes")
    return share - memory.weight_bytes


def kv_cache_num_blocks(
    config: EngineConfig, max_model_len: int, block_bytes: int,
    memory: MemoryFigures | None, groups: KVCacheGroups, adapter_bytes: int = 0,
) -> int:
    """Blocks in the device pool (the null block included): `num_blocks` if given, else
    the budget of `kv_cache_budget` less the LoRA slots' `adapter_bytes` (KV blocks and
    adapters share one budget) in whole blocks of `block_bytes`, never more than
    max_num_seqs full-length sequences can use (plus the null block). A sequence's
    blocks are those all its KV cache groups hold at once (`KVCacheGroups.seq_blocks`).

    config must have its machine defaults (`with_machine_defaults`); memory may be
    None only when num_blocks is given.
    """
    seq_blocks = groups.seq_blocks(max_model_len, config.block_size,
                                   config.max_num_batched_tokens)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        budget = kv_cache_budget(config, memory, seq_blocks * block_bytes) - adapter_bytes
        useful = config.max_num_seqs * seq_blocks + 1
        num_blocks = min(budget // block_bytes, useful)
    if num_blocks - 1 < seq_blocks:
        raise ValueError(
            f"the KV pool holds {max(num_blocks - 1, 0)} blocks of {config.block_size} tokens "
            f"but one sequence of max_model_len={max_model_len} tokens needs {seq_blocks}; "
            "give more num_blocks / kv_cache_memory_bytes or a smaller max_model_len"
        )
    return num_blocks


def bytes_per_token(model_config, dtype) -> int:
    """KV bytes of one token on one device: K and V of every layer and of the device's
    KV heads (num_kv_heads / shard_groups of them with tensor parallelism); a quantized
    dtype adds one float32 scale per head to head_dim 1-byte values."""
    heads = model_config.num_kv_heads // model_config.shard_groups
    per_head = model_config.head_dim * jnp.dtype(dtype).itemsize
    if is_quantized(dtype):
        per_head += jnp.dtype(SCALE_DTYPE).itemsize
    return 2 * model_config.num_layers * heads * per_head


def weight_bytes(model) -> int:
    """Bytes of parameters on one device (all of them without tensor parallelism)."""
    return sum(bytes_per_device(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def size_kv_cache(config: EngineConfig, model_config, model, max_model_len: int,
                  device: jax.Device | None, groups: KVCacheGroups,
                  draft: tuple | None = None) -> KVCacheInfo:
    """The pool of an engine whose model is loaded (on `device`, by default the default
    device), laid out for `groups`: `kv_cache_num_blocks` on the memory the machine
    reports (the smallest of any process of a multi-process job). draft: (model, config)
    of a draft model, whose cache has a block for each
    of the target's: its bytes count in every token's and its weights in the memory."""
    token_bytes = bytes_per_token(model_config, config.kv_dtype)
    if draft is not None:
        token_bytes += bytes_per_token(draft[1], config.kv_dtype)
    info = KVCacheInfo(0, config.block_size, token_bytes, groups, config.kv_dtype_name)
    adapter_bytes = adapter_state_bytes(model)
    # Measured with the slots in memory: what was free before them is the budget's base.
    memory = None if config.num_blocks is not None else MemoryFigures(
        machine.free_device_memory(device) + adapter_bytes,
        weight_bytes(model) + (0 if draft is None else weight_bytes(draft[0])),
        machine.on_accelerator(), machine.total_device_memory(device))
    num_blocks = kv_cache_num_blocks(config, max_model_len, info.block_bytes, memory, groups,
                                     adapter_bytes)
    # Processes of one job measure their own memory; their pools must be the same.
    num_blocks = lockstep.smallest_over_processes(num_blocks)
    info = dataclasses.replace(info, num_blocks=num_blocks, num_shards=model_config.shard_groups,
                               adapter_bytes=adapter_bytes)
    return dataclasses.replace(info, num_host_blocks=host_pool_blocks(config, info))


def host_pool_blocks(config: EngineConfig, info: KVCacheInfo) -> int:
    """Blocks of the host pool: `host_pool_gib` (swap_space + kv_offloading_size) in whole
    host blocks (each a device block of every device), or the deprecated `num_host_blocks`."""
    if config.num_host_blocks:
        warnings.warn("num_host_blocks is deprecated: use swap_space / kv_offloading_size, "
                      "the host pool's GiB (vLLM's names)", DeprecationWarning, stacklevel=2)
        return config.num_host_blocks
    return int(config.host_pool_gib * 2**30) // info.host_block_bytes

