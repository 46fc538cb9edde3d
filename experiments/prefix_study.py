"""The paper's Figure 16 on the engine and in simulation: translation behind a shared prefix.

Requests translate a sentence behind a 1-shot or 5-shot prefix (experiments.translation:
real text, counted by the model's tokenizer). Two servers, the same requests, model,
kernels and pool:

- paged: prefix caching on and, with `reserve` (the default), the prefix reserved
  before the run (`LLMEngine.reserve_prefix`: its full blocks held on the device, as
  the paper's Section 4.4 stores a prefix in advance), so a request's prompt step
  computes its own sentence and the prefix's last partial block; without `reserve` the
  first request computes the prefix and the prefix cache keeps it while it is in use;
- orca-oracle: Orca reserving each request's true length, every prompt computed in
  full, nothing shared.

Pool: the paper's (LLaMA-13B on an A100-40GB, Figure 1's 30% of 40 GB: 15,728 token
slots; LLaMA-13B's K and V take as many bytes per token as OPT-13B's) times
`pool_scale`. The prefixes' token counts and the sentences' lengths are near the
paper's, so at pool_scale 1 the pool holds as many requests as the paper's did and
memory binds as it did there. Requests: three times what the pool holds for
orca-oracle (the rate study's rule). Rates, threshold and sustained rate: the rate
study's rules (experiments.rate_study.RateRules).

The same trace generator then runs in the simulator (experiments.simulator) on a
LLaMA-13B / A100-40GB step-cost clock at the paper's pool and vLLM's limits (256
sequences, a 2,048-token step), as many requests as the same rule gives there, the
reserved prefix held by one more holder, beside the paper's 1.67x (1-shot) and 3.58x
(5-shot).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from experiments.accelerator_study import PAPER_DEVICE, paper_pool_tokens
from experiments.engine_runs import make_engine, serve
from experiments.paper import FIGURE16_RATE_RATIO
from experiments.rate_study import RateRules, rate_search
from experiments.simulator import SimConfig, simulate
from experiments.step_cost import DEVICES, LLAMA_13B, StepCost
from experiments.translation import (
    SHOTS,
    SentenceLengths,
    TranslationPrompts,
    translation_workload,
)
from experiments.workloads import RequestSpec

SERVERS = ("paged", "orca-oracle")
QUICK_POOL_SCALE = 1 / 16
# vLLM's sequence cap and step budget in simulation; on the CPU a 512-token step.
SIM_LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048)


@dataclass(frozen=True)
class PrefixSettings:
    """One prefix's runs on the engine: the paper's pool and sequence cap times
    pool_scale; num_requests, None for the rule's (`num_requests`); curves=False
    measures the capacities only."""

    prefix: str
    pool_scale: float = 1.0
    block_size: int = 16
    max_num_batched_tokens: int = 512
    reserve: bool = True
    curves: bool = True
    num_requests: int | None = None
    rules: RateRules = field(default_factory=RateRules)
    seed: int = 0

    @property
    def max_num_seqs(self) -> int:
        """vLLM's 256 sequences scaled as the pool is: whichever of memory and the cap
        binds at the paper's pool binds here."""
        return max(1, round(SIM_LIMITS["max_num_seqs"] * self.pool_scale))

    @property
    def pool_tokens(self) -> int:
        """The paper's pool times pool_scale, in whole blocks."""
        blocks = int(paper_pool_tokens() * self.pool_scale) // self.block_size
        return blocks * self.block_size


def num_requests(prompts: TranslationPrompts, pool_tokens: int, max_num_seqs: int,
                 vocab_size: int, seed: int) -> int:
    """The rate study's rule: three times the most requests a server holds at once, here
    the more of the sequence cap (what paged, sharing the prefix, nearly reaches at the
    paper's pool) and the requests of the workload's mean length (prompt + output, from
    a large sample of it) the pool holds for orca-oracle."""
    sample = translation_workload(prompts, 1000, vocab_size=vocab_size, seed=seed + 1)
    mean_len = float(np.mean([r.total_len for r in sample]))
    return math.ceil(3 * max(pool_tokens / mean_len, max_num_seqs))


def longest_request(prompts: TranslationPrompts) -> int:
    """The most tokens a request can hold: the prompt and output of the longest sentence
    (the engine's max_model_len, which its pool must hold once)."""
    return len(prompts.prefix_ids) + prompts.template_len + 2 * SentenceLengths().high


def workload_stats(requests: list[RequestSpec], prompts: TranslationPrompts) -> dict:
    """The trace as served: its size and mean lengths."""
    return {"num_requests": len(requests), "prefix_tokens": len(prompts.prefix_ids),
            "template_tokens": prompts.template_len,
            "mean_prompt_tokens": float(np.mean([len(r.prompt_token_ids) for r in requests])),
            "mean_output_tokens": float(np.mean([r.output_len for r in requests]))}


