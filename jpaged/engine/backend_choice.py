"""Which attention backend the model runner starts on: the configured one, else the
device's own kernel, else (when that kernel cannot run here) the next that can: Mosaic
GPU hands over to Triton, both Pallas GPU/TPU kernels to the XLA implementation."""

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
    cannot, this warns and runs the next of kernels_pallas.FALLBACKS (Mosaic GPU, then
    Triton, then "xla"), while an explicitly requested backend raises instead.
    config must have its machine defaults.
    """
    requested = config.attention_backend
    args = (config, model, model_config, num_blocks, num_host_blocks, max_model_len, mesh,
            groups)
    if requested is not None:
        try:
            return _runner_on(requested, *args)
        except ValueError:
            raise
        except Exception as error:
            raise RuntimeError(
                f"attention_backend={requested!r} cannot run on this "
                f"{jax.default_backend()} device: {type(error).__name__}: {error}"
            ) from error
    backend = device_attention_backend()
    while backend in kernels_pallas.FALLBACKS:
        try:
            return _runner_on(backend, *args)
        except Exception as error:
            reason = f"{type(error).__name__}: {error}"
            # Hopper's float32 caches (the default dtype) are Triton's by design: no warning.
            quiet = backend == "mosaic_gpu" and isinstance(error, ValueError)
        # Out of the except block, so the failed runner and its KV cache are freed first.
        logger.log(logging.INFO if quiet else logging.WARNING,
                   "the default %r attention kernel cannot run on this %s device (%s); "
                   "using the %r implementation", backend, jax.default_backend(), reason,
                   kernels_pallas.FALLBACKS[backend])
        backend = kernels_pallas.FALLBACKS[backend]
    return _runner_on(backend, *args)


def _runner_on(backend: AttentionBackend, config: EngineConfig, model, model_config, num_blocks,
               num_host_blocks, max_model_len, mesh, groups) -> tuple[ModelRunner, StepShapes]:
    dtype = config.kv_dtype
    pallas = backend in ("tpu", "mosaic_gpu", "triton")
    if backend == "mosaic_gpu" and not config.interpret and (
            reason := kernels_pallas.mosaic_gpu_support()):
        raise RuntimeError(reason)
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
