"""The paper's Figure 17 on the engine, and conversations replayed with their KV kept.

Synthetic conversations (experiments.conversations) at lengths scaled by N / 1,024,
where N is the prompt cut and the output cap together (the paper's 1,024 / 1,024 scaled
to what a CPU serves in the sweep's time):

- Figure 17 (`figure17`): each request one round, its prompt the history and question
  cut to the last N tokens, its output capped at N; no KV kept between rounds (prefix
  caching off); paged against Orca (Max), (Pow2) and (Oracle) on one pool, the paper's
  pool per token of max_model_len (OPT-13B on an A100-40GB: 15,728 slots for 2,048
  tokens) times the 2N tokens a request may hold here. Requests: three times what the
  pool holds for orca-oracle; the rate study's rules (experiments.rate_study.RateRules).
  The paper's Orca reserves through a buddy allocator, which rounds a request's slab up
  to a power of two, so with prompts at 1,024 its three baselines coincide; this
  project's Orca (Oracle) reserves the true length and Pow2 the prompt plus the next
  power of two of the output, so they need not.
- The replay (`replay`), past the paper: conversations whose next round arrives
  `think_s` after the answer before it, their prompts the whole history, one run per
  arm, the device pool below the conversations' history: no cache; the device's prefix
  cache; the device cache and a host tier (`kv_offloading_size`); and a control whose
  device pool alone has the tier's bytes. On this CPU the device pool and the host tier
  are the same memory: the control is what the tier's bytes would buy as device
  memory. Time to first token (mean and p90) and output throughput per arm.
- What a prefix hit saves against what a tier hit costs, per block (`block_costs`):
  recomputing a prompt's blocks against copying them from host memory into the pool,
  on an idle engine; and the step-cost model's projection of both for a GPU at a stated
  PCIe bandwidth.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from experiments.accelerator_study import PAPER_DEVICE, paper_pool_tokens
from experiments.block_size_study import operation_seconds
from experiments.conversations import (
    SOURCE,
    ConversationShape,
    Replay,
    chatbot_requests,
    make_conversations,
)
from experiments.engine_runs import make_engine, serve
from experiments.paper import FIGURE17_RATE_RATIO
from experiments.rate_study import ORCA_POLICIES, RateRules, rate_search
from experiments.step_cost import DEVICES, LLAMA_13B, StepCost, StepShape
from jpaged.core.step_shapes import default_buckets

PAPER_PROMPT_CUT = 1024
PAPER_MAX_MODEL_LEN = 2048
GIB = 2**30
# PCIe 4.0 x16: 32 GB/s each way, about 25 GB/s reached by pinned host copies.
PCIE_BYTES_PER_S = 25e9
PCIE_SOURCE = "PCIe 4.0 x16: 32 GB/s each way, about 25 GB/s effective for pinned copies"
ARMS = ("no-cache", "device-cache", "device+tier", "control")
PARTS = ("figure17", "replay", "block-costs")
TIER_COUNTERS = ("prefix_cache_tier_hit_tokens", "kv_offload_stored_blocks",
                 "kv_offload_loaded_blocks", "kv_offload_bytes")


@dataclass(frozen=True)
class ChatbotSettings:
    """Figure 17's runs: N (`prompt_cut`, also the output cap), the conversations,
    vLLM's sequence cap; num_requests None for the rule's (three times what the pool
    holds for orca-oracle); curves=False measures the capacities only."""

    prompt_cut: int = 128
    num_conversations: int = 400
    num_requests: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    curves: bool = True
    rules: RateRules = field(default_factory=RateRules)
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        """The prompt cut and the output cap: 2N, as the paper's 2,048."""
        return 2 * self.prompt_cut

    @property
    def shape(self) -> ConversationShape:
        """Turns scaled as the cut is, so that it binds as often as the paper's."""
        return ConversationShape(scale=self.prompt_cut / PAPER_PROMPT_CUT)

    @property
    def pool_tokens(self) -> int:
        """The paper's pool per token of max_model_len, times this max_model_len, in
        whole blocks."""
        tokens = paper_pool_tokens() * self.max_model_len / PAPER_MAX_MODEL_LEN
        return int(tokens) // self.block_size * self.block_size


