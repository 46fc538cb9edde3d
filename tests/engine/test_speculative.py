"""Speculative decoding with n-gram proposals.

Oracles: transformers' greedy `generate` and the same engine without speculation
(greedy tokens, stops, log-probabilities), the same seeded request alone (sampled
tokens must not depend on the batch), and the KV block invariants after every step.
The sampler's acceptance rule is checked against numpy's filtered target
distribution in tests/model/test_speculative_sampling.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jpaged.core.step_shapes import BucketSizes
from jpaged.engine.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.entrypoints.llm import LLM
from jpaged.model.loader import load_model
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.sequence import SequenceStatus
from tests.plugins.hf_models import greedy_continuations, oracle_torch

MAX_TOKENS = 24
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SMALL_BUCKETS = BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2)
# EOS suppressed to the end, as transformers' min_new_tokens does (and min_tokens at
# position j counts the proposals before j).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


def _prompt_set(loaded) -> list[list[int]]:
    """Prompts that repeat a phrase (n-grams recur at once) and prompts that do not."""
    rng = np.random.default_rng(3)
    vocab_size = loaded[1].vocab_size
    phrases = [rng.integers(0, vocab_size, n).tolist() for n in (5, 7, 4)]
    repeated = [phrase * 3 + rng.integers(0, vocab_size, 2).tolist() for phrase in phrases]
    return repeated + [rng.integers(0, vocab_size, n).tolist() for n in (3, 11, 19)]


@pytest.fixture(scope="module")
def prompts(loaded):
    return _prompt_set(loaded)


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    return greedy_continuations(model_dir, prompts, MAX_TOKENS)


def _config(**kwargs) -> dict:
    config = dict(block_size=4, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=128, buckets=SMALL_BUCKETS, persistent_compilation_cache=False)
    return config | kwargs


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run(engine: LLMEngine, requests: dict[str, tuple]) -> dict[str, object]:
    """Step the engine over `requests` (id -> (prompt, params)) to the end, checking the
    blocks after every step: the invariants, and no table past a sequence's last
    token and k proposals. -> id -> final RequestOutput."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    block_size, finals = engine.config.block_size, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_invariants()
        for group in engine.scheduler.running:
            for seq in group.seqs_with(SequenceStatus.RUNNING):
                for table in engine.block_manager.block_tables(seq):
                    assert len(table) <= -(-(len(seq) + K) // block_size)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_device_blocks
    return finals


def test_greedy_equals_transformers_on_qwen2(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir)
    prompts = _prompt_set(loaded)
    llm = LLM("tiny", loaded=loaded, speculative_config=NGRAM, **_config())
    assert _tokens(llm.generate(prompts, GREEDY)) == greedy_continuations(
        tiny_qwen2_dir, prompts, MAX_TOKENS)
    assert llm.engine.stats.spec_decode.num_accepted_tokens > 0


def test_beside_requests_that_do_not_speculate(loaded, prompts, expected):
    """Greedy speculating requests share steps with a beam search (which never
    speculates) and a request for prompt log-probabilities; each ends as without
    speculation."""
    beam = BeamSearchParams(beam_width=2, max_tokens=8)
    prompt_lp = SamplingParams(max_tokens=6, prompt_logprobs=2, ignore_eos=True)
    requests = {str(i): (p, GREEDY) for i, p in enumerate(prompts)}
    requests |= {"beam": (prompts[0], beam), "prompt_lp": (prompts[4], prompt_lp)}
    plain = _run(LLMEngine(EngineConfig(**_config()), loaded=loaded), requests)
    spec = _run(LLMEngine(EngineConfig(speculative_config=NGRAM, **_config()), loaded=loaded),
                requests)
    assert [spec[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert [c.token_ids for c in spec["beam"].outputs] == [
        c.token_ids for c in plain["beam"].outputs]
    assert spec["prompt_lp"].outputs[0].token_ids == plain["prompt_lp"].outputs[0].token_ids
    for got, want in zip(spec["prompt_lp"].prompt_logprobs[1:],
                         plain["prompt_lp"].prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs(loaded, prompts, expected, mode):
    engine = LLMEngine(EngineConfig(speculative_config=NGRAM, **_config(
        num_blocks=40, preemption_mode=mode, kv_offloading_size=0.01 if mode == "swap" else None)),
        loaded=loaded)
    finals = _run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.spec_decode.num_accepted_tokens > 0


def test_logprobs_are_the_targets(loaded, prompts):
    """Accepted tokens carry the target model's log-probabilities, as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    plain = LLM("tiny", loaded=loaded, **_config()).generate(prompts, params)
    spec = LLM("tiny", loaded=loaded, speculative_config=NGRAM, **_config()).generate(
        prompts, params)
    for got, want in zip(spec, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_step, want_step in zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                                       strict=True):
            assert list(got_step) == list(want_step)
            np.testing.assert_allclose([lp.logprob for lp in got_step.values()],
                                       [lp.logprob for lp in want_step.values()], atol=1e-4)
        np.testing.assert_allclose(got.outputs[0].cumulative_logprob,
                                   want.outputs[0].cumulative_logprob, atol=1e-3)


FREE = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _deltas(llm, prompt, params) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.stream(prompt, params)]


def _stopped_inside_a_run(llm, prompt, params) -> bool:
    """Whether a stop ended the request inside a verified run: it kept fewer tokens than
    its steps (one each) and the accepted proposals gave it."""
    outputs = list(llm.stream(prompt, params))
    kept = sum(len(output.outputs[0].token_ids) for output in outputs)
    return kept < len(outputs) + outputs[-1].metrics.num_accepted_tokens


def _string_stops_inside_runs(llm, prompts) -> list[tuple[list[int], SamplingParams]]:
    """Stop strings that end a request inside a verified run: the text of a run's first
    token (an accepted proposal), checked from that token on (min_tokens), for each
    prompt whose greedy output has one (a token's text can come out with the next one:
    a stop that did not land inside its run is left out)."""
    tokenizer, cases = llm.get_tokenizer(), []
    for prompt in prompts:
        count = 0
        for delta in _deltas(llm, prompt, FREE):
            text = tokenizer.decode([delta[0]])
            params = dataclasses.replace(FREE, stop=[text], min_tokens=count + 1)
            if len(delta) >= 2 and text.strip() and _stopped_inside_a_run(llm, prompt, params):
                cases.append((prompt, params))
                break
            count += len(delta)
    return cases


def test_a_stop_string_inside_an_accepted_run(loaded, prompts):
    """A stop string in a token the verification accepted mid-run ends the sequence
    where it would without speculation; the tokens accepted after it are dropped. (Stop
    tokens and EOS inside a run: tests/core/test_scheduler.py.)"""
    plain_llm = LLM("tiny", loaded=loaded, **_config())
    spec_llm = LLM("tiny", loaded=loaded, speculative_config=NGRAM, **_config())
    cases = _string_stops_inside_runs(spec_llm, prompts)
    assert cases, "no verified run of two tokens"
    for prompt, params in cases:
        runs = [list(llm.stream(prompt, params)) for llm in (plain_llm, spec_llm)]
        token_ids = [sum((o.outputs[0].token_ids for o in run), []) for run in runs]
        texts = ["".join(o.outputs[0].text for o in run) for run in runs]
        assert token_ids[1] == token_ids[0] and texts[1] == texts[0]
        assert [run[-1].outputs[0].finish_reason for run in runs] == ["stop", "stop"]


def test_seeded_sampling_does_not_depend_on_the_batch(loaded, prompts):
    """Whether and how far a sequence speculates depends on its own tokens only, so a
    seeded request (n = 2, each sample its own proposals) draws the same tokens alone and
    among others."""
    llm = LLM("tiny", loaded=loaded, speculative_config=NGRAM, **_config())
    seeded = SamplingParams(n=2, temperature=0.8, top_k=20, max_tokens=MAX_TOKENS, seed=11,
                            ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([prompts[0]], seeded)[0].outputs]
    others = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True)
              for i in range(len(prompts) - 1)]
    batch = llm.generate(prompts, [seeded, *others])
    assert [c.token_ids for c in batch[0].outputs] == alone
    assert llm.engine.stats.spec_decode.num_drafts > 0


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
])
def test_bad_config_fails_before_weights_load(config, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LLM("/no/such/model/directory", speculative_config=config)


def test_a_draft_model_runs_on_one_device():
    with pytest.raises(ValueError, match="data_parallel_size=2 conflicts with "
                                         "speculative_config\\['method'\\]='draft_model'"):
        EngineConfig(speculative_config={"method": "draft_model", "model": "smollm2",
                                         "num_speculative_tokens": 2}, data_parallel_size=2)


def test_proposals_must_fit_the_step_budget(loaded):
    with pytest.raises(ValueError, match="max_num_batched_tokens=4"):
        LLM("tiny", loaded=loaded, speculative_config=NGRAM | {"num_speculative_tokens": 4},
            **_config(max_num_batched_tokens=4))


# ---- a draft model -----------------------------------------------------------------


def _draft(model_dir, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return tiny_llama_dir, load_model(tiny_llama_dir)


@pytest.mark.parametrize(("block_size", "caching"), [(1, True), (16, False)])
def test_a_draft_model_that_disagrees_keeps_greedy_outputs(llama, tiny_qwen2_dir, block_size,
                                                            caching):
    """A random Qwen2 with the target's vocabulary drafts for the tiny Llama: every
    verification rejects most of its proposals, and the output is transformers'."""
    model_dir, loaded = llama
    prompts = [p[:12] for p in _prompt_set(loaded)]
    expected = greedy_continuations(model_dir, prompts, MAX_TOKENS)
    llm = LLM("tiny", loaded=loaded, speculative_config=_draft(tiny_qwen2_dir), **_config(
        block_size=block_size, num_blocks=2 + 8 * 128 // block_size,
        enable_prefix_caching=caching))
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    counts = llm.engine.stats.spec_decode
    assert counts.num_drafts > 0 and counts.draft_acceptance_rate < 0.5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_target_as_its_own_draft_accepts_everything(llama, mode):
    """A draft equal to the target proposes the target's own tokens: greedy or sampled,
    every proposal is accepted, through prefix-cache hits (the draft's K/V comes with the
    target's blocks), preemption (swaps move the draft's blocks too) and forked samples."""
    model_dir, loaded = llama
    prompts = _prompt_set(loaded)
    engine = LLMEngine(EngineConfig(speculative_config=_draft(model_dir), **_config(
        num_blocks=40, preemption_mode=mode, kv_offloading_size=0.01 if mode == "swap" else None)),
        loaded=loaded)
    sampled = SamplingParams(n=2, temperature=0.9, max_tokens=MAX_TOKENS, seed=5,
                             ignore_eos=True)
    _run(engine, {str(i): (p, GREEDY if i % 2 else sampled) for i, p in enumerate(prompts)})
    # Later requests on the blocks a finished one left in the prefix cache.
    _run(engine, {"first": (prompts[5], GREEDY)})
    _run(engine, {"hit": (prompts[5][:12] + [1, 2], GREEDY), "hit2": (prompts[5], sampled)})
    counts = engine.stats.spec_decode
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_stats.hit_tokens > 0
    assert counts.num_drafts > 0 and counts.num_accepted_tokens == counts.num_draft_tokens


def test_a_draft_with_another_vocabulary_fails_before_weights_load(llama, tmp_path,
                                                                   monkeypatch):
    from jpaged.engine import llm_engine
    from tests.plugins.hf_models import oracle_transformers, randomize, tiny_tokenizer

    transformers = oracle_transformers()
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    randomize(transformers.LlamaForCausalLM(config), seed=2).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(llm_engine, "load_model", pytest.fail)
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*300 tokens"):
        LLMEngine(EngineConfig(model=str(llama[0]), speculative_config=_draft(tmp_path)))


# Full tier: the fast tier compares the default model with transformers' stored answers
# (tests/references/test_smollm2_reference.py).
@pytest.mark.full
def test_smollm2_speculates_to_transformers_greedy(smollm2, smollm2_oracle):
    """The default model copying a sentence: n-gram proposals, and the model as its own
    draft (every proposal accepted), give transformers' greedy tokens."""
    torch = oracle_torch()
    llm = LLM("smollm2", loaded=smollm2, speculative_config=NGRAM, **_config(
        block_size=16, num_blocks=64, max_model_len=256))
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": (
        "Repeat this sentence word for word: the quick brown fox jumps over the lazy dog "
        "by the river, and the lazy dog sleeps on.")}])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = smollm2_oracle.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
    assert _tokens(llm.generate([prompt], GREEDY)) == [expected]
    assert llm.engine.stats.spec_decode.num_accepted_tokens > 0
    own_draft = LLM("smollm2", loaded=smollm2, speculative_config=_draft("smollm2"), **_config(
        block_size=16, num_blocks=64, max_model_len=256))
    assert _tokens(own_draft.generate([prompt], GREEDY)) == [expected]
    counts = own_draft.engine.stats.spec_decode
    assert counts.num_drafts > 0 and counts.num_accepted_tokens == counts.num_draft_tokens
