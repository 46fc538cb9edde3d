"""Serving a list of requests all at once on an engine, one step at a time: what the
benchmarks that fill a pool read of it (sequences running at once, KV bytes each
holds, output tokens/s over the steps that compiled nothing)."""

from __future__ import annotations

import time

import numpy as np


def decoding(engine) -> bool:
    """Whether every running sequence has computed its prompt (the step decodes only)."""
    return all(seq.num_computed_tokens >= seq.num_prompt_tokens
               for group in engine.scheduler.running for seq in group.seqs)


def serve(llm, requests) -> dict:
    """Run `requests` [(prompt ids, output length)], greedy and to their length, to the
    end. kv_bytes_per_seq: the pool bytes the tables hold per running sequence, the mean
    over the steps in which every running sequence decodes. running_mean_while_waiting:
    the sequences running at once, the mean over the steps that left requests waiting
    (with max_num_seqs above the request count, the steps the pool bound)."""
    from jpaged import SamplingParams
    from jpaged.engine.stats import num_compilations

    engine = llm.engine
    for i, (prompt, output_len) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=output_len,
                                                          ignore_eos=True))
    block_bytes = engine.kv_cache_info.block_bytes
    lengths: dict[str, int] = {}
    running_peak, per_seq_bytes, running_while_waiting = 0, [], []
    steady_s, steady_tokens, compile_steps = 0.0, 0, 0
    while engine.has_unfinished_requests():
        compiled, started = num_compilations(), time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        new_tokens = 0
        for output in outputs:
            now = len(output.outputs[0].token_ids)
            new_tokens += now - lengths.get(output.request_id, 0)
            lengths[output.request_id] = now
        if num_compilations() == compiled:
            steady_s, steady_tokens = steady_s + elapsed, steady_tokens + new_tokens
        else:
            compile_steps += 1
        running = engine.scheduler.num_running
        running_peak = max(running_peak, running)
        if engine.scheduler.num_waiting:
            running_while_waiting.append(running)
        if running and decoding(engine):
            per_seq_bytes.append(engine.block_manager.physical_blocks_used * block_bytes / running)
    assert sum(lengths.values()) == sum(o for _, o in requests), "a request lost tokens"
    return {
        "kv_bytes_per_seq": float(np.mean(per_seq_bytes)) if per_seq_bytes else None,
        "running_peak": running_peak,
        "running_mean_while_waiting": (float(np.mean(running_while_waiting))
                                       if running_while_waiting else None),
        "output_tokens_per_s": steady_tokens / steady_s if steady_s else None,
        "compile_steps": compile_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "kv_cache": str(engine.kv_cache_info),
    }
