"""The server's Prometheus metrics: the engine's state, and per-request latencies and tokens."""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jpaged.engine.async_engine import AsyncLLMEngine
from jpaged.engine.stats import LoRACounts, SpecDecodeCounts
from jpaged.entrypoints.protocol import PromptRun
from jpaged.memory.host_tier import HostPoolCounts
from jpaged.outputs import RequestOutput
from jpaged.structured_output.counts import StructuredOutputCounts


class EngineCollector:
    """Prometheus gauges and counters read from the engine's published state."""

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    def collect(self):
        state = self.engine.state
        gauges = (
            ("num_requests_running", "Requests whose sequences run on the device.",
             state.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", state.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", state.num_swapped),
            ("kv_cache_blocks_used", "Device KV blocks held by live sequences or reserved "
             "prefixes.", state.kv_blocks_used),
            ("kv_cache_blocks_total", "Device KV blocks in the pool.", state.kv_blocks_total),
            ("kv_cache_blocks_reserved", "Device KV blocks held by reserved prefixes "
             "(kv_cache_blocks_used counts them too).", state.kv_blocks_reserved),
            ("kv_cache_usage_perc", "Fraction of device KV blocks in use (0 to 1).",
             state.kv_usage),
            ("prefix_cache_hit_rate", "Fraction of admitted prompt tokens found in the "
             "prefix cache.", state.prefix_cache_hit_rate),
            ("kv_cache_bytes_per_token", "KV bytes of one token on one device (with the "
             "scales of a quantized cache).", state.kv_bytes_per_token),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"jpaged:{name}", documentation, value=value)
        yield from _counters((
            ("num_preemptions", "Sequence groups preempted.", state.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens of admitted requests looked up in the "
             "prefix cache.", state.prefix_cache_query_tokens),
            ("prefix_cache_hits", "Of those, tokens the prefix cache served (device and host "
             "tier).", state.prefix_cache_hit_tokens),
            ("prefix_cache_tier_hits", "Of those, tokens loaded from the prefix cache's host "
             "tier.", state.prefix_cache_tier_hit_tokens)))
        yield from _host_pool_metrics(state.host_pool)
        per_group = GaugeMetricFamily(
            "jpaged:kv_cache_group_blocks_used",
            "Block-table entries of each KV cache group (sliding-window and global layers).",
            labels=["group"])
        for group, blocks in enumerate(state.kv_group_blocks_used):
            per_group.add_metric([str(group)], blocks)
        yield per_group
        dtype = GaugeMetricFamily("jpaged:kv_cache_dtype_info",
                                  "What the KV cache stores (1 for the dtype in use).",
                                  labels=["dtype"])
        dtype.add_metric([state.kv_cache_dtype], 1)
        yield dtype
        yield from _spec_decode_metrics(state.spec_decode)
        yield from _structured_output_metrics(state.structured_outputs)
        yield from _lora_metrics(state.lora)
        fallbacks = CounterMetricFamily(
            "jpaged:mode_fallbacks", "Defaults that gave way to another setting, and steps "
            "that ran another way than the engine's step mode (jpaged.core.step_modes).",
            labels=["fallback"])
        for name, count in sorted(state.mode_fallbacks.items()):
            fallbacks.add_metric([name], count)
        yield fallbacks


def _counters(rows):
    """A counter for each (name, documentation, value)."""
    for name, documentation, value in rows:
        yield CounterMetricFamily(f"jpaged:{name}", documentation, value=value)


def _host_pool_metrics(pool: HostPoolCounts):
    """The host pool's blocks and bytes, and the tier's traffic (all 0 without a pool)."""
    gauges = (
        ("kv_offload_blocks_total", "Blocks of the host pool (kv_offloading_size).",
         pool.num_blocks),
        ("kv_offload_bytes_total", "Bytes of the host pool.", pool.num_bytes),
        ("kv_offload_blocks_swapped", "Host blocks held by swapped-out sequences.",
         pool.swapped_blocks),
        ("kv_offload_blocks_cached", "Host blocks holding the prefix cache tier's copies.",
         pool.cached_blocks))
    for name, documentation, value in gauges:
        yield GaugeMetricFamily(f"jpaged:{name}", documentation, value=value)
    yield from _counters((
        ("kv_offload_stored_blocks", "Prefix-cached blocks copied to the host tier.",
         pool.stored_blocks),
        ("kv_offload_loaded_blocks", "Host tier blocks loaded back for a prefix hit.",
         pool.loaded_blocks),
        ("kv_offload_bytes_moved", "Bytes the host tier copied to the host and back.",
         pool.bytes_moved)))


