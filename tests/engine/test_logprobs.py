"""Log-probabilities of generated and prompt tokens against transformers' logits.

The oracle is the float32 log-softmax of the PyTorch model's logits as generate() gets
them: the prompt in one forward pass, then one output token at a time (a LongRoPE
model's factors follow each pass's largest position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jpaged.core.step_shapes import BucketSizes
from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import fed_logits
from tests.plugins.layouts import layout_models, layout_params

TOP = 5


@pytest.fixture(scope="module")
def tiny(request):
    """(loaded model, transformers' model, block size) of a row of the layouts' covering
    array (tests/plugins/layouts.py)."""
    return layout_models(request, request.param)


def _rows_and_temperatures() -> list:
    """Each row once, greedy and drawing in turn (the logprobs are the model's either way;
    the temperature changes which tokens they are of)."""
    return [pytest.param(row.values[0], temperature, id=f"{row.id}-T{temperature}",
                         marks=row.marks)
            for row, temperature in zip(layout_params(), (0.0, 1.3, 0.0, 1.3), strict=True)]


def _oracle_log_probs(oracle, prompt: list[int], output: list[int]) -> np.ndarray:
    """[len(prompt + output), vocab]: row i holds log p(token i + 1 | tokens[: i + 1])."""
    logits = fed_logits(oracle, prompt + output, [len(prompt)] + [1] * len(output))
    return torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()


def _check_entry(entry, token, row: np.ndarray, k: int):
    """An entry holds the chosen token and the top k, each with its logprob and rank
    in `row` (a rank may differ only between values within the 1e-4 tolerance)."""
    assert token in entry and len(entry) in (k, k + 1)
    for t, logprob in entry.items():
        assert logprob.logprob == pytest.approx(row[t], abs=1e-4)
        surely_above, maybe_above = np.sum(row > row[t] + 1e-4), np.sum(row > row[t] - 1e-4) - 1
        assert 1 + surely_above <= logprob.rank <= 1 + maybe_above
    assert {logprob.rank for logprob in entry.values()} >= set(range(1, k + 1))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize(("tiny", "temperature"), _rows_and_temperatures(), indirect=["tiny"])
def test_output_and_prompt_logprobs_match_transformers(tiny, temperature):
    (model, config, tokenizer), oracle, block_size = tiny
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 7, 30)]
    # A 16-token budget splits the long prompt over steps: its prompt logprobs come
    # from several chunks.
    # Room for four sequences of 64 tokens in each of up to four KV cache groups.
    num_blocks = 2 + 16 * -(-64 // block_size)
    llm = LLM("tiny", loaded=(model, config, tokenizer), block_size=block_size,
              num_blocks=num_blocks,
              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              buckets=BucketSizes(min_num_tokens=8, min_num_seqs=4, min_blocks_per_seq=2),
              persistent_compilation_cache=False)
    params = SamplingParams(temperature=temperature, max_tokens=6, logprobs=TOP,
                            prompt_logprobs=TOP, ignore_eos=True, seed=1)
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        completion = output.outputs[0]
        rows = _oracle_log_probs(oracle, prompt, completion.token_ids)
        # Logprobs are the model's, before temperature: the raw log-softmax.
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                               strict=True)):
            _check_entry(entry, token, rows[len(prompt) - 1 + i], TOP)
        expected_cum = sum(rows[len(prompt) - 1 + i, t]
                           for i, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected_cum, abs=1e-3)
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            _check_entry(output.prompt_logprobs[position], prompt[position],
                         rows[position - 1], TOP)
