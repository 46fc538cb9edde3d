"""LLMEngine: continuous batching of requests over a paged KV cache.

Each `step()` is one iteration of the serving loop:

    scheduler.schedule()        host: which sequences run, how many tokens each,
                                block tables grown (copy-on-write, swaps)
    runner.apply_block_ops()    device: block copies and swaps
    build_model_input()         host: padded int32 gather indices
    runner.execute()            device: the jit-compiled model step
    scheduler.update_after_step host: computed tokens, prefix-cache registration
    fork parallel samples       host: a computed prompt's n samples share its blocks
    runner.sample()             device: a token and log-probabilities per sequence
    append / beam selection     host: stop checks, beams forked and dropped;
                                finished sequences free their blocks at once
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import kernels_pallas
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.batch_builder import (
    BucketSizes,
    bucket,
    build_model_input,
    padded_sizes,
    sampler_rows,
)
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.engine.beam_search import Beam, BeamSearch, Hypothesis
from jpaged.engine.detokenizer import IncrementalDetokenizer
from jpaged.engine.request import Request, Sample
from jpaged.engine.runner import AttentionBackend, ModelRunner, default_attention_backend
from jpaged.engine.stats import EngineStats
from jpaged.inputs import PromptType, parse_prompt
from jpaged.memory.block_manager import BlockManager
from jpaged.memory.reservation import Allocation, check_allocation, reserved_tokens
from jpaged.model.llama import LlamaConfig
from jpaged.model.loader import cache_directory, load_model
from jpaged.model.sampler import SamplerOutput, SamplingRow, sampling_tensors
from jpaged.model.sharding import bytes_per_device, replica_meshes, shard_model
from jpaged.outputs import Logprob, RequestMetrics, RequestOutput
from jpaged.sampling_params import GREEDY_TEMPERATURE, BeamSearchParams, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger("jpaged")


@dataclass(frozen=True)
class MachineDefaults:
    """The limits an engine takes when its config leaves them as None."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_fraction: float


# A CPU runs a step's matrix products on a few cores: a 256-token budget keeps
# decode steps of 64 sequences short enough to interleave with prefill chunks.
# The pool there is bounded by the weights (see `kv_cache_budget`).
CPU_DEFAULTS = MachineDefaults(max_num_seqs=64, max_num_batched_tokens=256,
                               kv_cache_fraction=0.25)
# vLLM's defaults on an accelerator (its gpu_memory_utilization is 0.9).
ACCELERATOR_DEFAULTS = MachineDefaults(max_num_seqs=256, max_num_batched_tokens=2048,
                                       kv_cache_fraction=0.9)


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

    allocation: "paged" allocates blocks as tokens arrive. "orca-max",
    "orca-pow2" and "orca-oracle" are the paper's Orca baselines on the same
    model, kernels and pool: each sequence reserves blocks for max_model_len
    tokens, for its prompt plus the next power of two of its output, or for its
    true length, when its request is admitted, and holds them until the request
    ends (jpaged.memory.reservation). Pow2 and Oracle need the output length in
    advance: requests must set ignore_eos=True and no stop strings or stop token
    ids (max_tokens, or else max_model_len, is then the length). Orca has no
    prefix cache, so these allocations run without one, and each parallel
    sample or beam holds a reservation of its own. Reserved blocks fragment
    nothing outside a sequence, unlike Orca's contiguous slabs: these policies
    flatter Orca.

    tensor_parallel_size: run the model Megatron-style over this many devices
    (jpaged.model.sharding): one scheduler and one set of block tables for all
    of them. data_parallel_size: this many replicas of the engine, each on its
    own tensor_parallel_size devices (`LLM` spreads requests over them; one
    `LLMEngine` is one replica). mesh: a `jax.sharding.Mesh` with axes
    ("model",) or ("data", "model") to place them on chosen devices instead of
    the first of `jax.devices()`.
    """

    model: str = "smollm2"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    num_host_blocks: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    attention_backend: AttentionBackend | None = None
    interpret: bool = False
    buckets: BucketSizes | None = None
    persistent_compilation_cache: bool = True
    seed: int = 0
    max_logprobs: int = 20
    share_blocks: bool = True
    allocation: Allocation = "paged"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mesh: Mesh | None = None

    def __post_init__(self):
        check_allocation(self.allocation)
        minimums = {"block_size": 1, "num_blocks": 2, "kv_cache_memory": 1, "max_num_seqs": 1,
                    "max_num_batched_tokens": 1, "max_model_len": 1, "max_logprobs": 1,
                    "tensor_parallel_size": 1, "data_parallel_size": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < minimum:
                unit = " bytes" if name == "kv_cache_memory" else ""
                raise ValueError(f"{name} must be >= {minimum}{unit}, got {value}")
        fraction = self.kv_cache_fraction
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        if fraction is not None and (isinstance(fraction, bool)
                                     or not isinstance(fraction, int | float)
                                     or not 0.0 < fraction <= 1.0):
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {fraction!r}")

    def with_machine_defaults(self, defaults: MachineDefaults) -> EngineConfig:
        """This config with each limit left as None taken from `defaults`."""
        return dataclasses.replace(self, **{
            name: getattr(defaults, name) if getattr(self, name) is None else getattr(self, name)
            for name in ("max_num_seqs", "max_num_batched_tokens")
        })

    def replica_meshes(self) -> list[Mesh | None]:
        """The mesh of each data-parallel replica; [None] for one replica on one device."""
        if (self.tensor_parallel_size, self.data_parallel_size, self.mesh) == (1, 1, None):
            return [None]
        return replica_meshes(self.tensor_parallel_size, self.data_parallel_size, self.mesh)


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV pool's size, as reported at start-up (per device, with tensor parallelism)."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def __str__(self) -> str:
        return (
            f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens, {self.num_bytes / 2**20:.1f} MiB "
            f"({self.bytes_per_token} bytes per token)"
        )


def use_persistent_compilation_cache() -> None:
    """Keep compiled steps on disk (under the jpaged cache) unless the user chose a place:
    a process that serves the same shapes again loads them instead of compiling."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_directory() / "xla"))


