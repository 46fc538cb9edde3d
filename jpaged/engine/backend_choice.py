"""Which attention backend the model runner starts on: the configured one, else the
device's own kernel, else (when that kernel cannot run here) the XLA implementation."""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

import kernels_pallas
from jpaged.core.step_shapes import StepShapes, blocks_per_seq, default_buckets
from jpaged.engine.config import EngineConfig
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.model.llama import LlamaConfig, LlamaForCausalLM
from jpaged.worker.model_runner import AttentionBackend, ModelRunner, device_attention_backend

logger = logging.getLogger("jpaged")


def start_runner(config: EngineConfig, model: LlamaForCausalLM, model_config: LlamaConfig, *,
                 num_blocks: int, num_host_blocks: int, max_model_len: int, mesh: Mesh | None,
                 groups: KVCacheGroups) -> tuple[ModelRunner, StepShapes]:
    """The runner on the configured backend or else the device's own, and its step shapes.

    A Pallas kernel must accept the cache layout and compile on this device
    (checked here, on the smallest step shapes); if the device's own kernel
    cannot, this warns and runs the "xla" implementation, while an explicitly
    requested backend raises instead. config must have its machine defaults.
    """
    requested = config.attention_backend
    backend = requested or device_attention_backend()
    try:
        return _runner_on(backend, config, model, model_config, num_blocks, num_host_blocks,
                          max_model_len, mesh, groups)
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
    return _runner_on("xla", config, model, model_config, num_blocks, num_host_blocks,
                      max_model_len, mesh, groups)


def _runner_on(backend: AttentionBackend, config: EngineConfig, model, model_config, num_blocks,
               num_host_blocks, max_model_len, mesh, groups) -> tuple[ModelRunner, StepShapes]:
    dtype = config.kv_dtype
    pallas = backend in ("tpu", "triton")
    if pallas:
        kernels_pallas.check_cache_layout(backend, dtype, config.block_size,
                                          model_config.head_dim)
    runner = ModelRunner(
        model, model_config, num_blocks=num_blocks, block_size=config.block_size,
        num_host_blocks=num_host_blocks, kv_dtype=dtype, attention_backend=backend,
        interpret=config.interpret, mesh=mesh, groups=groups,
        logit_rows_per_seq=1 + config.num_speculative_tokens,
    )
    max_blocks = blocks_per_seq(max_model_len, config.block_size)
    buckets = config.buckets or default_buckets(backend, max_blocks, config.max_num_seqs)
    shapes = StepShapes(buckets, config.max_num_seqs, config.max_num_batched_tokens, max_blocks,
                        config.num_speculative_tokens)
    if pallas:
        for decode_only in (True, False):
            runner.run_padding_step(*shapes.smallest(decode_only))
    return runner, shapes
