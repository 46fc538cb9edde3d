"""EngineConfig: everything an engine needs to start."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import kernels_pallas
from jpaged.core import step_modes
from jpaged.core.step_modes import ModeFallbacks
from jpaged.core.step_shapes import BucketSizes
from jpaged.engine.machine import MachineDefaults
from jpaged.memory.reservation import Allocation, check_allocation
from jpaged.model.sharding import replica_meshes
from jpaged.speculative.config import SpeculativeConfig
from jpaged.suggestions import check_keywords

# The KV cache dtypes by name (None: the model's dtype), and vLLM's other names for them.
KV_CACHE_DTYPES = {
    "auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
    "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2,
}
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "int8_per_token_head": "int8",
                          "fp8_per_token_head": "fp8_e4m3"}
# GiB of host memory preemption_mode="swap" takes when no host pool is given (vLLM's).
DEFAULT_SWAP_SPACE_GIB = 4.0
# The settings that size the KV pool from a budget; at most one may be given.
KV_BUDGETS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "kv_cache_fraction")


def _suggest_unknown_keywords(cls):
    """cls(...) with a keyword that is no field raises a TypeError naming the closest
    fields, instead of the dataclass's bare "unexpected keyword argument"."""
    init, known = cls.__init__, [field.name for field in dataclasses.fields(cls)]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        check_keywords(kwargs, known, "LLM / EngineConfig")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls


