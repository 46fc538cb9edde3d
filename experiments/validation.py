"""Simulator validation: the same requests and pool through the simulator and the engine.

The model-free simulator (experiments.simulator) runs jpaged's own scheduler and
block manager, so for paged allocation it should follow the engine step for
step; its Orca (Oracle) is a contiguous arena, where the engine's orca-oracle
reserves whole blocks (rounding each reservation up to a block, but never
fragmenting the pool outside a sequence). Both serve the requests all at once,
so the simulator's step-cost model does not enter the comparison.

gap_pct = 100 * (simulator - engine) / engine, per measure.
"""

from __future__ import annotations

from experiments.simulator import SimConfig, simulate
from experiments.workloads import RequestSpec

# The policies validated: paged, and the Orca policy the simulator's arena models
# closest to the engine's reserving blocks.
VALIDATED = ("paged", "orca-oracle")
MEASURES = {  # simulator's name -> engine's name
    "mean_running_requests": "mean_running_requests",
    "num_preemptions": "num_preemptions",
    "mean_kv_utilization_pct": "mean_kv_utilization_pct",
    "num_steps": "num_steps",
}


def simulated(policy: str, requests: list[RequestSpec], pool_tokens: int, settings) -> dict:
    """The simulator's measures for `policy` on the engine's pool and limits."""
    config = SimConfig(
        allocator=policy, block_size=settings.block_size,
        num_kv_slots=pool_tokens, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
    )
    at_zero = [RequestSpec(r.request_id, 0.0, r.prompt_token_ids, r.output_len) for r in requests]
    result = simulate(at_zero, config)
    return {
        "mean_running_requests": result.mean_running_requests,
        "num_preemptions": result.num_preemptions,
        "mean_kv_utilization_pct": 100.0 * result.mean_kv_utilization,
        "num_steps": result.num_steps,
    }


def gap_pct(simulator: float, engine: float) -> float | None:
    if engine == 0:
        return 0.0 if simulator == 0 else None
    return 100.0 * (simulator - engine) / engine


def validate(engine_runs: dict[str, dict], requests: list[RequestSpec], pool_tokens: int,
             settings) -> dict:
    """Side by side per policy; engine_runs: policy -> RunResult.summary() of the
    all-at-once run."""
    report = {}
    for policy, engine in engine_runs.items():
        sim = simulated(policy, requests, pool_tokens, settings)
        report[policy] = {
            measure: {"simulator": sim[measure], "engine": engine[name],
                      "gap_pct": gap_pct(sim[measure], engine[name])}
            for measure, name in MEASURES.items()
        }
    report["sim_vs_engine_gap_pct"] = {
        policy: report[policy]["mean_running_requests"]["gap_pct"] for policy in engine_runs
    }
    return report
