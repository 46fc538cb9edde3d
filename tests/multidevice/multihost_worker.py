"""One process of tests/test_multihost.py's jobs, started by `python -m jpaged.launch`.

    python multihost_worker.py MODE OUT_DIR MODEL_DIR...

MODE: "tp8" (tensor parallel over both processes' 8 devices), "tp4dp2" (tensor
parallel 4 in each process, a data-parallel replica per process), "exit:K"
(tp8; process K exits after STEPS_BEFORE_EXIT steps), "diverge" (tp8; process 1
is given another last prompt than process 0), "diverge-dp" (tp4dp2; process 1 is
given one more request).

Each model's prompts (greedy, and two samples of one prompt) run step by step;
after every step the process writes down what it returned and, for a replica
spanning the processes, its queues and block tables, in OUT_DIR/process_<id>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.launch import initialize
from jpaged.sampling_params import SamplingParams

EXIT_STATUS = 3
STEPS_BEFORE_EXIT = 2
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 27)), [40, 41, 3, 99, 7, 250, 11, 12, 13],
           [200, 201, 202]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Two samples sharing the prompt's blocks (copy-on-write), drawn from the engine's seeds.
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)
# One padded shape for mixed steps and one for decode steps.
ENGINE = dict(block_size=8, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128, persistent_compilation_cache=False,
              buckets=BucketSizes(min_num_tokens=64, min_num_seqs=4, min_blocks_per_seq=16))
LAYOUTS = {"tp8": dict(tensor_parallel_size=8), "tp4dp2": dict(tensor_parallel_size=4,
                                                                data_parallel_size=2)}


def spanning_state(engine) -> list:
    """Queues, computed tokens and block tables of a replica that spans processes."""
    scheduler, manager = engine.scheduler, engine.block_manager
    running = [[group.request_id, [[seq.seq_id, seq.num_computed_tokens,
                                    [list(table) for table in manager.block_tables(seq)]]
                                   for seq in group.seqs]]
               for group in scheduler.running]
    return [running, [group.request_id for group in scheduler.waiting]]


def run(model_dir: str, mode: str) -> dict:
    llm = LLM(model_dir, **LAYOUTS["tp4dp2" if "dp" in mode else "tp8"], **ENGINE)
    engine, process = llm.engine, jax.process_index()
    prompts = list(PROMPTS)
    if mode == "diverge" and process == 1:
        prompts[-1] = prompts[-1][:-1]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request("sampled", {"prompt_token_ids": PROMPTS[1]}, SAMPLED)
    if mode == "diverge-dp" and process == 1:
        engine.add_request("extra", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    replicas = engine.replicas if "dp" in mode else [engine]
    local_requests = [replica.num_unfinished_requests() for replica in replicas]
    steps, tokens = [], {}
    while engine.has_unfinished_requests():
        if mode == f"exit:{process}" and len(steps) == STEPS_BEFORE_EXIT:
            os._exit(EXIT_STATUS)
        outputs = engine.step()
        for output in outputs:
            tokens[output.request_id] = [sample.token_ids for sample in output.outputs]
        steps.append({
            "outputs": [[o.request_id, [c.token_ids for c in o.outputs], o.finished]
                        for o in outputs],
            "state": None if "dp" in mode else spanning_state(engine),
        })
    return {"steps": steps, "tokens": tokens, "local_requests": local_requests}


def main() -> None:
    initialize()
    mode, out_dir, model_dirs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    results = {Path(model_dir).name: run(model_dir, mode) for model_dir in model_dirs}
    (out_dir / f"process_{jax.process_index()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
