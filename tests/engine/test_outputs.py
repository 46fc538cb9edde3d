"""What a request gives back: stop conditions, penalties and min_tokens against
transformers' `generate`, stop strings across token boundaries, deltas and
streams against the cumulative output, and the prompt tokens the prefix cache served
against the block arithmetic."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import transformers

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.entrypoints.metrics import EngineCollector
from jpaged.entrypoints.protocol import CompletionJob, CompletionRequest, EncodedPrompt, PromptRun
from jpaged.model.loader import load_model
from jpaged.sampling_params import RequestOutputKind, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM("tiny", loaded=loaded, block_size=4, num_blocks=96, max_num_seqs=8,
               max_num_batched_tokens=64, max_model_len=64,
               buckets=BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2),
               persistent_compilation_cache=False)


@pytest.fixture(scope="module")
def prompts(loaded):
    rng = np.random.default_rng(0)
    return [rng.integers(0, loaded[1].vocab_size - 1, n).tolist() for n in (3, 9, 17)]


def _generate(oracle, prompt, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_transformers(llm, oracle, prompts):
    params = dataclasses.replace(GREEDY, repetition_penalty=1.8, ignore_eos=False)
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        expected = _generate(oracle, prompt, max_new_tokens=MAX_TOKENS, repetition_penalty=1.8)
        assert output.outputs[0].token_ids == expected


def test_min_tokens_and_stop_token_ids_match_transformers(llm, oracle, prompts):
    for prompt in prompts:
        plain = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        stop = plain[1]  # greedy would stop at the second token
        params = dataclasses.replace(GREEDY, stop_token_ids=[stop], min_tokens=4)
        output = llm.generate([prompt], params)[0].outputs[0]
        expected = _generate(oracle, prompt, max_new_tokens=MAX_TOKENS, min_new_tokens=4,
                             eos_token_id=stop)
        assert output.token_ids == expected
        assert stop not in output.token_ids[:4]
        if output.token_ids[-1] == stop:
            assert output.finish_reason == "stop" and output.stop_reason == stop
        else:
            assert output.finish_reason == "length" and output.stop_reason is None


def _token_texts(tokenizer, token_ids) -> list[str]:
    return [tokenizer.decode([t]) for t in token_ids]


def test_stop_string_across_a_token_boundary(llm, prompts):
    tokenizer = llm.get_tokenizer()
    # Printable prompts' continuations: the tiny model's tokens are single bytes or merges.
    for prompt in prompts:
        full = llm.generate([prompt], GREEDY)[0].outputs[0]
        pieces = _token_texts(tokenizer, full.token_ids)
        boundary = next((i for i in range(2, len(pieces) - 1)
                         if pieces[i].isprintable() and pieces[i + 1].isprintable()
                         and pieces[i] and pieces[i + 1]), None)
        if boundary is None:
            continue
        stop = pieces[boundary][-1] + pieces[boundary + 1][0]
        text_before = "".join(pieces[: boundary + 1])
        cut = full.text.find(stop)
        assert 0 <= cut <= len(text_before)
        output = llm.generate([prompt], dataclasses.replace(GREEDY, stop=[stop]))[0].outputs[0]
        assert output.text == full.text[:cut] and output.finish_reason == "stop"
        assert output.stop_reason == stop
        kept = llm.generate([prompt], dataclasses.replace(
            GREEDY, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
        assert kept.text == full.text[: cut + len(stop)]
        # Streamed, the text that could still become the stop string is held back.
        streamed = "".join(d.outputs[0].text for d in llm.stream(
            prompt, dataclasses.replace(GREEDY, stop=[stop])))
        assert streamed == output.text
        return
    pytest.fail("no printable token boundary in the greedy outputs")


def test_deltas_add_up_to_the_cumulative_output(llm, prompts):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=5, logprobs=2,
                            ignore_eos=True)
    (final,) = llm.generate([prompts[1]], params)
    engine = llm.engine
    engine.add_request("delta", prompts[1], dataclasses.replace(
        params, output_kind=RequestOutputKind.DELTA))
    texts, tokens, logprobs, finish = {}, {}, {}, {}
    num_outputs = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_outputs += 1
            for c in output.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens[c.index] = tokens.get(c.index, []) + c.token_ids
                logprobs[c.index] = logprobs.get(c.index, []) + c.logprobs
                finish[c.index] = c.finish_reason
    assert num_outputs == MAX_TOKENS
    for c in final.outputs:
        assert (texts[c.index], tokens[c.index], finish[c.index]) == (
            c.text, c.token_ids, c.finish_reason)
        assert [e.keys() for e in logprobs[c.index]] == [e.keys() for e in c.logprobs]


def test_stream_yields_deltas_of_one_request(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (final,) = llm.generate([prompts[2]], params)
    llm.engine.add_request("beside", prompts[0], params)  # runs alongside, not yielded
    deltas = list(llm.stream(prompts[2], params))
    assert all(d.request_id == deltas[0].request_id for d in deltas)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == final.outputs[0].text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.outputs[0].token_ids
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_final_only_reports_once(llm, prompts):
    engine = llm.engine
    engine.add_request("final", prompts[0], dataclasses.replace(
        GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 1 and outputs[0].finished
    assert len(outputs[0].outputs[0].token_ids) == MAX_TOKENS


def test_num_cached_tokens_is_the_prefix_cache_hit(loaded):
    """The full 4-token blocks a prompt shares with an earlier one, never its last token."""
    llm = LLM("tiny", loaded=loaded, block_size=4, num_blocks=96, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=64, enable_prefix_caching=True,
              buckets=BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2),
              persistent_compilation_cache=False)
    rng = np.random.default_rng(5)
    first = rng.integers(0, loaded[1].vocab_size - 1, 18).tolist()
    shares_14 = first[:14] + [(t + 1) % 200 for t in first[14:]]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cached = [llm.generate([prompt], params)[0].num_cached_tokens
              for prompt in (first, shares_14, first, first[:8])]
    # Nothing cached; 3 blocks of the shared 14 tokens; 4 blocks of 18 (the 5th holds
    # the last token); a prompt of exactly 2 blocks keeps its last token to compute.
    assert cached == [0, 12, 16, 4]
    engine = llm.engine.state()
    assert engine.prefix_cache_hit_tokens == sum(cached)
    assert engine.prefix_cache_query_tokens == sum(len(p) for p in (first, shares_14, first,
                                                                     first[:8]))
    families = {f.name: f for f in EngineCollector(types.SimpleNamespace(state=engine)
                                                   ).collect()}
    totals = {name: next(s.value for s in families[f"jpaged:{name}"].samples
                         if s.name.endswith("_total"))
              for name in ("prefix_cache_queries", "prefix_cache_hits")}
    assert totals == {"prefix_cache_queries": engine.prefix_cache_query_tokens,
                      "prefix_cache_hits": sum(cached)}
    # The server's usage, with --enable-prompt-tokens-details, sums its prompts' hits.
    outputs = llm.generate([shares_14, first], params)
    runs = [PromptRun(i, EncodedPrompt(p), stream=None) for i, p in enumerate((shares_14,
                                                                              first))]
    for run, output in zip(runs, outputs, strict=True):
        run.add(output)
    body = CompletionRequest(model="tiny", prompt=[shares_14, first], max_tokens=2)
    usage = CompletionJob("cmpl", body, runs, "tiny", cached_tokens_in_usage=True).usage()
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16 + 16}
    assert "prompt_tokens_details" not in CompletionJob("cmpl", body, runs, "tiny").usage()