@_suggest_unknown_keywords
@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start.

    max_num_seqs, max_num_batched_tokens and kv_cache_fraction left as None
    take the machine's defaults: CPU_DEFAULTS on a CPU, ACCELERATOR_DEFAULTS on
    a device that reports its memory (a GPU or TPU). The KV pool's size is the
    rule of `kv_cache_budget`. Step shapes pad to `buckets`, by default
    `default_buckets` of the attention backend. max_logprobs caps `logprobs`
    and `prompt_logprobs` (the sampler returns that many top tokens per row)
    and so the beam-search candidates per beam. share_blocks=False makes forked
    samples and beams copy all their parent's blocks before their first write
    instead of sharing them: the no-sharing baseline.
    disable_hybrid_kv_cache_manager (vLLM's name): keep every KV block of a
    model with sliding-window layers (one block table for all layers) instead of
    freeing the blocks that leave a sequence's window (in KV cache groups, for a
    model that mixes global and sliding layers): the baseline for measuring what
    freeing saves. None, the default, frees them unless the allocation is Orca's.
    enable_prefix_caching: None, the default, caches prefixes unless the allocation is
    Orca's.

    allocation: "paged" allocates blocks as tokens arrive (BlockManager).
    "orca-max", "orca-pow2" and "orca-oracle" are the paper's Orca baselines on
    the same model, kernels and pool (ReservingBlockManager): each sequence
    reserves blocks for max_model_len tokens, for its prompt plus the next power
    of two of its output, or for its true length, when its request is admitted,
    and holds them until the request ends (jpaged.memory.reservation). Pow2 and
    Oracle need the output length in advance: requests must set ignore_eos=True
    and no stop strings or stop token ids (max_tokens, or else max_model_len, is
    then the length). Orca has no prefix cache and no swap space, and each
    parallel sample or beam holds a reservation of its own. Reserved blocks
    fragment nothing outside a sequence, unlike Orca's contiguous slabs: these
    policies flatter Orca.

    The KV pool's size (jpaged.engine.kv_cache_sizing), with vLLM's names:
    num_blocks (num_gpu_blocks_override, vLLM's name for it) counts the null block;
    kv_cache_memory_bytes is a budget in bytes (kv_cache_memory, the same in bytes,
    is deprecated); gpu_memory_utilization is the fraction of the device's whole
    memory the engine may use, weights included (vLLM's meaning: the pool gets that
    share less the weights); kv_cache_fraction, jpaged's own, is the fraction of the
    memory free once the weights are loaded. Give at most one of the three budgets.

    The host pool, one pool of `host_pool_gib`: swap_space GiB (vLLM's name) for the
    blocks of sequences swapped out by `preemption_mode="swap"` (which takes
    DEFAULT_SWAP_SPACE_GIB, vLLM's 4, when no host pool is given), plus
    kv_offloading_size GiB (vLLM's name) for the prefix cache's second tier. Every
    block the prefix cache registers is copied to a free host block, and a prompt
    whose prefix left the device loads it back instead of computing it again
    (jpaged.memory.host_tier). Swapped-out blocks are held; the tier's copies are
    evicted least recently used first, by swapping too. A host block holds the block
    of every device (tensor parallelism) and of a draft model. num_host_blocks: the
    pool in blocks, a deprecated alias.

    enforce_eager (vLLM's name) is accepted and changes nothing: vLLM's turns off CUDA
    graph capture, and jpaged has none to turn off (every step is an XLA program
    compiled by jax.jit, the only way JAX runs it on a device).

    kv_cache_dtype: what the KV cache stores. "auto" is the model's dtype;
    "float32", "bfloat16" and "float16" store K/V in that dtype; "int8",
    "fp8_e4m3" and "fp8_e5m2" store 1-byte values with one float32 scale per
    (token, KV head) for K and for V, computed when the token is written
    (kernels_pallas.quantization). vLLM's names are accepted: "fp8" is
    "fp8_e4m3", "int8_per_token_head" is "int8" and "fp8_per_token_head" is
    "fp8_e4m3" (vLLM's own "fp8_e4m3" scales per tensor; jpaged always scales per
    token and head). The pool is sized in bytes, scales included.
    block_size: tokens per KV block; None takes 16, or 32 where the TPU kernel reads
    1-byte pages (a Mosaic tile of int8 or fp8 has 32 sublanes).

    attention_backend: "tpu" (the Mosaic kernel), "mosaic_gpu" (the Mosaic GPU
    kernel for Hopper: 16-bit, int8 and fp8 pages, head_dim 64 or 128; on CPU it runs in Mosaic
    GPU interpret mode with interpret=True, jax >= 0.12), "triton" (the Triton
    kernel; on CPU it runs interpreted, with interpret=True), "xla" (the same tiled
    algorithm as an XLA loop) or "reference" (the pure-JAX definition); None
    takes the device's own: "tpu" on a TPU, "mosaic_gpu" on a Hopper GPU with a
    jax that has Mosaic GPU (Triton where its layout or compile fails), "triton"
    on other GPUs, "xla" on a CPU.
    "pallas" is a deprecated name for the device's Pallas kernel.

    tensor_parallel_size: run the model Megatron-style over this many devices
    (jpaged.model.sharding): one scheduler and one set of block tables for all
    of them. data_parallel_size: this many replicas of the engine, each on its
    own tensor_parallel_size devices (`LLM` spreads requests over them; one
    `LLMEngine` is one replica). mesh: a `jax.sharding.Mesh` with axes
    ("model",) or ("data", "model") to place them on chosen devices instead of
    the first of `jax.devices()`.

    num_decode_steps: the most decode steps a batch whose sequences all decode runs on
    the device in one loop before the host schedules again (jpaged.worker.decode_loop);
    1 schedules every step. None takes the machine's default.

    async_scheduling: schedule each step while the device runs the one before it, its
    tokens taken as drawn until they arrive (vLLM's name; jpaged.core.async_scheduler).
    Outputs are those of synchronous steps.

    Which of these modes combine with which features is the table of
    jpaged.core.step_modes: settings given that conflict raise ValueError here; a
    setting left as None that conflicts gives way as the engine starts
    (`with_machine_defaults`).

    enable_lora: serve LoRA adapters (vLLM's names): requests name theirs with a
    `LoRARequest`; `max_loras` adapters run at once (the device's slots, their bytes
    taken off the KV pool's budget), each of rank at most `max_lora_rank`; the host
    keeps `max_cpu_loras` adapters read (None: max_loras).

    speculative_config: speculative decoding, as vLLM's dict
    ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": m,
    "prompt_lookup_max": M}) or a SpeculativeConfig; None decodes one token per step.
    """

    model: str = "smollm2"
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    num_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_fraction: float | None = None
    swap_space: float | None = None
    kv_offloading_size: float | None = None
    num_host_blocks: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    attention_backend: kernels_pallas.Implementation | None = None
    interpret: bool = False
    buckets: BucketSizes | None = None
    persistent_compilation_cache: bool = True
    seed: int = 0
    max_logprobs: int = 20
    share_blocks: bool = True
    disable_hybrid_kv_cache_manager: bool | None = None
    allocation: Allocation = "paged"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mesh: Mesh | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    num_decode_steps: int | None = None
    async_scheduling: bool = False
    enforce_eager: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        check_allocation(self.allocation)
        for name in ("async_scheduling", "enforce_eager", "enable_lora"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}")
        for name in ("enable_prefix_caching", "disable_hybrid_kv_cache_manager"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got "
                                f"{type(value).__name__} {value!r}")
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        name = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of "
                             f"{[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES]}, got "
                             f"{self.kv_cache_dtype!r}")
        object.__setattr__(self, "kv_cache_dtype", name)
        if self.attention_backend == "pallas":
            warnings.warn("attention_backend='pallas' is deprecated: use 'tpu' or 'triton' "
                          "(the name of the kernel), or None for the device's own",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "attention_backend",
                               kernels_pallas.pallas_implementation(self.interpret))
        if self.attention_backend not in (None, *kernels_pallas.IMPLEMENTATIONS):
            raise ValueError(f"attention_backend must be one of "
                             f"{kernels_pallas.IMPLEMENTATIONS} or None, got "
                             f"{self.attention_backend!r}")
        minimums = {"block_size": 1, "num_blocks": 2, "num_gpu_blocks_override": 2,
                    "kv_cache_memory_bytes": 1, "kv_cache_memory": 1, "max_num_seqs": 1,
                    "max_num_batched_tokens": 1, "max_model_len": 1, "max_logprobs": 1,
                    "tensor_parallel_size": 1, "data_parallel_size": 1, "num_decode_steps": 1,
                    "max_loras": 1, "max_lora_rank": 1, "max_cpu_loras": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if value is None:
                continue
            in_bytes = name.startswith("kv_cache_memory")
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                unit = " number of bytes (2 * 2**30 is 2 GiB)" if in_bytes else ""
                raise TypeError(f"{name} must be an int{unit}, got {type(value).__name__} "
                                f"{value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}{' bytes' if in_bytes else ''}, "
                                 f"got {value}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        self._take_vllm_aliases()
        self._check_kv_budget()
        self._check_host_pool()
        step_modes.check_conflicts(self)

    def _take_vllm_aliases(self) -> None:
        """num_gpu_blocks_override is num_blocks (the null block counted, as vLLM's pool
        counts it); the deprecated kv_cache_memory moves to kv_cache_memory_bytes."""
        override = self.num_gpu_blocks_override
        if override is not None:
            if self.num_blocks not in (None, override):
                raise ValueError(f"num_gpu_blocks_override={override} and num_blocks="
                                 f"{self.num_blocks} disagree: give one of them")
            object.__setattr__(self, "num_blocks", override)
        if self.kv_cache_memory is not None:
            warnings.warn("kv_cache_memory is deprecated: use kv_cache_memory_bytes (bytes, "
                          "vLLM's name)", DeprecationWarning, stacklevel=5)
            if self.kv_cache_memory_bytes is not None:
                raise ValueError("give kv_cache_memory_bytes or the deprecated "
                                 "kv_cache_memory, not both")
            object.__setattr__(self, "kv_cache_memory_bytes", self.kv_cache_memory)
            object.__setattr__(self, "kv_cache_memory", None)

    def _check_kv_budget(self) -> None:
        for name in ("gpu_memory_utilization", "kv_cache_fraction"):
            fraction = getattr(self, name)
            if fraction is not None and (isinstance(fraction, bool)
                                         or not isinstance(fraction, int | float)
                                         or not 0.0 < fraction <= 1.0):
                raise ValueError(f"{name} must be in (0, 1], got {fraction!r}")
        given = [name for name in KV_BUDGETS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} both size the KV pool: give one")

    def _check_host_pool(self) -> None:
        for name in ("swap_space", "kv_offloading_size"):
            size = getattr(self, name)
            if size is not None and (isinstance(size, bool)
                                     or not isinstance(size, int | float) or not size >= 0):
                raise ValueError(f"{name} must be a number of GiB >= 0, got {size!r}")
        size = self.kv_offloading_size
        if isinstance(self.num_host_blocks, bool) or not isinstance(self.num_host_blocks,
                                                                    int | np.integer):
            raise TypeError(f"num_host_blocks must be an int, got "
                            f"{type(self.num_host_blocks).__name__} {self.num_host_blocks!r}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.num_host_blocks and (size is not None or self.swap_space is not None):
            raise ValueError("give swap_space / kv_offloading_size (GiB) or the deprecated "
                             "num_host_blocks, not both")
        if (self.preemption_mode == "swap" and self.swap_space is None
                and not (size or self.num_host_blocks)):
            object.__setattr__(self, "swap_space", DEFAULT_SWAP_SPACE_GIB)

    @property
    def host_pool_gib(self) -> float:
        """GiB of the host pool: swap_space for swapped-out blocks plus kv_offloading_size
        for the prefix cache's host tier (one pool holds both)."""
        return (self.swap_space or 0) + (self.kv_offloading_size or 0)

    @property
    def kv_dtype(self) -> jnp.dtype:
        """The dtype of the KV cache's pages (its values, if quantized)."""
        dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        return jnp.dtype(self.dtype if dtype is None else dtype)

    @property
    def kv_dtype_name(self) -> str:
        """kv_cache_dtype with "auto" resolved to the model's dtype."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def with_machine_defaults(self, defaults: MachineDefaults,
                              layer_windows: tuple[int | None, ...] = (),
                              fallbacks: ModeFallbacks | None = None) -> EngineConfig:
        """This config with every setting left as None decided: each limit from `defaults`,
        the block size from the attention backend and the KV dtype, the step mode and
        prefix caching by jpaged.core.step_modes against the model's `layer_windows`
        (a default that conflicts gives way, noted in `fallbacks`; a setting given that
        conflicts with the model raises ValueError)."""
        backend = self.attention_backend or kernels_pallas.default_implementation(self.interpret)
        block_size = self.block_size or kernels_pallas.default_block_size(backend, self.kv_dtype)
        config = dataclasses.replace(self, block_size=block_size, **{
            name: getattr(defaults, name) if getattr(self, name) is None else getattr(self, name)
            for name in ("max_num_seqs", "max_num_batched_tokens")
        }, **step_modes.resolve(self, defaults.num_decode_steps, layer_windows,
                                ModeFallbacks() if fallbacks is None else fallbacks))
        k = config.num_speculative_tokens
        if k and k + 1 > config.max_num_batched_tokens:
            raise ValueError(
                f"speculative_config['num_speculative_tokens']={k}: a sequence's last token "
                f"and its proposals must fit max_num_batched_tokens="
                f"{config.max_num_batched_tokens}")
        return config

    @property
    def num_speculative_tokens(self) -> int:
        """k of speculative decoding; 0 without it."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    def replica_meshes(self) -> list[Mesh | None]:
        """The mesh of each data-parallel replica; [None] for one replica on one device."""
        if (self.tensor_parallel_size, self.data_parallel_size, self.mesh) == (1, 1, None):
            return [None]
        return replica_meshes(self.tensor_parallel_size, self.data_parallel_size, self.mesh)
