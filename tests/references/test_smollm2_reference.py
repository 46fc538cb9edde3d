"""The default model, SmolLM2-135M-Instruct, against transformers' stored answers
(tests/references/smollm2.json), without loading transformers: its tokenizer and chat
template, greedy tokens with their top-5 log-probabilities, and transformers-scored beam
search, all in one engine run.
"""

from __future__ import annotations

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from tests.references.compare import load_reference
from tests.references.runs import check_tokenization, compare_run, run_reference

REFERENCE = load_reference("smollm2")


def test_smollm2_matches_stored_transformers(smollm2):
    _, _, tokenizer = smollm2
    llm = LLM("smollm2", loaded=smollm2, block_size=16, kv_cache_memory_bytes=128 << 20,
              max_num_seqs=16, max_num_batched_tokens=512, max_model_len=128,
              buckets=BucketSizes(min_num_tokens=16, min_num_seqs=16, min_blocks_per_seq=8))
    check_tokenization(llm, REFERENCE)

    done = run_reference(llm, REFERENCE)
    ties = compare_run(REFERENCE, done, REFERENCE["eos_token_ids"])
    print(f"near ties accepted: {ties}")
    assert "Paris" in tokenizer.decode(done["greedy-0"].outputs[0].token_ids)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_device_blocks
