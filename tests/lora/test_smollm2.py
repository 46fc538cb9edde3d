"""One rank-16 adapter on SmolLM2's attention and MLP projections against transformers
+ PEFT applying it: greedy tokens and prompt log-probabilities, and the adapter changes
the base model's answer."""

from __future__ import annotations

import pytest

from jpaged import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import ATTENTION_AND_MLP, greedy, peft_model, prompt_logprobs

NUM_TOKENS = 8


@pytest.mark.full
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_smollm2_adapter_matches_peft(smollm2, tmp_path):
    from jpaged.model.loader import default_model_directory

    # A fresh transformers model: PEFT writes its layers into the model it wraps.
    oracle = peft_model(default_model_directory(), 16, ATTENTION_AND_MLP, seed=5)
    oracle.save_pretrained(tmp_path / "adapter")
    lora = LoRARequest("smol", 1, str(tmp_path / "adapter"))
    llm = LLM("smollm2", loaded=smollm2, enable_lora=True, max_loras=1, max_lora_rank=16,
              max_num_seqs=2, max_model_len=64, num_decode_steps=1)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=1)
    with_adapter, base = llm.generate([{"prompt_token_ids": prompt}] * 2, params,
                                      lora_request=[lora, None])
    assert with_adapter.outputs[0].token_ids == greedy(oracle, prompt, NUM_TOKENS)
    assert with_adapter.outputs[0].token_ids != base.outputs[0].token_ids
    rows = prompt_logprobs(oracle, prompt)
    for position in range(1, len(prompt)):
        got = with_adapter.prompt_logprobs[position][prompt[position]].logprob
        assert got == pytest.approx(rows[position - 1, prompt[position]], abs=1e-4)
