"""Multi-LoRA against transformers + PEFT applying the same adapters.

Per family (Llama; Mistral, whose window the prompts run past) one engine with two
slots serves four adapters (ranks 8 and 64, attention-only and attention + MLP targets)
and the base model in one batch: every request gets PEFT's greedy tokens and prompt
log-probabilities for its adapter alone, and each adapter's answer differs from the
base model's, so a path that drops the low-rank terms cannot pass. Four adapters in
two slots make requests wait for a slot, load into idle ones and reuse loaded ones.
"""

from __future__ import annotations

import pytest

from jpaged import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import (
    ATTENTION,
    ATTENTION_AND_MLP,
    greedy,
    peft_model,
    prompt_logprobs,
    save_adapter,
)
from tests.plugins.hf_models import greedy_continuations

NUM_TOKENS = 10
PROMPTS = [[5, 60, 70, 80, 90, 100, 11, 12, 13, 14, 15, 16],
           [200, 3, 44, 45, 46, 7, 8, 9, 100, 101, 102, 103, 104]]
# (rank, targets) of the four adapters.
ADAPTERS = [(8, ATTENTION), (64, ATTENTION_AND_MLP), (8, ATTENTION_AND_MLP), (64, ATTENTION)]


@pytest.fixture(scope="module", params=[
    "tiny_llama_dir", pytest.param("tiny_mistral_dir", marks=pytest.mark.full)])
def family(request, tmp_path_factory):
    """(base dir, [(LoRARequest, PEFT model)] of the four adapters, an engine with two
    slots)."""
    base = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    adapters = []
    for i, (rank, targets) in enumerate(ADAPTERS):
        path = save_adapter(base, root / f"adapter{i}", rank, targets, seed=10 + i)
        adapters.append((LoRARequest(f"adapter{i}", i + 1, str(path)),
                         peft_model(base, rank, targets, seed=10 + i)))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=64, num_blocks=160,
              block_size=4, num_decode_steps=1, enable_prefix_caching=True)
    return base, adapters, llm


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_mixed_batch_matches_peft(family):
    base, adapters, llm = family
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=1)
    loras = [lora for lora, _ in adapters] + [None]
    prompts = [PROMPTS[i % 2] for i in range(len(loras))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=loras)
    base_tokens = greedy_continuations(base, PROMPTS, NUM_TOKENS)
    assert outputs[-1].outputs[0].token_ids == base_tokens[0]
    for (lora, model), prompt, output in zip(adapters, prompts, outputs, strict=False):
        expected = greedy(model, prompt, NUM_TOKENS)
        assert output.outputs[0].token_ids == expected, lora.lora_name
        assert expected != base_tokens[PROMPTS.index(prompt)], "the adapter changes nothing"
        rows = prompt_logprobs(model, prompt)
        for position in range(1, len(prompt)):
            got = output.prompt_logprobs[position][prompt[position]].logprob
            assert got == pytest.approx(rows[position - 1, prompt[position]], abs=1e-4)
    # Four adapters through two slots: each loaded when a slot came free.
    assert llm.engine.adapters.num_loads >= 4
    # Loading adapters into the slots again, in another order, compiles nothing new.
    step = llm.engine.runner.functions.mixed_step
    compiled = step._cache_size()
    order = [3, 2, 1, 0, 4]
    again = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], params,
                         lora_request=[loras[i] for i in order])
    assert step._cache_size() == compiled
    assert [o.outputs[0].token_ids for o in again] == [outputs[i].outputs[0].token_ids
                                                       for i in order]


@pytest.mark.full
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_prefix_cache_is_per_adapter(family, tmp_path):
    """The same prompt under two adapters, then again under the first: the second never
    hits the first's blocks, the third does, and every answer is PEFT's."""
    base, adapters, llm = family
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    fresh = [9, 8, 7, 6, 5, 4, 3, 2, 120, 121, 122, 123, 124]  # no run before used it
    prompt = {"prompt_token_ids": fresh}
    runs = [adapters[0], adapters[1], adapters[0]]
    outputs = [llm.generate(prompt, params, lora_request=lora)[0] for lora, _ in runs]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 12]  # 3 full blocks of 13
    for (_, model), output in zip(runs, outputs, strict=True):
        assert output.outputs[0].token_ids == greedy(model, fresh, 4)
    # Other weights under the first adapter's name never meet its cached blocks.
    path = save_adapter(base, tmp_path / "renewed", 8, ATTENTION, seed=99)
    renamed = LoRARequest(adapters[0][0].lora_name, 1, str(path))
    renewed = llm.generate(prompt, params, lora_request=renamed)[0]
    assert renewed.num_cached_tokens == 0
    assert renewed.outputs[0].token_ids == greedy(peft_model(base, 8, ATTENTION, seed=99),
                                                   fresh, 4)


class InjectedFault(RuntimeError):
    pass


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_failed_step_forgets_the_adapter_it_was_to_load(family, monkeypatch):
    """A step fails before writing the adapter it planned to load: its request ends with
    the error, no slot is left believed to hold that adapter, and the next request for it
    loads it again and gets PEFT's tokens."""
    _, adapters, llm = family
    lora, model = adapters[2]
    table = llm.engine.adapters
    table.forget(lora.lora_name)  # not in a slot, whatever ran before: the step loads it
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}

    def fail(loads):
        raise InjectedFault("the device lost the adapter's write")

    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "load_adapters", fail)
        with pytest.raises(InjectedFault):
            llm.generate(prompt, params, lora_request=lora)
    key = table.adapter(lora).key
    assert all(adapter is None or adapter.key != key for adapter in table.slot_adapters)
    assert not table.check_invariants()
    loads = table.num_loads
    output = llm.generate(prompt, params, lora_request=lora)[0]
    assert table.num_loads == loads + 1
    assert output.outputs[0].token_ids == greedy(model, PROMPTS[0], 4)
