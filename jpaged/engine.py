"""LLMEngine: continuous batching of requests over a paged KV cache.

Each `step()` is one iteration of the serving loop:

    scheduler.schedule()        host: which sequences run, how many tokens each,
                                block tables grown (copy-on-write, swaps)
    runner.apply_block_ops()    device: block copies and swaps
    build_model_input()         host: padded int32 gather indices
    runner.execute()            device: the jit-compiled model step
    sample()                    device: one token per sequence
    scheduler.update_after_step host: computed tokens, prefix-cache registration
    append / stop checks        host: finished sequences free their blocks at once
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.batch_builder import BucketSizes, bucket, build_model_input
from jpaged.block_manager import BlockManager
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.loader import cache_directory, load_model
from jpaged.model import LlamaConfig
from jpaged.outputs import FINISH_REASONS, CompletionOutput, RequestMetrics, RequestOutput
from jpaged.runner import AttentionBackend, ModelRunner
from jpaged.sampler import sample, sampling_arrays
from jpaged.sampling_params import SamplingParams
from jpaged.scheduler import Scheduler, SchedulerOutput
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.stats import EngineStats

logger = logging.getLogger("jpaged")

Prompt = str | list[int] | list[dict[str, str]]


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs to start.

    The KV pool is `num_blocks` blocks if given, else `kv_cache_memory` bytes if
    given, else `kv_cache_fraction` of the device memory free after loading the
    model; never more than max_num_seqs full-length sequences can use. Step
    shapes pad to `buckets`, by default `default_buckets` of the attention backend.
    """

    model: str = "smollm2"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.25
    num_host_blocks: int = 0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    attention_backend: AttentionBackend | None = None
    interpret: bool = False
    buckets: BucketSizes | None = None
    persistent_compilation_cache: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV pool's size, as reported at start-up."""

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


@dataclass
class _Request:
    group: SequenceGroup
    params: SamplingParams
    prompt: str | None
    seed: int
    metrics: RequestMetrics