class PagedWithPrefix:
    """The paged engine, its prefix cache emptied before every run (a run must not hit
    the blocks of the run before it) and the prefix reserved again if asked."""

    def __init__(self, engine, prefix_ids: tuple[int, ...], reserve: bool):
        self.engine, self.prefix_ids, self.reserve = engine, prefix_ids, reserve
        self.reserved = None

    def prepare(self) -> None:
        if self.reserved is not None:
            self.engine.release_prefix(self.reserved)
        self.engine.block_manager.reset_prefix_cache()
        if self.reserve:
            self.reserved = self.engine.reserve_prefix(list(self.prefix_ids))


def engine_runs(loaded, settings: PrefixSettings, vocab_size: int) -> dict:
    """The prefix's Figure 16 on the engine."""
    prompts = TranslationPrompts.of(loaded[2], settings.prefix)
    pool = settings.pool_tokens
    count = settings.num_requests or num_requests(prompts, pool, settings.max_num_seqs,
                                                  vocab_size, settings.seed)
    limits = dict(block_size=settings.block_size, num_pool_tokens=pool,
                  max_num_seqs=settings.max_num_seqs,
                  max_num_batched_tokens=settings.max_num_batched_tokens,
                  max_model_len=longest_request(prompts))
    paged = PagedWithPrefix(make_engine(loaded, allocation="paged", enable_prefix_caching=True,
                                        **limits), prompts.prefix_ids, settings.reserve)
    engines = {"paged": paged.engine, "orca-oracle": make_engine(loaded, allocation="orca-oracle",
                                                                   **limits)}

    def run_at(name: str, rate: float) -> dict:
        if name == "paged":
            paged.prepare()
        requests = translation_workload(prompts, count, vocab_size=vocab_size,
                                        request_rate=rate, seed=settings.seed)
        return serve(engines[name], requests, f"{settings.prefix} {name} {rate:.2f} req/s"
                     ).summary()

    result = rate_search(run_at, SERVERS, settings.rules, settings.curves)
    trace = translation_workload(prompts, count, vocab_size=vocab_size, seed=settings.seed)
    return {"settings": dataclasses.asdict(settings), "pool_tokens": pool,
            "max_num_seqs": settings.max_num_seqs,
            "prefix_held": "reserved" if settings.reserve else "held by the prefix cache",
            **workload_stats(trace, prompts), **result}


def simulated(prompts: TranslationPrompts, count: int, vocab_size: int,
              settings: PrefixSettings) -> dict:
    """The same trace (count requests, settings' seed) in the simulator on a LLaMA-13B /
    A100 clock at the paper's pool, paged with the prefix reserved against Orca (Oracle)
    on contiguous slabs (the paper's Orca); the curves when settings' are asked for."""
    cost = StepCost(DEVICES[PAPER_DEVICE], LLAMA_13B)
    pool = paper_pool_tokens()

    def run_at(name: str, rate: float) -> dict:
        config = SimConfig(allocator=name, block_size=settings.block_size, num_kv_slots=pool,
                           step_cost=cost, seed=settings.seed, **SIM_LIMITS)
        if name == "paged":
            config = dataclasses.replace(config, enable_prefix_caching=True,
                                         reserved_prefix=prompts.prefix_ids)
        requests = translation_workload(prompts, count, vocab_size=vocab_size,
                                        request_rate=rate, seed=settings.seed)
        result = simulate(requests, config)
        return {"num_requests": result.num_finished, "virtual_s": result.simulated_s,
                "normalized_latency_s_mean": result.mean_normalized_latency_s,
                "mean_running_requests": result.mean_running_requests,
                "mean_kv_utilization_pct": 100 * result.mean_kv_utilization,
                "num_preemptions": result.num_preemptions,
                "prefix_cache_hit_rate": result.prefix_cache_hit_rate}

    return {"device": cost.device.name, "model": cost.model.name,
            "calibration": cost.calibration.source, "pool_tokens": pool,
            "orca_memory": "contiguous slabs", **SIM_LIMITS,
            **rate_search(run_at, SERVERS, settings.rules, settings.curves)}


def run(loaded, settings: list[PrefixSettings], vocab_size: int, progress) -> dict:
    """Figure 16 for each prefix: the engine's runs, then the simulator's on the trace
    the engine would serve at the paper's pool."""
    out = {"paper_rate_ratio": dict(FIGURE16_RATE_RATIO), "prefixes": {}}
    for prefix_settings in settings:
        prefix = prefix_settings.prefix
        engine = engine_runs(loaded, prefix_settings, vocab_size)
        progress(f"figure 16 {prefix} on the engine: {engine['capacity_ratios']} "
                 f"{engine.get('rate_ratios')}")
        prompts = TranslationPrompts.of(loaded[2], prefix)
        paper_count = num_requests(prompts, paper_pool_tokens(), SIM_LIMITS["max_num_seqs"],
                                   vocab_size, prefix_settings.seed)
        sim = simulated(prompts, paper_count, vocab_size, prefix_settings)
        progress(f"figure 16 {prefix} in simulation: {sim['capacity_ratios']} "
                 f"{sim.get('rate_ratios')}")
        out["prefixes"][prefix] = {"engine": engine, "simulator": sim,
                                   "prefix_text_shots": SHOTS[prefix]}
    return out
