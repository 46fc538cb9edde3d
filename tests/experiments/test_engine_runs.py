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