def use_persistent_compilation_cache() -> None:
    """Keep compiled steps on disk (under the jpaged cache) unless the user chose a place:
    a process that serves the same shapes again loads them instead of compiling."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_directory() / "xla"))


def free_device_memory() -> int:
    """Bytes free on the default device (host RAM when the device is a CPU)."""
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_num_blocks(
    config: EngineConfig, model_config: LlamaConfig, max_model_len: int, bytes_per_token: int
) -> int:
    """Blocks in the device pool (the null block included), from the config's budget."""
    blocks_per_seq = -(-max_model_len // config.block_size)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        budget = config.kv_cache_memory or int(config.kv_cache_fraction * free_device_memory())
        useful = config.max_num_seqs * blocks_per_seq + 1
        num_blocks = min(budget // (bytes_per_token * config.block_size), useful)
    if num_blocks - 1 < blocks_per_seq:
        raise ValueError(
            f"the KV pool holds {max(num_blocks - 1, 0)} blocks of {config.block_size} tokens "
            f"but one sequence of max_model_len={max_model_len} tokens needs {blocks_per_seq}; "
            "give more num_blocks / kv_cache_memory or a smaller max_model_len"
        )
    return num_blocks


def default_buckets(attention_backend: AttentionBackend, max_blocks_per_seq: int) -> BucketSizes:
    """Padded step shapes: token and sequence counts by powers of two, then multiples
    of 16. The XLA loop stops each tile at its own context, so there the block
    table can always have full width: one width instead of several, a fraction of
    the compiles. The reference gathers the whole table and the TPU kernel
    prefetches it into scalar memory, so other backends get power-of-two widths
    from 8."""
    min_blocks = max_blocks_per_seq if attention_backend == "xla" else 8
    return BucketSizes(min_num_tokens=1, min_num_seqs=1, min_blocks_per_seq=min_blocks,
                       linear_step=16)


class LLMEngine:
    """add_request / step / abort / has_unfinished_requests over a loaded model."""

    def __init__(
        self, config: EngineConfig, *, loaded: tuple[Any, LlamaConfig, Any] | None = None
    ):
        """loaded: (model, model_config, tokenizer) already in memory, else config.model loads."""
        self.config = config
        if config.persistent_compilation_cache:
            use_persistent_compilation_cache()
        model, self.model_config, self.tokenizer = loaded or load_model(config.model, config.dtype)
        model_max = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(model_max, 2048), model_max)
        dtype = jnp.dtype(config.dtype)
        bytes_per_token = (
            2 * self.model_config.num_layers * self.model_config.num_kv_heads
            * self.model_config.head_dim * dtype.itemsize
        )
        num_blocks = kv_cache_num_blocks(config, self.model_config, self.max_model_len,
                                         bytes_per_token)
        self.kv_cache_info = KVCacheInfo(num_blocks, config.block_size, bytes_per_token)
        logger.info("%s", self.kv_cache_info)
        self.block_manager = BlockManager(CacheConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            num_host_blocks=config.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
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
        self.runner = ModelRunner(
            model, self.model_config,
            num_blocks=num_blocks, block_size=config.block_size,
            num_host_blocks=config.num_host_blocks, kv_dtype=dtype,
            attention_backend=config.attention_backend, interpret=config.interpret,
        )
        self.buckets = config.buckets or default_buckets(
            self.runner.attention_backend, -(-self.max_model_len // config.block_size)
        )
        eos, tokenizer_eos = self.model_config.eos_token_ids, self.tokenizer.eos_token_id
        self.eos_token_ids = eos if tokenizer_eos in (None, *eos) else (*eos, tokenizer_eos)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._request_of_seq: dict[int, _Request] = {}
        self._seq_ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)

    # Requests.

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError/TypeError, changing nothing, on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        seq = Sequence(next(self._seq_ids), token_ids)
        now = time.perf_counter()
        group = SequenceGroup(request_id, [seq], arrival_time=now, cache_salt=cache_salt)
        self.scheduler.add_request(group)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        text = prompt if isinstance(prompt, str) else None
        request = _Request(group, params, text, seed, RequestMetrics(now))
        self._requests[request_id] = request
        self._request_of_seq[seq.seq_id] = request

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown ids are ignored."""
        self.scheduler.abort(request_id)
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._forget(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt (text, chat messages or token ids) as validated token ids."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True
            )
            token_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        elif isinstance(prompt, list) and all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"token ids {bad[:5]} are outside the vocabulary [0, "
                    f"{self.model_config.vocab_size})"
                )
        else:
            raise TypeError(
                "a prompt must be a str, a list of token ids or a list of chat messages "
                f"(dicts), got {type(prompt).__name__}"
            )
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        return token_ids

    # One iteration.

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample once; outputs of the requests that made progress."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        finished = [self._requests[g.request_id] for g in plan.ignored]
        sampled: list[_Request] = []
        if not plan.is_empty:
            sampled = self._run(plan)
        self.stats.record_step(self, plan, started, time.perf_counter())
        done = finished + [r for r in sampled if r.group.is_finished]
        for request in done:
            request.metrics.finished_time = time.perf_counter()
            self.stats.record_finished(request.metrics, len(request.group.seqs[0].output_token_ids))
        outputs = [self._output(r) for r in finished + sampled]
        for request in done:
            del self._requests[request.group.request_id]
            self._forget(request)
        return outputs

    def _forget(self, request: _Request) -> None:
        for seq in request.group.seqs:
            self._request_of_seq.pop(seq.seq_id, None)

    def _run(self, plan: SchedulerOutput) -> list[_Request]:
        """Execute a non-empty plan on the device; the requests that got a token."""
        seqs = [seq for seq, _ in plan.scheduled]
        requests = [self._request_of_seq[seq.seq_id] for seq in seqs]
        self.runner.apply_block_ops(plan.block_ops)
        model_input = build_model_input(plan.scheduled, self.block_manager, self.buckets)
        decode_only = model_input.num_tokens == model_input.num_seqs
        logits = self.runner.execute(model_input.input_ids, model_input.metadata,
                                     decode_only=decode_only)
        arrays = sampling_arrays(
            [r.params for r in requests], [r.seed for r in requests],
            [len(seq.output_token_ids) for seq in seqs], logits.shape[0],
        )
        tokens = np.asarray(sample(logits, *arrays))
        row_of = {seq.seq_id: row for row, seq in enumerate(seqs)}
        sampled = []
        for group in self.scheduler.update_after_step(plan):
            request = self._requests[group.request_id]
            for seq in group.unfinished_seqs():
                self._append_token(request, seq, int(tokens[row_of[seq.seq_id]]))
            sampled.append(request)
        return sampled

    def _append_token(self, request: _Request, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.perf_counter()
        params = request.params
        stop_ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
        if token in stop_ids:
            self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED)
        elif len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_model_len:
            self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)

    def _output(self, request: _Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True),
                token_ids=list(seq.output_token_ids),
                finish_reason=FINISH_REASONS.get(seq.status),
            )
            for i, seq in enumerate(request.group.seqs)
        ]
        group = request.group
        return RequestOutput(
            request_id=group.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            outputs=completions,
            finished=group.is_finished,
            metrics=dataclasses.replace(request.metrics),
        )

    # Compilation.

    def warmup(self) -> int:
        """Compile every step shape the limits allow, so serving never compiles.

        returns the number of (token, sequence, block) bucket shapes run.
        """
        shapes = step_shapes(
            self.buckets, self.config.max_num_batched_tokens, self.config.max_num_seqs,
            -(-self.max_model_len // self.config.block_size),
        )
        for num_tokens, num_seqs, num_blocks, decode_only in shapes:
            self.runner.run_padding_step(num_tokens, num_seqs, num_blocks, decode_only)
        for num_seqs in sorted({s for _, s, _, _ in shapes}):
            zeros = np.zeros((num_seqs, self.model_config.vocab_size), np.float32)
            sample(zeros, *sampling_arrays([], [], [], num_seqs)).block_until_ready()
        return len(shapes)


def step_shapes(
    buckets: BucketSizes, max_tokens: int, max_seqs: int, max_blocks: int
) -> list[tuple[int, int, int, bool]]:
    """Every padded (tokens, sequences, blocks per sequence, decode_only) a step can take.

    A step runs 1..max_seqs sequences with at least one new token each, and at
    most max_tokens tokens; decode-only steps have one token per sequence.
    """
    token_seq_pairs = {
        (bucket(num_tokens, buckets.min_num_tokens, buckets.linear_step),
         bucket(num_seqs, buckets.min_num_seqs, buckets.linear_step), num_tokens == num_seqs)
        for num_seqs in range(1, min(max_seqs, max_tokens) + 1)
        for num_tokens in range(num_seqs, max_tokens + 1)
    }
    block_sizes = {bucket(n, buckets.min_blocks_per_seq) for n in range(1, max_blocks + 1)}
    return sorted(
        (num_tokens, num_seqs, num_blocks, decode_only)
        for num_tokens, num_seqs, decode_only in token_seq_pairs
        for num_blocks in block_sizes
    )