def on_accelerator() -> bool:
    """Whether the default device reports its own memory (a GPU or TPU, not the host)."""
    stats = jax.devices()[0].memory_stats()
    return bool(stats) and "bytes_limit" in stats


def machine_defaults() -> MachineDefaults:
    return ACCELERATOR_DEFAULTS if on_accelerator() else CPU_DEFAULTS


def free_device_memory(device: jax.Device | None = None) -> int:
    """Bytes free on `device`, by default the default device (free host RAM when the
    device is a CPU)."""
    stats = (device or jax.devices()[0]).memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return available_host_memory()


def available_host_memory() -> int:
    """Bytes of host RAM a new allocation can get: Linux's MemAvailable, which counts the
    page cache the kernel drops on demand (right after reading a checkpoint, most of
    the free RAM is page cache); elsewhere the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemoryFigures:
    """What the KV pool's size depends on, measured once the model is loaded."""

    free_bytes: int
    weight_bytes: int
    on_accelerator: bool


def kv_cache_budget(config: EngineConfig, memory: MemoryFigures, sequence_bytes: int) -> int:
    """Bytes the KV pool may take, the first rule that applies:

    1. `kv_cache_memory` bytes, if given;
    2. `kv_cache_fraction` of the free memory, if given;
    3. on an accelerator, ACCELERATOR_DEFAULTS.kv_cache_fraction (0.9) of the
       device memory free after loading the model, as vLLM's gpu_memory_utilization;
    4. on a CPU, as many bytes as the model's weights (at least one full-length
       sequence, `sequence_bytes`), at most CPU_DEFAULTS.kv_cache_fraction (0.25)
       of the free host memory: the pool and the weights share the host's RAM,
       so a process holds about twice its weights, whatever the machine's size.
    """
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if config.kv_cache_fraction is not None:
        return int(config.kv_cache_fraction * memory.free_bytes)
    if memory.on_accelerator:
        return int(ACCELERATOR_DEFAULTS.kv_cache_fraction * memory.free_bytes)
    return min(max(memory.weight_bytes, sequence_bytes),
               int(CPU_DEFAULTS.kv_cache_fraction * memory.free_bytes))


