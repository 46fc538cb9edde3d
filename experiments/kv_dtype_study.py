"""KV cache dtypes on the real engine at one pool in bytes: capacity and sustained rate.

float32, bfloat16 and int8 caches (int8 with a float32 scale per token and KV head)
serve the rate study's ShareGPT-like requests on the default model, each engine's
pool holding the tokens its bytes buy, with the rate study's rules
(experiments.rate_study), fixed before measuring:

- Budget: the rate study's pool of float32 tokens, in bytes; each dtype's engine
  holds that many bytes' worth of its own tokens, in whole blocks.
- Capacity: each dtype serves the requests all at once; requests over virtual
  seconds is its capacity.
- Threshold: the rate study's factor times float32's mean normalized latency at
  its base fraction of float32's capacity; each dtype's rate is found by the same
  bracketing search on fractions of its own capacity.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from experiments import rate_study
from experiments.engine_runs import make_engine, serve

KV_CACHE_DTYPES = ("float32", "bfloat16", "int8")


def run(loaded, settings: rate_study.RateSettings, vocab_size: int) -> dict:
    """Capacities, latency curves and sustained rates of each KV cache dtype."""
    from jpaged.engine.kv_cache_sizing import bytes_per_token

    model_config = loaded[1]
    burst = rate_study.workload(settings, vocab_size)
    float32_tokens = rate_study.pool_tokens(burst, settings)
    token_bytes = {dtype: bytes_per_token(model_config, jnp.dtype(dtype))
                   for dtype in KV_CACHE_DTYPES}
    pool_bytes = float32_tokens * token_bytes["float32"]
    servers = {
        dtype: make_engine(loaded, allocation="paged", block_size=settings.block_size,
                           num_pool_tokens=pool_bytes // token_bytes[dtype],
                           max_num_seqs=settings.max_num_seqs,
                           max_num_batched_tokens=settings.max_num_batched_tokens,
                           max_model_len=settings.max_model_len, kv_cache_dtype=dtype)
        for dtype in KV_CACHE_DTYPES
    }
    at_once = {dtype: serve(server, burst, f"{settings.dataset} {dtype} KV all at once").summary()
               for dtype, server in servers.items()}
    capacity = {dtype: settings.num_requests / r["virtual_s"] for dtype, r in at_once.items()}
    result = {
        "settings": dataclasses.asdict(settings) | {"length_scale": settings.length_scale},
        "mean_prompt_len": float(np.mean([len(r.prompt_token_ids) for r in burst])),
        "mean_output_len": float(np.mean([r.output_len for r in burst])),
        "pool_bytes": pool_bytes,
        "bytes_per_token": token_bytes,
        "pool_tokens": {dtype: pool_bytes // b for dtype, b in token_bytes.items()},
        "capacity_requests_per_s": capacity,
        "capacity_ratios_vs_float32": ratios(capacity),
        "all_at_once": at_once,
    }
    if settings.curves:
        result |= rate_study.latency_curves(servers, settings, vocab_size, capacity)
        result["rate_ratios_vs_float32"] = ratios(
            {dtype: s["rate"] for dtype, s in result["sustained_rate"].items()})
    return result


def ratios(values: dict[str, float]) -> dict[str, float]:
    """Each dtype's value over float32's."""
    return {dtype: value / values["float32"] for dtype, value in values.items()
            if dtype != "float32"}
