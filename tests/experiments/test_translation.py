"""Figure 16's workload against its stated definition: the prefixes as transformers'
tokenizer of the default model counts them, near the paper's 80 and 341 tokens; prompts
that start with the prefix and carry one sentence whose output is as long; sentence
lengths from the stated log-normal; Poisson arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.paper import FIGURE16_PREFIX_TOKENS
from experiments.translation import (
    EXAMPLES,
    INSTRUCTION,
    SHOTS,
    SentenceLengths,
    TranslationPrompts,
    prefix_text,
    translation_workload,
)


class WordTokenizer:
    """One id per whitespace-separated word (a stand-in with countable output)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


@pytest.mark.default_model
@pytest.mark.parametrize("prefix", sorted(SHOTS))
def test_prefixes_are_the_default_models_tokens_near_the_papers_counts(prefix):
    from jpaged.model.loader import default_model_directory
    from jpaged.model.tokenizer import Tokenizer
    from tests.plugins.hf_models import oracle_transformers

    directory = default_model_directory()
    oracle = oracle_transformers().AutoTokenizer.from_pretrained(directory)
    prompts = TranslationPrompts.of(Tokenizer.from_directory(directory), prefix)
    expected = oracle(prefix_text(prefix), add_special_tokens=False)["input_ids"]
    assert list(prompts.prefix_ids) == expected
    # "near": within 2% of the paper's LLaMA counts.
    assert abs(len(expected) - FIGURE16_PREFIX_TOKENS[prefix]) <= 0.02 * FIGURE16_PREFIX_TOKENS[
        prefix]


def test_the_prefix_text_holds_the_instruction_and_its_examples():
    one, five = prefix_text("one-shot"), prefix_text("five-shot")
    assert one.startswith(INSTRUCTION) and five.startswith(one)
    for english, german in EXAMPLES:
        assert (english in five) and (german in five)
    assert (EXAMPLES[1][0] in one) is False


def test_every_prompt_is_the_prefix_then_its_sentence_and_the_output_as_long():
    prompts = TranslationPrompts.of(WordTokenizer(), "five-shot")
    requests = translation_workload(prompts, 200, vocab_size=1000, seed=3)
    head = prompts.prefix_ids + prompts.source_label_ids
    for request in requests:
        tokens = request.prompt_token_ids
        assert tokens[:len(head)] == head
        assert tokens[-len(prompts.target_label_ids):] == prompts.target_label_ids
        sentence_len = len(tokens) - len(prompts.prefix_ids) - prompts.template_len
        assert request.output_len == sentence_len
        assert all(0 <= t < 1000 for t in tokens[len(head):len(head) + sentence_len])
    assert len({r.request_id for r in requests}) == 200


def test_sentence_lengths_follow_the_stated_log_normal():
    lengths = SentenceLengths()
    # Without the clip the median and the spread of log-lengths are the stated ones.
    unclipped = SentenceLengths(lengths.median, lengths.sigma, low=0, high=10**9)
    drawn = unclipped.sample(20_000, np.random.default_rng(0))
    assert abs(np.median(drawn) - lengths.median) <= 0.5
    assert abs(np.std(np.log(drawn)) - lengths.sigma) <= 0.01
    clipped = lengths.sample(20_000, np.random.default_rng(0))
    assert clipped.min() >= lengths.low and clipped.max() <= lengths.high


def test_arrivals_are_poisson_at_the_rate_and_lengths_do_not_depend_on_it():
    prompts = TranslationPrompts.of(WordTokenizer(), "one-shot")
    at_once = translation_workload(prompts, 4000, vocab_size=100, seed=1)
    paced = translation_workload(prompts, 4000, vocab_size=100, seed=1, request_rate=5.0)
    assert {r.arrival_time for r in at_once} == {0.0}
    gaps = np.diff([0.0] + [r.arrival_time for r in paced])
    assert math.isclose(gaps.mean(), 1 / 5.0, rel_tol=0.05)
    assert math.isclose(gaps.std(), gaps.mean(), rel_tol=0.07)  # exponential: std = mean
    assert [r.prompt_token_ids for r in at_once] == [r.prompt_token_ids for r in paced]


def test_an_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="ten-shot"):
        TranslationPrompts.of(WordTokenizer(), "ten-shot")