def kv_cache_num_blocks(
    config: EngineConfig, max_model_len: int, bytes_per_token: int,
    memory: MemoryFigures | None,
) -> int:
    """Blocks in the device pool (the null block included): `num_blocks` if given, else
    the budget of `kv_cache_budget` in whole blocks, never more than max_num_seqs
    full-length sequences can use (plus the null block).

    config must have its machine defaults (`with_machine_defaults`); memory may be
    None only when num_blocks is given.
    """
    blocks_per_seq = -(-max_model_len // config.block_size)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        block_bytes = bytes_per_token * config.block_size
        budget = kv_cache_budget(config, memory, blocks_per_seq * block_bytes)
        useful = config.max_num_seqs * blocks_per_seq + 1
        num_blocks = min(budget // block_bytes, useful)
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"the KV pool holds {max(num_blocks - 1, 0)} blocks of {config.block_size} tokens "
            f"but one sequence of max_model_len={max_model_len} tokens needs {blocks_per_seq}; "
            "give more num_blocks / kv_cache_memory or a smaller max_model_len"
        )
    return num_blocks


def _weight_bytes(model) -> int:
    """Bytes of parameters on one device (all of them without tensor parallelism)."""
    return sum(bytes_per_device(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def default_buckets(
    attention_backend: AttentionBackend, max_blocks_per_seq: int, max_num_seqs: int
) -> BucketSizes:
    """Padded step shapes: token and sequence counts by powers of two, then multiples
    of 16; a mixed step's tokens from 16 on, by powers of two, then multiples of
    32. Mixed steps pad their sequence rows to the largest row bucket, so they
    vary by token count alone (empty rows cost the attention nothing and the
    logits are taken for the rows in use only). The XLA loop stops each tile at
    its own context, so there the block table can always have full width: one
    width instead of several, a fraction of the compiles. The reference gathers
    the whole table and the TPU kernel prefetches it into scalar memory, so other
    backends get power-of-two widths from 8."""
    linear_step = 16
    min_blocks = max_blocks_per_seq if attention_backend == "xla" else 8
    return BucketSizes(min_num_tokens=1, min_num_seqs=1, min_blocks_per_seq=min_blocks,
                       linear_step=linear_step,
                       mixed_num_seqs=bucket(max_num_seqs, 1, linear_step),
                       mixed_min_tokens=16, mixed_token_step=32)


class LLMEngine:
    """add_request / step / abort / has_unfinished_requests over a loaded model."""

    def __init__(
        self, config: EngineConfig, *, loaded: tuple[Any, LlamaConfig, Any] | None = None
    ):
        """loaded: (model, model_config, tokenizer) already in memory, else config.model loads."""
        config = config.with_machine_defaults(machine_defaults())
        self.config = config
        meshes = config.replica_meshes()
        if len(meshes) > 1:
            raise ValueError(f"an LLMEngine is one replica, got {len(meshes)} data-parallel "
                             "replicas; run them with LLM or DataParallelEngine")
        self.mesh = meshes[0]
        model, self.model_config, self.tokenizer = loaded or load_model(config.model, config.dtype)
        if self.mesh is not None:
            model, self.model_config = shard_model(model, self.model_config, self.mesh)
        # Only once the model loaded: a failed LLM(...) leaves the process-wide setting alone.
        if config.persistent_compilation_cache:
            use_persistent_compilation_cache()
        model_max = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(model_max, 2048), model_max)
        dtype = jnp.dtype(config.dtype)
        # Per device: each holds num_kv_heads / shard_groups heads.
        bytes_per_token = (
            2 * self.model_config.num_layers * self.model_config.num_kv_heads
            // self.model_config.shard_groups * self.model_config.head_dim * dtype.itemsize
        )
        memory_device = None if self.mesh is None else self.mesh.devices.flat[0]
        memory = None if config.num_blocks is not None else MemoryFigures(
            free_device_memory(memory_device), _weight_bytes(model), on_accelerator())
        num_blocks = kv_cache_num_blocks(config, self.max_model_len, bytes_per_token, memory)
        self.kv_cache_info = KVCacheInfo(num_blocks, config.block_size, bytes_per_token)
        logger.info("%s", self.kv_cache_info)
        self.block_manager = BlockManager(CacheConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            num_host_blocks=config.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching and config.allocation == "paged",
            share_blocks=config.share_blocks,
        ))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
            ),
            self.block_manager,
        )
        self.runner = self._start_runner(model, num_blocks, dtype)
        eos, tokenizer_eos = self.model_config.eos_token_ids, self.tokenizer.eos_token_id
        self.eos_token_ids = eos if tokenizer_eos in (None, *eos) else (*eos, tokenizer_eos)
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._request_of_seq: dict[int, Request] = {}
        self._seq_ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self._token_texts: dict[int, str] = {}
        self.last_step_error: BaseException | None = None

    def _start_runner(self, model, num_blocks: int, dtype) -> ModelRunner:
        """The runner, on the configured backend or else the default one.

        The Pallas kernels must accept the cache layout and compile on this
        device (checked here, on the smallest step shapes); if the default
        kernel cannot, the engine warns and runs the XLA implementation, while
        an explicitly requested backend raises instead. Sets `self.buckets`.
        """
        config = self.config
        requested = config.attention_backend
        backend = requested or default_attention_backend()
        try:
            return self._runner_on(backend, model, num_blocks, dtype)
        except Exception as error:
            if requested is not None:
                if isinstance(error, ValueError):
                    raise
                raise RuntimeError(
                    f"attention_backend={requested!r} cannot run on this "
                    f"{jax.default_backend()} device: {type(error).__name__}: {error}"
                ) from error
            reason = f"{type(error).__name__}: {error}"
        # Out of the except block, so the failed runner and its KV cache are freed first.
        logger.warning("the default %r attention kernel cannot run on this %s device (%s); "
                       "using the 'xla' implementation", backend, jax.default_backend(), reason)
        return self._runner_on("xla", model, num_blocks, dtype)

    def _runner_on(self, backend: AttentionBackend, model, num_blocks: int, dtype
                   ) -> ModelRunner:
        config = self.config
        if backend == "pallas":
            kernels_pallas.check_cache_layout(
                kernels_pallas.default_implementation(config.interpret), dtype,
                config.block_size, self.model_config.head_dim)
        runner = ModelRunner(
            model, self.model_config,
            num_blocks=num_blocks, block_size=config.block_size,
            num_host_blocks=config.num_host_blocks, kv_dtype=dtype,
            attention_backend=backend, interpret=config.interpret, mesh=self.mesh,
        )
        self.buckets = config.buckets or default_buckets(
            backend, -(-self.max_model_len // config.block_size), config.max_num_seqs
        )
        if backend == "pallas":
            for num_tokens, decode_only in ((1, True), (2, False)):
                num_tokens, num_seqs, _ = padded_sizes(num_tokens, 1, self.buckets, decode_only)
                runner.run_padding_step(num_tokens, num_seqs,
                                        bucket(1, self.buckets.min_blocks_per_seq), decode_only)
        return runner

    # Requests.

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError/TypeError, changing nothing, on bad input.

        prompt: text, token ids, or a vLLM prompt dict (jpaged.inputs); a
        "cache_salt" in the dict counts as the cache_salt argument.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise TypeError(
                f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}"
            )
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        parsed = parse_prompt(prompt)
        token_ids = self._prompt_token_ids(parsed.text, parsed.token_ids)
        self._check_params(params, len(token_ids))
        now = time.perf_counter()
        sampling = isinstance(params, SamplingParams)
        group = SequenceGroup(
            request_id, [Sequence(next(self._seq_ids), token_ids)], arrival_time=now,
            cache_salt=cache_salt if cache_salt is not None else parsed.cache_salt,
            num_samples=params.n if sampling else params.beam_width,
            use_prefix_cache=not sampling or params.prompt_logprobs is None,
            reserved_len=self._reserved_len(request_id, params, len(token_ids)),
        )
        self._check_reservation_fits(group)
        self.scheduler.add_request(group)
        seed = params.seed if sampling and params.seed is not None else int(
            self._seeds.integers(2**32))
        request = Request(group, params, parsed.text, seed, RequestMetrics(now))
        seq = group.seqs[0]
        if sampling:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens
            )
            logprobs = None if params.logprobs is None else []
            request.samples[seq.seq_id] = Sample(0, detokenizer, logprobs)
            if params.prompt_logprobs is not None:
                request.prompt_logprobs = [None]
        else:
            max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
            request.search = BeamSearch(params, len(token_ids), self.eos_token_ids, max_tokens)
            request.beams[seq.seq_id] = Beam()
        self._requests[request_id] = request
        self._request_of_seq[seq.seq_id] = request

    def _reserved_len(self, request_id: str, params: SamplingParams | BeamSearchParams,
                      prompt_len: int) -> int:
        """Tokens each sequence of the request reserves under the engine's allocation."""
        try:
            return reserved_tokens(self.config.allocation, prompt_len,
                                   self._known_output_len(params, prompt_len), self.max_model_len)
        except ValueError as error:
            raise ValueError(f"request {request_id!r}: {error}") from None

    def _known_output_len(self, params: SamplingParams | BeamSearchParams,
                          prompt_len: int) -> int | None:
        """The output length the request will have, or None if EOS or a stop may end it
        sooner."""
        if not params.ignore_eos:
            return None
        if isinstance(params, SamplingParams) and (params.stop or params.stop_token_ids):
            return None
        # A prompt of max_model_len tokens still samples one.
        room = max(self.max_model_len - prompt_len, 1)
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def _check_reservation_fits(self, group: SequenceGroup) -> None:
        if not group.reserved_len:
            return
        required = self.block_manager.reservation_blocks(group)
        if required > self.block_manager.num_device_blocks:
            raise ValueError(
                f"request {group.request_id!r}: allocation={self.config.allocation!r} reserves "
                f"{group.num_samples} x {group.reserved_len} tokens = {required} blocks, more "
                f"than the pool's {self.block_manager.num_device_blocks} blocks"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown ids are ignored."""
        self.scheduler.abort(request_id)
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._forget(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def num_unfinished_requests(self) -> int:
        """Requests queued or running (a data-parallel replica's load)."""
        return len(self._requests)

    def tokenize(self, prompt: PromptType) -> list[int]:
        """A prompt (text, token ids or a prompt dict) as validated token ids."""
        parsed = parse_prompt(prompt)
        return self._prompt_token_ids(parsed.text, parsed.token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages through the model's chat template, as validated token ids."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("a conversation must be a list of message dicts ({'role', 'content'})")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self._prompt_token_ids(None, self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_token_ids(self, text: str | None, token_ids: list[int] | None) -> list[int]:
        if token_ids is None:
            token_ids = self.tokenizer.encode(text)
        else:
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"token ids {bad[:5]} are outside the vocabulary [0, "
                    f"{self.model_config.vocab_size})"
                )
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        return token_ids

    def _check_params(self, params: SamplingParams | BeamSearchParams, prompt_len: int) -> None:
        """The limits that depend on the engine's configuration."""
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        max_logprobs = self.config.max_logprobs
        if isinstance(params, SamplingParams):
            if params.n > limit:
                raise ValueError(
                    f"n={params.n} is more than min(max_num_seqs, max_num_batched_tokens)={limit}"
                )
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > max_logprobs:
                    raise ValueError(f"{name}={value} is more than max_logprobs={max_logprobs}")
            return
        if params.beam_width > limit:
            raise ValueError(
                f"beam_width={params.beam_width} is more than "
                f"min(max_num_seqs, max_num_batched_tokens)={limit}"
            )
        candidates = BeamSearch(params, prompt_len, self.eos_token_ids, 1).num_candidates
        if candidates > max_logprobs:
            raise ValueError(
                f"beam_width={params.beam_width} with {params.scoring!r} scoring needs "
                f"{candidates} candidates per beam, more than max_logprobs={max_logprobs}"
            )
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens: beam search needs room for output "
                f"within max_model_len={self.max_model_len}"
            )

    # One iteration.

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample once; the outputs of the requests that made progress
        (as each request's output_kind says).

        If the step raises, its requests finish with finish_reason "error" (the
        exception is kept in `last_step_error`) and every other request goes on;
        an interrupt (KeyboardInterrupt) is raised again once the engine is
        consistent.
        """
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        touched = [self._requests[g.request_id] for g in plan.ignored]
        self.stats.record_blocks(self.block_manager)
        interrupt = None
        if not plan.is_empty:
            self._account_blocks()
            try:
                touched += self._run(plan)
            except Exception as error:
                touched += self._fail_step(plan, error)
            except BaseException as error:
                touched += self._fail_step(plan, error)
                interrupt = error
        self.stats.record_step(self, plan, started, time.perf_counter())
        outputs = self._outputs(touched)
        if interrupt is not None:
            raise interrupt
        return outputs

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """The outputs of the requests a step touched; finished ones leave the engine."""
        outputs = []
        for request in touched:
            finished = request.group.is_finished
            if finished:
                request.metrics.finished_time = time.perf_counter()
                self.stats.record_finished(request.metrics, request.output_lengths())
            output = request.output(self._decode)
            if output is not None:
                outputs.append(output)
            if finished:
                del self._requests[request.request_id]
                self._forget(request)
        return outputs

    def check_invariants(self) -> None:
        """Check the KV blocks against the live sequences; RuntimeError on a violation.

        Every device and host block's reference count equals the number of live
        block tables (or reservations) holding it (so a block is free exactly
        when none does), the free counts agree, and the logical block count is
        the tables' total.
        """
        manager, step = self.block_manager, self.block_manager.step
        held = np.zeros(manager.num_device_blocks + 1, np.int64)
        held_on_host = np.zeros(manager.num_host_blocks, np.int64)
        logical = 0
        for request in self._requests.values():
            for seq in request.group.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    table = manager.block_table(seq).array
                    np.add.at(held, table, 1)
                    logical += len(table)
                elif seq.status is SequenceStatus.SWAPPED:
                    np.add.at(held_on_host, manager.host_block_table(seq).array, 1)
        np.add.at(held, manager.spare_blocks, 1)  # reserved for the sequences to come
        refcounts = np.array([step.refcount(b) for b in range(1, len(held))])
        host_refcounts = np.array([step.host_refcount(b) for b in range(len(held_on_host))])
        problems = [
            f"device block {b + 1}: refcount {refcounts[b]}, held by {held[b + 1]} tables"
            for b in np.flatnonzero(refcounts != held[1:])
        ] + [
            f"host block {b}: refcount {host_refcounts[b]}, held by {held_on_host[b]} tables"
            for b in np.flatnonzero(host_refcounts != held_on_host)
        ]
        if held[0]:
            problems.append(f"the null block is in {held[0]} tables")
        if manager.num_free_blocks != np.count_nonzero(refcounts == 0):
            problems.append(f"{manager.num_free_blocks} free device blocks, "
                            f"{np.count_nonzero(refcounts == 0)} unreferenced")
        if manager.num_free_host_blocks != np.count_nonzero(host_refcounts == 0):
            problems.append(f"{manager.num_free_host_blocks} free host blocks, "
                            f"{np.count_nonzero(host_refcounts == 0)} unreferenced")
        if manager.logical_blocks_used != logical:
            problems.append(f"logical blocks {manager.logical_blocks_used}, tables hold {logical}")
        if problems:
            raise RuntimeError("KV block invariants violated: " + "; ".join(problems[:5]))

    def _fail_step(self, plan: SchedulerOutput, error: BaseException) -> list[Request]:
        """Make the engine consistent after `plan`'s step raised; the requests it ends.

        The step's requests end with FINISHED_ERROR (their state may be half
        updated). Groups the step swapped out may hold garbage on the host: they
        recompute. If the device call consumed the donated KV cache, every
        device block is lost: the cache is allocated again, the prefix cache
        forgets its blocks and every running group recomputes.
        """
        self.last_step_error = error
        failed = list({id(r): r for r in (self._request_of_seq.get(seq.seq_id)
                                          for seq, _ in plan.scheduled) if r is not None}.values())
        logger.error("a step failed (%s: %s); its %d requests finish with finish_reason "
                     "'error'", type(error).__name__, error, len(failed))
        for request in failed:
            self._end_with_error(request)
        swapped_out = [g for g in plan.preempted if g.seqs_with(SequenceStatus.SWAPPED)]
        self.scheduler.recompute(swapped_out)
        if self.runner.kv_cache_lost():
            logger.error("the KV cache was lost with the step: reallocating it; running "
                         "requests recompute their tokens")
            self.runner.reset_kv_cache()
            self.scheduler.recompute([g for g in self.scheduler.running
                                      if g.seqs_with(SequenceStatus.RUNNING)])
            self.block_manager.reset_prefix_cache()
        return failed

    def _end_with_error(self, request: Request) -> None:
        """Finish every sequence of `request` with FINISHED_ERROR; live beams become its
        results."""
        if request.is_beam_search and request.beam_results is None:
            request.beam_results = [
                Hypothesis(request.beams[seq.seq_id], float("-inf"), "error")
                for seq in request.group.unfinished_seqs() if seq.seq_id in request.beams
            ]
        self.scheduler.fail(request.request_id)

    def _forget(self, request: Request) -> None:
        for seq in request.group.seqs:
            self._request_of_seq.pop(seq.seq_id, None)

    def _account_blocks(self) -> None:
        """Add this step's logical and physical blocks to each running request's metrics."""
        table = self.block_manager.block_table
        for group in self.scheduler.running:
            seqs = group.seqs_with(SequenceStatus.RUNNING)
            if not seqs:
                continue
            tables = [table(seq).array for seq in seqs]
            logical = sum(len(t) for t in tables)
            physical = logical if len(tables) == 1 else len(np.unique(np.concatenate(tables)))
            metrics = self._requests[group.request_id].metrics
            metrics.logical_block_steps += logical
            metrics.physical_block_steps += physical

    def _run(self, plan: SchedulerOutput) -> list[Request]:
        """Execute a non-empty plan on the device; the requests that got tokens."""
        scheduled = plan.scheduled
        self.runner.apply_block_ops(plan.block_ops)
        num_draws = sum(self._num_draws(seq, n) for seq, n in scheduled)
        model_input = build_model_input(scheduled, self.block_manager, self.buckets, num_draws)
        logits, hidden = self.runner.execute(model_input.input_ids, model_input.metadata,
                                             decode_only=model_input.decode_only,
                                             num_rows=model_input.num_rows)
        self._record_prompt_logprobs(scheduled, model_input.metadata.query_start_loc, hidden)
        ready = self.scheduler.update_after_step(plan)
        row_of = {seq.seq_id: row for row, (seq, _) in enumerate(scheduled)}
        draws = [(self._requests[g.request_id], self._draw_seqs(g, row_of)) for g in ready]
        if not draws:
            return []  # only prefill chunks that leave tokens for later
        rows = [row_of[seq.seq_id] for _, seqs in draws for seq in seqs]
        sampled = self._sample(logits, rows, [(r, s) for r, seqs in draws for s in seqs])
        first = 0
        for request, seqs in draws:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.perf_counter()
            indices = range(first, first + len(seqs))
            if not sampled.finite[first : first + len(seqs)].all():
                logger.error("request %r: NaN or infinite logits; it finishes with "
                             "finish_reason 'error'", request.request_id)
                self._end_with_error(request)
            elif request.is_beam_search:
                self._beam_step(request, seqs, sampled, indices)
            else:
                for seq, i in zip(seqs, indices, strict=True):
                    self._append_token(request, seq, sampled, i)
            first += len(seqs)
        return [request for request, _ in draws]

    def _num_draws(self, seq: Sequence, num_new_tokens: int) -> int:
        """Tokens drawn from `seq`'s logits this step: none before its last token is
        computed; n for a sampling prompt's first draw; else one."""
        if seq.num_computed_tokens + num_new_tokens < len(seq):
            return 0
        request = self._request_of_seq[seq.seq_id]
        if request.is_beam_search or len(request.group.seqs) > 1:
            return 1
        return request.group.num_samples

    def _draw_seqs(self, group: SequenceGroup, row_of: dict[int, int]) -> list[Sequence]:
        """The sequences of a ready group that draw a token now. A prompt with n > 1
        forks its samples first: they share its blocks and draw from its logits."""
        request = self._requests[group.request_id]
        if not request.is_beam_search and len(group.seqs) == 1 and group.num_samples > 1:
            parent = group.seqs[0]
            for index in range(1, group.num_samples):
                child = self.scheduler.fork(group, parent, next(self._seq_ids))
                request.samples[child.seq_id] = request.samples[parent.seq_id].fork(index)
                self._request_of_seq[child.seq_id] = request
                row_of[child.seq_id] = row_of[parent.seq_id]
        return group.unfinished_seqs()

    @property
    def _max_rows(self) -> int:
        """The largest padded row count of a step: max_num_seqs' bucket."""
        return bucket(self.config.max_num_seqs, self.buckets.min_num_seqs,
                      self.buckets.linear_step)

    def _sample(self, logits, rows: list[int], draws: list[tuple[Request, Sequence]]
                ) -> SamplerOutput:
        num_rows = sampler_rows(len(rows), self._max_rows)
        row_array = np.zeros(num_rows, np.int32)
        row_array[: len(rows)] = rows
        sampling_rows = [self._sampling_row(request, seq) for request, seq in draws]
        tensors = sampling_tensors(sampling_rows, num_rows, self.model_config.vocab_size)
        return self.runner.sample(logits, row_array, tensors, self.config.max_logprobs)

    def _sampling_row(self, request: Request, seq: Sequence) -> SamplingRow:
        params = request.params
        if request.is_beam_search:
            # Beams are chosen on the host from the candidates' log-probabilities.
            temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE else 1.0
            return SamplingRow.greedy(position=len(seq), logprob_temperature=temperature)
        suppressed = ()
        if len(seq.output_token_ids) < params.min_tokens:
            suppressed = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
        return SamplingRow.of(
            params, seed=request.seed, sample_index=request.samples[seq.seq_id].index,
            position=len(seq), prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids, suppressed_token_ids=suppressed,
        )

    def _append_token(self, request: Request, seq: Sequence, sampled: SamplerOutput,
                      i: int) -> None:
        token, params = int(sampled.tokens[i]), request.params
        entry = None
        if params.logprobs is not None:
            entry = self._logprob_entry(token, sampled.logprobs[i], sampled.ranks[i],
                                        sampled.top_ids[i, : params.logprobs],
                                        sampled.top_logprobs[i, : params.logprobs])
        status = request.append_token(seq, token, float(sampled.logprobs[i]), entry,
                                      self.eos_token_ids, self.max_model_len)
        if status is not None:
            self.scheduler.finish_seq(seq, status)

    def _beam_step(self, request: Request, seqs: list[Sequence], sampled: SamplerOutput,
                   indices: range) -> None:
        """Select the next beams; fork, extend and drop the group's sequences to match."""
        search, group = request.search, request.group
        k = search.num_candidates
        top_ids, top_logprobs = sampled.top_ids[indices, :k], sampled.top_logprobs[indices, :k]
        step_logprobs = [self._candidates_entry(ids, lps)
                         for ids, lps in zip(top_ids, top_logprobs, strict=True)]
        parents = [request.beams[seq.seq_id] for seq in seqs]
        result = search.step(parents, top_ids, top_logprobs, step_logprobs)
        if result.done:
            final = [search.extend(parents[e.parent], e, step_logprobs[e.parent])
                     for e in result.extensions]
            request.beam_results = search.results(final)
            for seq in seqs:
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
            return
        extensions_of = {p: [e for e in result.extensions if e.parent == p]
                         for p in range(len(seqs))}
        # Drop first: with share_blocks=False their blocks pay for the forks' copies.
        for p, seq in enumerate(seqs):
            if not extensions_of[p]:
                self.scheduler.remove_seq(group, seq)
                del request.beams[seq.seq_id]
                del self._request_of_seq[seq.seq_id]
        for p, extensions in extensions_of.items():
            if not extensions:
                continue
            parent = seqs[p]
            # Fork before appending: every child starts from the parent's tokens.
            targets = [parent] + [self.scheduler.fork(group, parent, next(self._seq_ids))
                                  for _ in extensions[1:]]
            for seq, extension in zip(targets, extensions, strict=True):
                seq.append_token(extension.token)
                request.beams[seq.seq_id] = search.extend(parents[p], extension,
                                                          step_logprobs[p])
                self._request_of_seq[seq.seq_id] = request

    def _record_prompt_logprobs(self, scheduled, query_start_loc: np.ndarray,
                                hidden: jax.Array) -> None:
        """Log-probabilities of the prompt tokens this step's hidden states predict, for
        the requests that asked (each prompt position once, even after preemption)."""
        targets = np.zeros(hidden.shape[0], np.int32)
        wanted: list[tuple[Request, int, int]] = []  # (request, token row, target)
        for i, (seq, num_new_tokens) in enumerate(scheduled):
            request = self._request_of_seq[seq.seq_id]
            if not request.wants_prompt_logprobs or any(r is request for r, _, _ in wanted):
                continue
            start = seq.num_computed_tokens
            # Position p predicts prompt token p + 1.
            first = max(start, len(request.prompt_logprobs) - 1)
            end = min(start + num_new_tokens, seq.num_prompt_tokens - 1)
            for position in range(first, end):
                row = int(query_start_loc[i]) + position - start
                targets[row] = seq.prompt_token_ids[position + 1]
                wanted.append((request, row, int(targets[row])))
        if not wanted:
            return
        logprobs, ranks, top_ids, top_logprobs = self.runner.token_logprobs(
            hidden, targets, self.config.max_logprobs)
        for request, row, target in wanted:
            k = request.params.prompt_logprobs
            request.prompt_logprobs.append(self._logprob_entry(
                target, logprobs[row], ranks[row], top_ids[row, :k], top_logprobs[row, :k]))

    # Token texts.

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_entry(self, token: int, logprob, rank, top_ids, top_logprobs) -> dict:
        """{token: Logprob} for the chosen token, then the top ones by rank."""
        entry = {token: Logprob(float(logprob), int(rank), self._token_text(token))}
        entry.update(self._candidates_entry(top_ids, top_logprobs))
        return entry

    def _candidates_entry(self, top_ids, top_logprobs) -> dict:
        return {
            int(t): Logprob(float(lp), rank, self._token_text(int(t)))
            for rank, (t, lp) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1)
        }

    # Compilation.

    def warmup(self) -> int:
        """Compile every step shape the limits allow, so serving never compiles:
        the model steps, the logits and the sampler's four variants (greedy or
        drawing, with or without penalties) for every row count, and the prompt
        log-probabilities.

        XLA compiles without holding the GIL, so the compiles run in one thread per
        core; each step shape then runs once, from the compiled cache, on the
        donated KV cache (which threads cannot share).

        returns the number of (token, sequence, block) bucket shapes run.
        """
        shapes = step_shapes(
            self.buckets, self.config.max_num_batched_tokens, self.config.max_num_seqs,
            -(-self.max_model_len // self.config.block_size),
        )
        row_counts = sorted({s for _, s, _, decode_only in shapes if decode_only})
        # One thread per core; os.sched_getaffinity would exist on Linux only.
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            jobs = [pool.submit(self.runner.compile_step, *shape) for shape in shapes]
            jobs += [pool.submit(call) for call in self._sampling_warmup_calls(row_counts)]
            for job in jobs:
                job.result()
        for shape in shapes:
            self.runner.run_padding_step(*shape)
        return len(shapes)

    def _sampling_warmup_calls(self, row_counts: list[int]) -> list[Callable[[], Any]]:
        """Calls that compile what follows a step of each row count: its logits, the
        gathers of its rows for the sampler, the sampler's variants for each padded
        row count, and the prompt log-probabilities. Each runs on its own zeros."""
        vocab, hidden_size = self.model_config.vocab_size, self.model_config.hidden_size
        dtype = self.runner.kv_caches[0].dtype
        runner, num_top = self.runner, self.config.max_logprobs
        mixed_rows = self.buckets.mixed_num_seqs
        calls = []
        for num_rows in row_counts:
            if mixed_rows >= num_rows:  # a mixed step's logits of its rows in use
                calls.append(partial(runner.logits, jnp.zeros((mixed_rows, hidden_size), dtype),
                                     num_rows))
            calls += [partial(runner.gather_rows, jnp.zeros((num_rows, vocab), jnp.float32),
                              np.zeros(padded, np.int32))
                      for padded in {sampler_rows(n, self._max_rows)
                                     for n in range(1, num_rows + 1)}]
        variants = [SamplingRow.greedy(position=0, temperature=temperature, **penalty)
                    for temperature in (0.0, 1.0)
                    for penalty in ({}, {"repetition_penalty": 1.5})]
        for padded in {sampler_rows(n, self._max_rows) for n in range(1, row_counts[-1] + 1)}:
            logits = jnp.zeros((padded, vocab), jnp.float32)
            calls += [partial(runner.sample, logits, np.zeros(padded, np.int32),
                              sampling_tensors([variant], padded, vocab), num_top)
                      for variant in variants]
        calls.append(partial(runner.token_logprobs, jnp.zeros((1, hidden_size), dtype),
                             np.zeros(1, np.int32), num_top))
        return calls


def step_shapes(
    buckets: BucketSizes, max_tokens: int, max_seqs: int, max_blocks: int
) -> list[tuple[int, int, int, bool]]:
    """Every padded (tokens, sequences, blocks per sequence, decode_only) a step can take.

    A step runs 1..max_seqs sequences with at least one new token each, and at
    most max_tokens tokens; decode-only steps have one token per sequence. Its
    sequence rows may be more than its sequences, up to max_seqs: the draws of
    parallel samples (`build_model_input`'s min_rows).
    """
    row_buckets = sorted({bucket(n, buckets.min_num_seqs, buckets.linear_step)
                          for n in range(1, max_seqs + 1)})
    # A mixed step of t tokens may hold 1..t-1 sequences, and any rows up to max_seqs.
    mixed = {
        (*padded_sizes(num_tokens, num_rows, buckets, False)[:2], False)
        for num_tokens in range(2, max_tokens + 1)
        for num_rows in row_buckets
    }
    decode = {
        (*padded_sizes(num_seqs, num_rows, buckets, True)[:2], True)
        for num_seqs in range(1, min(max_seqs, max_tokens) + 1)
        for num_rows in row_buckets
        if num_rows >= num_seqs
    }
    token_seq_pairs = mixed | decode
    block_sizes = {bucket(n, buckets.min_blocks_per_seq) for n in range(1, max_blocks + 1)}
    return sorted(
        (num_tokens, num_seqs, num_blocks, decode_only)
        for num_tokens, num_seqs, decode_only in token_seq_pairs
        for num_blocks in block_sizes
    )