def _spec_decode_metrics(counts: SpecDecodeCounts):
    """Speculative decoding's counters, with vLLM's names (all 0 without it)."""
    yield from _counters((
        ("spec_decode_num_drafts", "Verifications of a sequence's proposals.",
         counts.num_drafts),
        ("spec_decode_num_draft_tokens", "Tokens proposed.", counts.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.",
         counts.num_accepted_tokens)))
    per_pos = CounterMetricFamily("jpaged:spec_decode_num_accepted_tokens_per_pos",
                                  "Verifications that accepted the proposal at each position.",
                                  labels=["position"])
    for position, value in enumerate(counts.num_accepted_tokens_per_pos):
        per_pos.add_metric([str(position)], value)
    yield per_pos


def _structured_output_metrics(counts: StructuredOutputCounts):
    """What structured outputs cost so far (all 0 without them)."""
    yield from _counters((
        ("structured_output_requests", "Requests with a grammar.", counts.requests),
        ("grammar_compile_seconds", "Time spent compiling grammars.", counts.compile_seconds),
        ("grammar_cache_hits", "Requests whose grammar was compiled already.",
         counts.cache_hits),
        ("grammar_cache_misses", "Requests whose grammar compiled.", counts.cache_misses),
        ("token_mask_fill_steps", "Steps that filled grammars' token masks.",
         counts.fill_steps),
        ("token_mask_fill_rows", "Token masks filled.", counts.fill_rows),
        ("token_mask_fill_seconds", "Time spent filling token masks.", counts.fill_seconds)))


def _lora_metrics(counts: LoRACounts):
    """The LoRA adapter slots beside the KV pool, their loads, and the requests of each
    adapter (all 0 without LoRA); lora_requests_info is vLLM's series."""
    gauges = (
        ("lora_slot_bytes", "Bytes of the LoRA adapter slots on one device, taken off the "
         "KV pool's budget.", counts.slot_bytes),
        ("lora_slots_total", "LoRA adapter slots on the device (max_loras).",
         counts.slots_total),
        ("lora_slots_loaded", "Slots holding an adapter.", counts.slots_loaded),
        ("lora_slots_in_use", "Slots running requests use (never reassigned while used).",
         counts.slots_in_use))
    for name, documentation, value in gauges:
        yield GaugeMetricFamily(f"jpaged:{name}", documentation, value=value)
    yield from _counters((
        ("lora_loads", "Adapters put into a device slot.", counts.loads),
        ("lora_reads", "Adapters read from disk and checked (the host cache's misses).",
         counts.reads),
        ("lora_read_seconds", "Time spent reading and checking adapters.",
         counts.read_seconds)))
    for queue, per_adapter in (("running", counts.running), ("waiting", counts.waiting)):
        family = GaugeMetricFamily(f"jpaged:lora_requests_{queue}",
                                   f"Requests {queue} with each LoRA adapter.",
                                   labels=["lora_name"])
        for name, value in sorted(per_adapter.items()):
            family.add_metric([name], value)
        yield family
    info = GaugeMetricFamily(
        "jpaged:lora_requests_info", "The adapters of running and waiting requests, as "
        "labels (vLLM's vllm:lora_requests_info); the value is when it was read.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(counts.slots_total), ",".join(sorted(counts.running)),
                     ",".join(sorted(counts.waiting))], time.time())
    yield info


class ServerMetrics:
    """A Prometheus registry for one app: engine state plus per-request latencies and
    token counts, observed when each request finishes."""

    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                       60.0, 120.0)

    def __init__(self, engine: AsyncLLMEngine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time from arrival to the first output token.")
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Mean time per output token after the first.")
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "Time from arrival to the last output token.")
        self.prompt_tokens = Counter("jpaged:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("jpaged:generation_tokens",
                                         "Output tokens of finished requests.",
                                         registry=self.registry)

    def _histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(f"jpaged:{name}", documentation, buckets=self.LATENCY_BUCKETS,
                         registry=self.registry)

    def observe_finished(self, run: PromptRun, output: RequestOutput) -> None:
        metrics = output.metrics
        self.prompt_tokens.inc(len(run.prompt.token_ids))
        self.generation_tokens.inc(run.num_output_tokens)
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        tpot = metrics.tpot(max((len(o.token_ids) for o in run.outputs.values()), default=0))
        if tpot is not None:
            self.tpot.observe(tpot)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