def figure17(loaded, settings: ChatbotSettings, vocab_size: int) -> dict:
    """Paged against Orca's three policies on the chatbot's rounds, no KV kept."""
    conversations = make_conversations(settings.num_conversations, vocab_size=vocab_size,
                                       seed=settings.seed, shape=settings.shape)
    pool = settings.pool_tokens
    sample = chatbot_requests(conversations, min(1000, sum(c.num_rounds for c in conversations)),
                              prompt_cut=settings.prompt_cut, output_cap=settings.prompt_cut,
                              seed=settings.seed + 1)
    count = settings.num_requests or math.ceil(
        3 * pool / float(np.mean([r.total_len for r in sample])))
    engines = {policy: make_engine(loaded, allocation=policy, block_size=settings.block_size,
                                   num_pool_tokens=pool, max_num_seqs=settings.max_num_seqs,
                                   max_num_batched_tokens=settings.max_num_batched_tokens,
                                   max_model_len=settings.max_model_len)
               for policy in ("paged", *ORCA_POLICIES)}

    def requests(rate: float):
        return chatbot_requests(conversations, count, prompt_cut=settings.prompt_cut,
                                output_cap=settings.prompt_cut, request_rate=rate,
                                seed=settings.seed)

    def run_at(policy: str, rate: float) -> dict:
        return serve(engines[policy], requests(rate), f"chatbot {policy} {rate:.2f} req/s"
                     ).summary()

    trace = requests(math.inf)
    return {"settings": dataclasses.asdict(settings), "conversations": SOURCE,
            "pool_tokens": pool, "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.max_num_seqs,
            "num_requests": count,
            "mean_prompt_tokens": float(np.mean([len(r.prompt_token_ids) for r in trace])),
            "prompts_at_cut_pct": 100.0 * float(np.mean(
                [len(r.prompt_token_ids) == settings.prompt_cut for r in trace])),
            "mean_output_tokens": float(np.mean([r.output_len for r in trace])),
            "paper_rate_ratio": FIGURE17_RATE_RATIO,
            **rate_search(run_at, ("paged", *ORCA_POLICIES), settings.rules, settings.curves)}


@dataclass(frozen=True)
class ReplaySettings:
    """The replay's conversations and the pools of its arms.

    device_pool_tokens: the device pool of every arm but the control.
    tier_tokens: the host tier's size in tokens of the KV cache (its bytes:
        tier_tokens x the pool's bytes per token); the control's device pool is
        device_pool_tokens + tier_tokens.
    """

    num_conversations: int = 20
    output_cap: int = 128
    max_model_len: int = 512
    device_pool_tokens: int = 768
    tier_tokens: int = 8192
    request_rate: float = 2.0
    think_s: float = 15.0
    arms: tuple[str, ...] = ARMS
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    seed: int = 0

    @property
    def shape(self) -> ConversationShape:
        return ConversationShape(scale=self.output_cap / PAPER_PROMPT_CUT)


def arm_engine(loaded, arm: str, settings: ReplaySettings):
    """One arm's engine: its pool, prefix cache and tier."""
    pool = settings.device_pool_tokens + (settings.tier_tokens if arm == "control" else 0)
    engine = make_engine(loaded, allocation="paged", block_size=settings.block_size,
                         num_pool_tokens=pool, max_num_seqs=settings.max_num_seqs,
                         max_num_batched_tokens=settings.max_num_batched_tokens,
                         max_model_len=settings.max_model_len,
                         enable_prefix_caching=arm != "no-cache",
                         kv_offloading_size=tier_gib(loaded, settings) if arm == "device+tier"
                         else 0.0)
    return engine, pool


def tier_gib(loaded, settings: ReplaySettings) -> float:
    """The tier's size in GiB (vLLM's unit): tier_tokens of the model's float32 KV."""
    config = loaded[1]
    bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    return settings.tier_tokens * bytes_per_token / GIB


def replay(loaded, settings: ReplaySettings, vocab_size: int, progress) -> dict:
    """Each arm serves the same conversations round after round."""
    conversations = tuple(make_conversations(settings.num_conversations, vocab_size=vocab_size,
                                             seed=settings.seed, shape=settings.shape))
    plan = Replay(conversations, settings.request_rate, settings.think_s, settings.output_cap,
                  settings.max_model_len, settings.seed)
    arms = {}
    for arm in settings.arms:
        engine, pool = arm_engine(loaded, arm, settings)
        run = serve(engine, plan.first_rounds(), f"replay {arm}", follow_up=plan.follow_up)
        summary = {key: value for key, value in run.summary().items() if key != "step_log"}
        summary["answers_sha256"] = answers_digest(run.outputs)
        if arm == "device+tier":
            counters = engine.stats.summary()
            summary |= {name: counters[name] for name in TIER_COUNTERS}
        arms[arm] = {"device_pool_tokens": pool, **summary}
        progress(f"replay {arm}: TTFT mean {summary['ttft_s_mean']:.3f} s, "
                 f"p90 {summary['ttft_s_p90']:.3f} s")
    history = [sum(len(q) + len(a) for q, a in zip(c.questions, c.answers, strict=True))
               for c in conversations]
    return {"settings": dataclasses.asdict(settings), "conversations": SOURCE,
            "tier_gib": tier_gib(loaded, settings),
            "conversation_tokens_total": int(sum(history)),
            "conversation_tokens_mean": float(np.mean(history)),
            "same_memory": "on this CPU the device pool and the host tier are the same RAM",
            "arms": arms, "ttft_ratios": ttft_ratios(arms)}


