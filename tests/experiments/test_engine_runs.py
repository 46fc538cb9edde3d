"""What a served run records of each engine step: its sequences, as the plan ran them,
and the bucket the engine compiled for it, checked against the run worked out by hand."""

from __future__ import annotations

import pytest

from experiments.engine_runs import make_engine, read_step_log, serve
from experiments.workloads import RequestSpec
from jpaged.model.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def test_each_step_is_recorded_with_its_shape(loaded):
    engine = make_engine(loaded, allocation="paged", block_size=4, num_pool_tokens=64,
                         max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    requests = [RequestSpec("a", 0.0, tuple(range(1, 6)), 3),
                RequestSpec("b", 0.0, tuple(range(1, 10)), 3)]
    steps = serve(engine, requests).summary()["step_log"]
    # Both prompts in one step (5 + 9 tokens, a mixed step padded to 16 tokens), then two
    # decode steps of two rows; logits of the two sequences every step.
    assert steps["query_lens"] == [[5, 9], [1, 1], [1, 1]]
    assert steps["context_lens"] == [[5, 9], [6, 10], [7, 11]]
    assert steps["padded_tokens"] == [16, 2, 2] and steps["logit_rows"] == [2, 2, 2]
    # A step that compiled counts its time less the compiling, which may leave nothing.
    assert len(steps["seconds"]) == len(steps["compiled"]) == 3
    assert all(s > 0 if not compiled else s >= 0
               for s, compiled in zip(steps["seconds"], steps["compiled"], strict=True))
    shapes, seconds, compiled = read_step_log(steps)
    assert [s.is_decode for s in shapes] == [False, True, True]
    assert shapes[0].block_size == 4 and seconds == steps["seconds"] and len(compiled) == 3


def test_a_follow_up_arrives_after_its_request_with_its_answer_and_hits_its_blocks(loaded):
    engine = make_engine(loaded, allocation="paged", block_size=4, num_pool_tokens=64,
                         max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
                         enable_prefix_caching=True)
    first = RequestSpec("a", 0.0, tuple(range(1, 10)), 3)
    seen = []

    def follow_up(spec, output, clock):
        seen.append((spec.request_id, clock))
        if spec.request_id != "a":
            return []
        answer = tuple(output.outputs[0].token_ids)
        return [RequestSpec("b", clock + 0.5, spec.prompt_token_ids + answer + (7, 7), 2)]

    run = serve(engine, [first], follow_up=follow_up)
    assert [rid for rid, _ in seen] == ["a", "b"] and set(run.outputs) == {"a", "b"}
    assert len(run.outputs["b"].prompt_token_ids) == 9 + 3 + 2
    # b waited for a: the clock jumped to its arrival, half a virtual second after a ended.
    assert run.virtual_s >= seen[0][1] + 0.5
    # a wrote K/V for its 9 prompt tokens and its first 2 answer tokens (the last one is
    # never computed): 2 full blocks of 4, which b's 14-token prompt starts with.
    assert run.prefix_cache_query_tokens == 9 + 14 and run.prefix_cache_hit_tokens == 8
    # The first token comes no later than the last (a step that compiled counts ~0 s).
    for ttft, latency, spec in zip(run.ttfts_s, run.normalized_latencies_s, ("a", "b"),
                                   strict=True):
        assert 0 <= ttft <= latency * {"a": 3, "b": 2}[spec]
