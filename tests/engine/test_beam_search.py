"""Beam search in the engine against two oracles.

- transformers scoring: the best beam equals transformers' own
  `generate(num_beams=w, do_sample=False)` token for token.
- vLLM scoring: every returned beam and score equals a brute-force beam search
  written here (expand every beam by the PyTorch model's log-probabilities,
  keep the best beam_width by vLLM's score, EOS candidates kept as finished).

Tie rule: where two candidates' accumulated log-probabilities differ by less
than 1e-5, float rounding may order them either way; a divergence is accepted
only at such a step, and each test reports how many it met.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jpaged.engine.beam_search import vllm_score
from jpaged.entrypoints.llm import LLM
from jpaged.memory.kv_cache_groups import KVCacheGroups
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.sequence import SequenceStatus
from tests.plugins.layouts import layout_models, layout_params

TIE = 1e-5
TINY_ENGINE = dict(num_blocks=None, kv_cache_memory_bytes=8 << 20, max_num_seqs=16,
                   max_num_batched_tokens=64, max_model_len=64,
                   persistent_compilation_cache=False)


def _prompts(vocab_size: int, num: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size - 1, int(rng.integers(1, 12))).tolist()
            for _ in range(num)]


def _log_probs(model, tokens: list[int]) -> torch.Tensor:
    """float32 log-softmax of the PyTorch model's next-token logits after `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def _accumulated(model, prompt: list[int], output: list[int]) -> float:
    """Sum of the output tokens' log-probabilities, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return float(sum(log_probs[len(prompt) - 1 + i, t] for i, t in enumerate(output)))


def _divergence_is_a_tie(model, prompt, ours: list[int], theirs: list[int]) -> bool:
    """At the first differing token, were both prefixes (near) equally likely?"""
    pairs = zip(ours + [-1], theirs + [-1], strict=False)
    first = next(i for i, (a, b) in enumerate(pairs) if a != b)
    ours_score = _accumulated(model, prompt, ours[: first + 1])
    theirs_score = _accumulated(model, prompt, theirs[: first + 1])
    return abs(ours_score - theirs_score) < TIE


def _transformers_best(model, prompt, width, max_tokens, length_penalty, early_stopping, eos):
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width, do_sample=False, max_new_tokens=max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping,
        eos_token_id=list(eos), pad_token_id=eos[0],
    )
    return out[0, len(prompt):].tolist()


def _best_beams(llm, prompts, params_list, others=()):
    """Every (prompt, params) beam search in one engine run, beside `others` sampled
    requests; returns the best beam's output tokens of each."""
    engine = llm.engine
    for i, prompt in enumerate(others):
        engine.add_request(f"other-{i}", prompt, SamplingParams(max_tokens=20, seed=i))
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(f"beam-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert all(f"other-{i}" in done for i in range(len(others)))
    return [done[f"beam-{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _compare(oracle, prompts, params_list, ours, eos) -> int:
    ties = 0
    for prompt, params, tokens in zip(prompts, params_list, ours, strict=True):
        expected = _transformers_best(oracle, prompt, params.beam_width, params.max_tokens,
                                      params.length_penalty, params.early_stopping, eos)
        if tokens != expected:
            assert _divergence_is_a_tie(oracle, prompt, tokens, expected), (prompt, params)
            ties += 1
    return ties


@pytest.fixture(scope="module", params=layout_params())
def tiny(request):
    """(loaded model, transformers' model, block size) of a row of the layouts' covering
    array (tests/plugins/layouts.py)."""
    return layout_models(request, request.param)


def _transformers_params(prompts):
    """Widths 2 and 4, with assorted length penalties and early-stopping rules."""
    rules = [(1.0, False), (0.0, True), (2.0, "never"), (-0.5, False)]
    return [
        BeamSearchParams(beam_width=2 if i % 2 == 0 else 4, max_tokens=10, scoring="transformers",
                         length_penalty=rules[i % 4][0], early_stopping=rules[i % 4][1])
        for i in range(len(prompts))
    ]


def test_transformers_scoring_matches_generate(tiny):
    (model, config, tokenizer), oracle, block_size = tiny
    prompts = _prompts(config.vocab_size, 8, seed=block_size)
    params = _transformers_params(prompts)
    llm = LLM("tiny", loaded=(model, config, tokenizer), block_size=block_size, **TINY_ENGINE)
    eos = llm.engine.eos_token_ids
    together = _best_beams(llm, prompts, params, others=_prompts(config.vocab_size, 3, 9))
    ties = _compare(oracle, prompts, params, together, eos)
    alone = [_best_beams(llm, [p], [q])[0] for p, q in zip(prompts[:3], params[:3], strict=True)]
    ties += _compare(oracle, prompts[:3], params[:3], alone, eos)
    print(f"tie divergences: {ties}")
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_device_blocks


def brute_force_vllm(model, prompt, params: BeamSearchParams, eos) -> list[tuple]:
    """vLLM's beam search spelled out: every beam proposes its 2 * width best tokens;
    EOS candidates finish (unless ignore_eos); the best width others live on. Returns (tokens after
    the prompt, cumulative logprob, score) best first, and the smallest score gap
    met at a selection boundary."""
    width = params.beam_width

    def score(output, cum):
        length = len(prompt) + len(output) - (1 if output and output[-1] in eos else 0)
        return vllm_score(cum, length, params.length_penalty)

    beams, finished, gap = [([], 0.0)], [], np.inf
    for _ in range(params.max_tokens):
        candidates = []
        for output, cum in beams:
            top = torch.topk(_log_probs(model, prompt + output), 2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                ends = token in eos and not params.ignore_eos
                (finished if ends else candidates).append((output + [token], cum + lp))
        candidates.sort(key=lambda c: score(*c), reverse=True)
        if len(candidates) > width:
            gap = min(gap, score(*candidates[width - 1]) - score(*candidates[width]))
        beams = candidates[:width]
    ranked = sorted(finished + beams, key=lambda c: score(*c), reverse=True)
    if len(ranked) > width:
        gap = min(gap, score(*ranked[width - 1]) - score(*ranked[width]))
    return [(o, c, score(o, c)) for o, c in ranked[:width]], gap


def test_vllm_scoring_matches_brute_force(tiny):
    (model, config, tokenizer), oracle, block_size = tiny
    llm = LLM("tiny", loaded=(model, config, tokenizer), block_size=block_size, **TINY_ENGINE)
    eos = llm.engine.eos_token_ids
    prompts = _prompts(config.vocab_size, 4, seed=5)
    params = [BeamSearchParams(beam_width=w, max_tokens=6, length_penalty=lp, ignore_eos=i)
              for w, lp, i in [(2, 1.0, False), (3, 0.5, True), (4, 1.0, False), (2, 2.0, False)]]
    ties = 0
    for prompt, p in zip(prompts, params, strict=True):
        (ours,) = llm.beam_search([prompt], p)
        expected, gap = brute_force_vllm(oracle, prompt, p, eos)
        if gap < TIE:
            ties += 1
            continue
        assert [s.tokens[len(prompt):] for s in ours.sequences] == [e[0] for e in expected]
        for sequence, (_, cum, score) in zip(ours.sequences, expected, strict=True):
            assert sequence.cum_logprob == pytest.approx(cum, abs=1e-4)
            length = len(sequence.tokens) - (sequence.tokens[-1] in eos)
            assert vllm_score(sequence.cum_logprob, length, p.length_penalty) == pytest.approx(
                score, abs=1e-4)
    print(f"tie divergences: {ties}")


def test_beams_hold_one_copy_of_the_prompt(tiny):
    """Every step of a search, all beams share the prompt's full blocks: the pool holds
    them once, plus at most each beam's own blocks past them, in each KV cache group. A
    sliding layers' group holds neither kind once the window has left it."""
    (model, config, tokenizer), _, block_size = tiny
    width, prompt_len = 4, 30  # at block size 4, 7 full blocks and a partial one
    llm = LLM("tiny", loaded=(model, config, tokenizer), block_size=block_size, **TINY_ENGINE)
    engine, manager = llm.engine, llm.engine.block_manager
    prompt = _prompts(config.vocab_size, 1, seed=3)[0] * 30
    engine.add_request("beams", prompt[:prompt_len],
                       BeamSearchParams(beam_width=width, max_tokens=12, ignore_eos=True))
    full = prompt_len // block_size
    windows = KVCacheGroups.of(config.layer_windows).windows
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [s for s in engine.scheduler.running for s in s.seqs_with(SequenceStatus.RUNNING)]
        if len(live) == width:
            steps += 1
            computed = live[0].num_computed_tokens
            per_beam = -(-computed // block_size)
            released = [0 if window is None else max(0, computed - window + 1) // block_size
                        for window in windows]
            assert manager.logical_blocks_used == sum(width * (per_beam - r) for r in released)
            most = sum(max(0, full - r) + width * (per_beam - max(full, r)) for r in released)
            assert manager.physical_blocks_used <= most
    assert steps >= 10
    assert manager.num_free_blocks == manager.num_device_blocks
