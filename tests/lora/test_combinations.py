"""LoRA beside the engine's other modes: each gives every request what the plain LoRA
engine gives it (single steps, a float32 cache, no speculation), which itself gives
PEFT's greedy tokens here.

- n > 1 and beam search: samples and beams fork the prompt's blocks and copy on write,
  per adapter (the same prompt under two adapters and the base model in one batch);
  the beams are PEFT's own `generate(num_beams=...)`.
- async scheduling: steps fed the previous step's tokens on the device.
- n-gram speculation: proposals verified with the request's adapter.
- warm-up: compiles the slot writes too, so serving adapters compiles nothing.
- an int8 KV cache: against an int8 engine without LoRA serving the model with the
  adapter merged into its weights (PEFT's merge_and_unload), up to near ties.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from jpaged import LLM, LoRARequest, SamplingParams
from jpaged.engine.stats import num_compilations
from jpaged.sampling_params import BeamSearchParams
from tests.engine.test_beam_search import _compare
from tests.lora.adapters import ATTENTION, ATTENTION_AND_MLP, greedy, peft_model, save_adapter

pytestmark = [pytest.mark.full, pytest.mark.filterwarnings("ignore::FutureWarning")]
NUM_TOKENS = 12
ENGINE = dict(num_blocks=160, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=64, num_decode_steps=1, persistent_compilation_cache=False)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
# Repeats give n-gram speculation something to propose.
PROMPTS = [[5, 60, 70, 80, 5, 60, 70, 80, 5, 60, 11], [200, 3, 44, 45, 46, 7, 200, 3, 44, 45]]
SPECS = [(8, ATTENTION_AND_MLP), (8, ATTENTION)]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """[(LoRARequest, PEFT model)] of two adapters of the tiny Llama."""
    root = tmp_path_factory.mktemp("lora_modes")
    return [(LoRARequest(f"adapter{i}", i + 1, str(save_adapter(
                tiny_llama_dir, root / f"a{i}", rank, targets, seed=20 + i))),
             peft_model(tiny_llama_dir, rank, targets, seed=20 + i))
            for i, (rank, targets) in enumerate(SPECS)]


def batch(adapters):
    """Each prompt under each adapter and the base model: (prompts, lora requests)."""
    loras = [lora for lora, _ in adapters] + [None]
    pairs = [(prompt, lora) for prompt in PROMPTS for lora in loras]
    return [{"prompt_token_ids": p} for p, _ in pairs], [lora for _, lora in pairs]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, adapters):
    """The plain LoRA engine's tokens for `batch`, checked against PEFT's."""
    prompts, loras = batch(adapters)
    outputs = LLM(str(tiny_llama_dir), **LORA, **ENGINE).generate(prompts, GREEDY,
                                                                  lora_request=loras)
    models = {lora: model for lora, model in adapters}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        if lora is not None:
            ids = prompt["prompt_token_ids"]
            assert output.outputs[0].token_ids == greedy(models[lora], ids, NUM_TOKENS)
    answers = tokens(outputs)
    for prompt in range(len(PROMPTS)):  # each adapter changes the base model's answer
        per_lora = answers[prompt * 3: prompt * 3 + 3]
        assert per_lora[2] not in per_lora[:2]
    return answers


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_async_scheduling(tiny_llama_dir, adapters, plain):
    llm = LLM(str(tiny_llama_dir), async_scheduling=True, **LORA, **ENGINE)
    prompts, loras = batch(adapters)
    assert tokens(llm.generate(prompts, GREEDY, lora_request=loras)) == plain


def test_warmup_leaves_nothing_to_compile(tiny_llama_dir, adapters, plain,
                                          no_compilation_cache):
    """warmup() compiles the slot writes beside the step shapes: loading both adapters
    and serving them compiles nothing."""
    jax.clear_caches()  # the slot writes are one jit, which other engines here compiled
    llm = LLM(str(tiny_llama_dir), **LORA, **ENGINE)
    llm.engine.warmup()
    assert jax.config.jax_compilation_cache_dir is None  # a hit would not count as a compile
    before = num_compilations()
    prompts, loras = batch(adapters)
    assert tokens(llm.generate(prompts, GREEDY, lora_request=loras)) == plain
    assert llm.engine.adapters.num_loads == len(adapters)
    assert num_compilations() - before == 0


def test_ngram_speculation(tiny_llama_dir, adapters, plain):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    llm = LLM(str(tiny_llama_dir), speculative_config=ngram, **LORA, **ENGINE)
    prompts, loras = batch(adapters)
    assert tokens(llm.generate(prompts, GREEDY, lora_request=loras)) == plain
    assert llm.engine.stats.spec_decode.num_accepted_tokens > 0


def test_samples_and_beams_share_blocks_per_adapter(tiny_llama_dir, adapters, plain):
    """n = 2 greedy samples and beam searches of width 2 for each prompt under each
    adapter and the base model, in one engine with prefix caching: every sample is the
    plain engine's answer, every best beam PEFT's beam search's (up to ties), and the
    pool is whole again at the end."""
    llm = LLM(str(tiny_llama_dir), enable_prefix_caching=True, **LORA, **ENGINE)
    engine = llm.engine
    prompts, loras = batch(adapters)
    two = SamplingParams(n=2, max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    beam = BeamSearchParams(beam_width=2, max_tokens=8, scoring="transformers",
                            ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"n2-{i}", prompt, two, lora_request=lora)
        if lora is not None:
            engine.add_request(f"beam-{i}", prompt, beam, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    for i, expected in enumerate(plain):
        assert [s.token_ids for s in done[f"n2-{i}"].outputs] == [expected, expected]
    models = dict(adapters)
    ties = 0
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        if lora is not None:
            ids = prompt["prompt_token_ids"]
            ties += _compare(models[lora], [ids], [beam], [done[f"beam-{i}"].outputs[0].token_ids],
                             engine.eos_token_ids)
    print(f"beam ties: {ties}")
    manager = engine.block_manager
    engine.check_invariants()
    assert manager.num_free_blocks == manager.num_device_blocks


def merged_model_dir(base_dir, model, directory):
    """A model directory of `model` (a PEFT model) with its adapter merged in."""
    shutil.copytree(base_dir, directory, ignore=shutil.ignore_patterns("*.safetensors*"))
    model.merge_and_unload().save_pretrained(directory)
    return directory


def test_int8_kv_cache(tiny_llama_dir, adapters, tmp_path):
    """Each adapter on an int8 cache gives what an int8 engine without LoRA gives on the
    model with that adapter merged into its weights (greedy tokens; a step where the
    merged model's top two log-probabilities lie within NEAR_TIE may part them)."""
    near_tie = 1e-3
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", **LORA, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    near_ties = 0
    for i, (lora, _) in enumerate(adapters):
        ours = llm.generate(prompts, GREEDY, lora_request=lora)
        merged = peft_model(tiny_llama_dir, *SPECS[i], seed=20 + i)
        directory = merged_model_dir(tiny_llama_dir, merged, tmp_path / f"merged{i}")
        theirs = LLM(str(directory), kv_cache_dtype="int8", **ENGINE).generate(prompts, GREEDY)
        for got, want in zip(ours, theirs, strict=True):
            got, want = got.outputs[0], want.outputs[0]
            for step, (have, expected) in enumerate(zip(got.token_ids, want.token_ids,
                                                        strict=True)):
                if have != expected:
                    top = sorted((lp.logprob for lp in want.logprobs[step].values()),
                                 reverse=True)
                    assert top[0] - top[1] < near_tie, (lora.lora_name, step)
                    near_ties += 1
                    break
        assert not np.array_equal(tokens(ours), tokens(llm.generate(prompts, GREEDY)))
    print(f"int8 near ties: {near_ties}")
