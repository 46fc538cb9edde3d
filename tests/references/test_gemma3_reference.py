"""Gemma 3 270M against transformers' stored answers (tests/references/gemma3.json): its
tokenizer, greedy tokens and top-5 log-probabilities over a sliding window of 512 tokens
crossed by a prompt of about 770 tokens, transformers-scored beam search, and a follow-up
sharing the long prompt's first 600 tokens through the prefix cache, with the window's
blocks freed and kept. In the full tier: loading Gemma 3 takes longer than the fast tier
allows.
"""

from __future__ import annotations

import pytest

from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import SamplingParams
from tests.references.compare import compare_greedy, load_reference
from tests.references.runs import check_tokenization, compare_run, run_reference

pytestmark = pytest.mark.full
REFERENCE = load_reference("gemma3")


def test_gemma3_matches_stored_transformers(gemma3):
    _, config, _ = gemma3
    llm = LLM("gemma3", loaded=gemma3, block_size=16, max_model_len=1024, max_num_seqs=16)
    check_tokenization(llm, REFERENCE)
    assert max(len(case["prompt_ids"]) for case in REFERENCE["greedy"]) > config.sliding_window

    ties = compare_run(REFERENCE, run_reference(llm, REFERENCE), REFERENCE["eos_token_ids"])
    print(f"near ties accepted: {ties}")


def test_gemma3_prefix_hit_over_the_window_matches_stored_transformers(gemma3):
    """The long prompt's prefill in chunks of 256 crosses the window; the follow-up hits
    the prefix cache, whose sliding groups hold only the window of the hit's end. Freeing
    the window's blocks and keeping every block both give transformers' tokens."""
    _, _, tokenizer = gemma3
    shared = REFERENCE["prefix_sharing"]
    first = tokenizer.encode(REFERENCE["greedy"][-1]["prompt"])
    suffix = tokenizer.encode(shared["follow_up"], add_special_tokens=False)
    assert first == REFERENCE["greedy"][-1]["prompt_ids"] and suffix == shared["follow_up_ids"]
    second = first[:shared["shared_tokens"]] + suffix
    params = SamplingParams(temperature=0.0, max_tokens=len(shared["first"]["tokens"]),
                            ignore_eos=True, logprobs=REFERENCE["settings"]["top_logprobs"])
    ties = 0
    for kwargs in ({}, {"disable_hybrid_kv_cache_manager": True}):
        llm = LLM("gemma3", loaded=gemma3, block_size=16, max_model_len=1024, max_num_seqs=2,
                  max_num_batched_tokens=256, **kwargs)
        for prompt, case in ((first, shared["first"]), (second, shared["second"])):
            completion = llm.generate([prompt], params)[0].outputs[0]
            logprobs = [{token: entry.logprob for token, entry in step.items()}
                        for step in completion.logprobs]
            ties += sum(compare_greedy(case, completion.token_ids, logprobs))
        # The 37 full blocks of the shared 600 tokens.
        assert llm.engine.block_manager.prefix_cache_stats.hit_tokens >= 592
    print(f"near ties accepted: {ties}")