def answers_digest(outputs: dict) -> str:
    """One hash of every round's answer tokens: arms that answered alike share it (a
    cache must change no greedy token, and each next round carries the answers)."""
    answers = {rid: output.outputs[0].token_ids for rid, output in sorted(outputs.items())}
    return hashlib.sha256(json.dumps(answers).encode()).hexdigest()


def ttft_ratios(arms: dict) -> dict:
    """Device-cache-only TTFT over each other cached arm's (mean and p90): how much
    faster its first tokens come."""
    if "device-cache" not in arms:
        return {}
    base = arms["device-cache"]
    return {f"device_cache_over_{arm.replace('+', '_').replace('-', '_')}_{stat}":
            base[f"ttft_s_{stat}"] / run[f"ttft_s_{stat}"]
            for arm, run in arms.items() if arm != "device-cache" for stat in ("mean", "p90")}


def block_costs(loaded, settings: ReplaySettings, vocab_size: int) -> dict:
    """Per block: recomputing a prompt's blocks against copying them from host memory
    into the pool, on an idle engine (experiments.block_size_study.operation_seconds:
    a one-token prefill of max_num_batched_tokens, and a copy of its blocks); and the
    step-cost model's projection for LLaMA-13B on an A100-40GB over PCIe."""
    tokens = settings.max_num_batched_tokens
    engine = make_engine(loaded, allocation="paged", block_size=settings.block_size,
                         num_pool_tokens=2 * tokens, max_num_seqs=settings.max_num_seqs,
                         max_num_batched_tokens=tokens, max_model_len=tokens,
                         preemption_mode="swap", num_host_tokens=tokens)
    measured = operation_seconds(engine, tokens, vocab_size)
    blocks = measured["blocks"]
    return {"engine": {"tokens": tokens, "blocks": blocks,
                       "recompute_ms_per_block": 1e3 * measured["recompute_s"] / blocks,
                       "load_ms_per_block": 1e3 * measured["swap_in_s"] / blocks,
                       "store_ms_per_block": 1e3 * measured["swap_out_s"] / blocks,
                       "memory": "device pool and host pool in the same RAM"},
            "gpu_projection": projected_block_costs(tokens, settings.block_size)}


def projected_block_costs(tokens: int, block_size: int) -> dict:
    """The step-cost model's recompute of `tokens` prompt tokens (one prefill step) per
    block, against one block's K and V of every layer over PCIe, LLaMA-13B (float16)
    on an A100-40GB."""
    cost = StepCost(DEVICES[PAPER_DEVICE], LLAMA_13B)
    shape = StepShape.of([tokens], [tokens], default_buckets("xla", 1, 256), block_size)
    blocks = tokens // block_size
    block_bytes = block_size * LLAMA_13B.num_layers * LLAMA_13B.kv_bytes_per_token_layer
    recompute = cost.seconds(shape) / blocks
    load = block_bytes / PCIE_BYTES_PER_S
    return {"device": cost.device.name, "model": cost.model.name,
            "calibration": cost.calibration.source, "link": PCIE_SOURCE,
            "block_bytes": block_bytes, "recompute_ms_per_block": 1e3 * recompute,
            "load_ms_per_block": 1e3 * load, "recompute_over_load": recompute / load}


def run(loaded, chatbot: ChatbotSettings, replay_settings: ReplaySettings, vocab_size: int,
        progress, parts: tuple[str, ...] = PARTS) -> dict:
    """Those of PARTS asked for: Figure 17, the replay, the per-block costs."""
    out = {}
    if "figure17" in parts:
        out["figure17"] = figure17(loaded, chatbot, vocab_size)
        progress(f"figure 17: {out['figure17']['capacity_ratios']} "
                 f"{out['figure17'].get('rate_ratios')}")
    if "replay" in parts:
        out["replay"] = replay(loaded, replay_settings, vocab_size, progress)
    if "block-costs" in parts:
        out["block_costs"] = block_costs(loaded, replay_settings, vocab_size)
    return out
