"""The device sampler against numpy definitions (float64) of vLLM's sampling steps.

Every expected value comes from an oracle written here from the definitions in
jpaged/model/sampler.py's docstring, never from the sampler's own output; the fast path is
also held to the full sort bit for bit.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.core.stop_rule import StopRule
from jpaged.model.sampler import (
    CANDIDATES,
    SamplerOutput,
    chunked_top_k,
    filter_logits,
    logprob_outputs,
    nucleus_cutoffs,
    process_logits,
    sample,
    token_mask,
)
from jpaged.model.verification import draft_sample, verify
from jpaged.sampling_params import SamplingParams
from jpaged.sequence import Sequence, SequenceGroup
from jpaged.worker.sampling_rows import (
    SamplingRow,
    pack_token_mask,
    sampling_row,
    sampling_tensors,
)

VOCAB = 16
ROWS = 8  # most tests pad to this many rows, so they share compilations
NUM_TOP = 3


def row(**fields) -> SamplingRow:
    """A row at temperature 1 with every filter and penalty off, but for `fields`."""
    return SamplingRow.greedy(**(dict(temperature=1.0, position=0) | fields))


def normal_logits(rows: int, vocab: int = VOCAB, scale: float = 2.0, seed: int = 0):
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def run(logits: np.ndarray, rows: list[SamplingRow], num_rows: int = ROWS) -> SamplerOutput:
    """`sample` on the rows (`verify` where they carry proposals), padded to num_rows;
    logits get zero padding rows."""
    padded = np.zeros((num_rows, logits.shape[1]), np.float32)
    padded[: len(logits)] = logits
    tensors = sampling_tensors(rows, num_rows, logits.shape[1])
    draw = sample if tensors.proposals is None else verify
    return jax.tree.map(np.asarray, draw(jnp.asarray(padded), tensors, num_top=NUM_TOP))


# ---- numpy oracles ------------------------------------------------------------------


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def np_process(logits: np.ndarray, r: SamplingRow) -> np.ndarray:
    """logit bias and min_tokens suppression, then vLLM's apply_penalties, for one row."""
    z = logits.astype(np.float64).copy()
    for token_id, bias in r.logit_bias:
        z[token_id] += bias
    z[list(r.suppressed_token_ids)] = -np.inf
    counts = np.bincount(np.asarray(r.output_token_ids, int), minlength=len(z))
    seen = counts > 0
    seen[list(r.prompt_token_ids)] = True
    for t in np.flatnonzero(seen):
        z[t] = z[t] / r.repetition_penalty if z[t] > 0 else z[t] * r.repetition_penalty
    return z - r.frequency_penalty * counts - r.presence_penalty * (counts > 0)


def np_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Which tokens min_p, then top_k, then top_p keep, from temperature-scaled logits."""
    z = scaled.astype(np.float64)
    probs = np_softmax(z)
    keep = probs >= min_p * probs.max()
    if top_k:
        kth = np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= z >= kth
    if top_p < 1.0:
        survivors = np_softmax(np.where(keep, z, -np.inf))
        order = np.argsort(-np.where(keep, z, -np.inf), kind="stable")
        before = np.concatenate([[0.0], np.cumsum(survivors[order])[:-1]])
        boundary = z[order[np.flatnonzero(before < top_p)[-1]]]
        keep &= z >= boundary
    return keep


def np_filtered_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature
    keep = np_keep(scaled, top_k, top_p, min_p)
    return np_softmax(np.where(keep, scaled, -np.inf))


def chi_square_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.72 is p = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * np.sqrt(a)) ** 3


def assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    """The tokens' frequencies fit probs (f64 [VOCAB]): none where probs is 0, and a
    one-sample chi-square test at p = 1e-4 over the rest."""
    expected = probs * len(tokens)
    observed = np.bincount(tokens, minlength=len(probs))
    kept = expected > 0
    assert not observed[~kept].any(), "drew a filtered-out token"
    statistic = np.sum((observed[kept] - expected[kept]) ** 2 / expected[kept])
    assert statistic < chi_square_critical(int(kept.sum()) - 1)


# ---- greedy, penalties, suppression --------------------------------------------------


def test_greedy_rows_take_the_first_argmax():
    logits = normal_logits(ROWS)
    logits[1, [3, 9]] = logits[1].max() + 1.0  # a tie: the first index wins
    # Filters do not apply to greedy rows (top_k 1 or min_p 1 would still keep the argmax).
    rows = [row(temperature=0.0, top_k=2, top_p=0.5, seed=i) for i in range(ROWS)]
    out = run(logits, rows)
    chex.assert_shape([out.tokens, out.logprobs, out.ranks], (ROWS,))
    chex.assert_shape([out.top_ids, out.top_logprobs], (ROWS, NUM_TOP))
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    assert out.tokens[1] == 3
    np.testing.assert_array_equal(out.ranks, 1)


def test_penalties_match_numpy():
    logits = normal_logits(7, seed=1)
    rows = [
        row(repetition_penalty=1.3, prompt_token_ids=[0, 1, 2], output_token_ids=[2, 5, 5]),
        row(repetition_penalty=0.7, output_token_ids=[4, 7]),
        row(presence_penalty=0.5, output_token_ids=[1, 1, 1, 9]),
        row(frequency_penalty=-0.4, output_token_ids=[3, 3, 8], prompt_token_ids=[8, 10]),
        row(repetition_penalty=1.2, presence_penalty=-1.5, frequency_penalty=2.0,
            prompt_token_ids=[11, 12], output_token_ids=[12, 13, 13, 13],
            suppressed_token_ids=(15,)),
        row(prompt_token_ids=[1, 2], output_token_ids=[2]),  # neutral: left as is
        row(repetition_penalty=1.5, logit_bias=((4, 3.0), (6, -2.5)), output_token_ids=[4, 6]),
    ]
    tensors = sampling_tensors(rows, 7, VOCAB)
    got = np.asarray(process_logits(jnp.asarray(logits), tensors))
    expected = np.stack([np_process(logits[i], r) for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[5], logits[5])


def test_a_penalty_changes_the_greedy_choice():
    positive = np.full(VOCAB, -3.0, np.float32)
    positive[[3, 5]] = [2.0, 1.5]
    negative = np.full(VOCAB, -5.0, np.float32)
    negative[[3, 5]] = [-1.0, -1.2]
    logits = np.stack([positive] * 5 + [negative])
    said = dict(output_token_ids=[3, 3])
    rows = [
        row(temperature=0.0, **said),  # no penalty: token 3
        row(temperature=0.0, repetition_penalty=1.5, **said),  # 2 / 1.5 < 1.5
        row(temperature=0.0, frequency_penalty=0.3, **said),  # 2 - 0.6 < 1.5
        row(temperature=0.0, presence_penalty=0.6, **said),  # 2 - 0.6 < 1.5
        row(temperature=0.0, repetition_penalty=1.5, prompt_token_ids=[3]),  # prompt counts
        row(temperature=0.0, repetition_penalty=1.5, **said),  # -1 * 1.5 < -1.2
    ]
    out = run(logits, rows)
    np.testing.assert_array_equal(out.tokens[:6], [3, 5, 5, 5, 5, 5])
    expected = [np.argmax(np_process(logits[i], r)) for i, r in enumerate(rows)]
    np.testing.assert_array_equal(out.tokens[:6], expected)


def test_suppressed_tokens_are_never_chosen_but_keep_raw_logprobs():
    num_draws = 2000
    logits = np.tile(normal_logits(1, seed=2), (num_draws, 1))
    eos = int(logits[0].argmax())
    rows = [row(temperature=0.0 if i == 0 else 1.5, seed=i, suppressed_token_ids=(eos,))
            for i in range(num_draws)]
    out = run(logits, rows, num_rows=num_draws)
    assert out.tokens[0] == np.argsort(-logits[0])[1]
    assert not np.any(out.tokens == eos)
    # Log-probabilities come from the raw logits, before suppression.
    np.testing.assert_array_equal(out.top_ids[:, 0], eos)


def test_a_logit_bias_moves_the_draws_but_not_the_logprobs():
    num_draws = 2000
    logits = np.tile(normal_logits(1, seed=12), (num_draws, 1))
    least, most = int(logits[0].argmin()), int(logits[0].argmax())
    bias = ((least, 100.0), (most, -100.0))
    rows = [row(temperature=0.0 if i == 0 else 1.0, seed=i, logit_bias=bias)
            for i in range(num_draws)]
    out = run(logits, rows, num_rows=num_draws)
    assert np.all(out.tokens == least)  # +100 outweighs any gap of these logits
    np.testing.assert_array_equal(out.top_ids[:, 0], most)
    np.testing.assert_allclose(out.logprobs, np_log_softmax(logits[0].astype(np.float64))[least],
                               rtol=1e-5)


# ---- filters ----------------------------------------------------------------------------


FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.1),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (0.7, 5, 0.8, 0.0),
    (1.3, 6, 0.7, 0.05),
    (0.5, 0, 0.9, 0.02),
    (1.0, 40, 0.95, 0.0),
]


def test_filters_keep_the_numpy_sets():
    vocab = 64
    logits = normal_logits(len(FILTERS), vocab, seed=3)
    temperature, top_k, top_p, min_p = (np.array(c) for c in zip(*FILTERS, strict=True))
    scaled = (logits / temperature[:, None].astype(np.float32)).astype(np.float32)
    got = np.asarray(jax.jit(filter_logits)(
        scaled, top_k.astype(np.int32), top_p.astype(np.float32), min_p.astype(np.float32)))
    for i, (_, k, p, m) in enumerate(FILTERS):
        keep = np_keep(scaled[i], k, p, m)
        np.testing.assert_array_equal(np.isfinite(got[i]), keep, err_msg=str(FILTERS[i]))
        np.testing.assert_array_equal(got[i][keep], scaled[i][keep])


def test_ties_at_the_top_k_and_top_p_boundaries_are_kept():
    scaled = np.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0] * 2,
                       [1.0, 1.0, 1.0, 1.0, 0.0, 0.0] * 2], np.float32)
    got = np.asarray(jax.jit(filter_logits)(scaled, np.array([2, 0], np.int32),
                                            np.array([1.0, 0.3], np.float32),
                                            np.zeros(2, np.float32)))
    np.testing.assert_array_equal(np.isfinite(got[0]), scaled[0] >= 3.0)  # 3.0 twice
    np.testing.assert_array_equal(np.isfinite(got[1]), scaled[1] == 1.0)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS[:5])
def test_sampled_frequencies_match_the_filtered_distribution(temperature, top_k, top_p, min_p):
    num_draws = 20_000
    logits = normal_logits(1, seed=4)[0]
    rows = [row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=i)
            for i in range(num_draws)]
    out = run(np.tile(logits, (num_draws, 1)), rows, num_rows=num_draws)
    assert_follows(out.tokens, np_filtered_probs(logits, temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS[1:5])
@pytest.mark.parametrize("rank", [0, 2, VOCAB - 1])
def test_verifying_a_proposal_keeps_the_filtered_distribution(temperature, top_k, top_p,
                                                              min_p, rank):
    """Speculative decoding's rule with a one-hot proposal d (an n-gram's): accept with
    probability p(d), else draw from p without d. The tokens must follow p itself, for a
    likely proposal, a less likely one and one the filters remove."""
    num_draws = 20_000
    logits = normal_logits(1, seed=4)[0]
    proposal = int(np.argsort(-logits, kind="stable")[rank])
    rows = [row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=i,
                proposal=proposal) for i in range(num_draws)]
    out = run(np.tile(logits, (num_draws, 1)), rows, num_rows=num_draws)
    probs = np_filtered_probs(logits, temperature, top_k, top_p, min_p)
    assert_follows(out.tokens, probs)
    np.testing.assert_array_equal(out.tokens[out.accepted], proposal)
    accepted = out.accepted.sum()  # binomial(num_draws, p(d)), within 4.5 sigma
    sigma = np.sqrt(num_draws * probs[proposal] * (1 - probs[proposal]))
    assert abs(accepted - num_draws * probs[proposal]) <= 4.5 * sigma + 1e-9


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS[1:5])
def test_verifying_a_draft_models_proposal_keeps_the_filtered_distribution(
        temperature, top_k, top_p, min_p):
    """A draft model that disagrees with the target draws its proposal from its own
    filtered distribution q (`draft_sample`); verified against q, the tokens follow the
    target's p: accepted with min(1, p/q), else drawn from max(0, p - q)."""
    num_draws = 20_000
    logits, draft_logits = normal_logits(2, seed=7)
    rows = [row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=i)
            for i in range(num_draws)]
    tensors = sampling_tensors(rows, num_draws, VOCAB)
    proposals, draft_probs = draft_sample(jnp.tile(draft_logits, (num_draws, 1)), tensors)
    q = np_filtered_probs(draft_logits, temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(np.asarray(draft_probs[0]), q, atol=1e-6)
    assert_follows(np.asarray(proposals), q)  # the draft's own draws
    verifying = dataclasses.replace(
        tensors, proposals=np.asarray(proposals, np.int32), draft_probs=draft_probs)
    out = jax.tree.map(np.asarray, verify(jnp.tile(logits, (num_draws, 1)), verifying,
                                          num_top=NUM_TOP))
    assert_follows(out.tokens, np_filtered_probs(logits, temperature, top_k, top_p, min_p))
    assert 0 < out.accepted.mean() < 1


def test_greedy_rows_accept_a_proposal_equal_to_their_argmax():
    logits = normal_logits(4, seed=6)
    best = logits.argmax(axis=1)
    proposals = [int(best[0]), int(best[1]) ^ 1, -1, int(best[3])]
    rows = [row(temperature=0.0, proposal=p) for p in proposals]
    rows[3] = row(temperature=0.0, proposal=proposals[3], logit_bias=((int(best[3]), -50.0),))
    out = run(logits, rows)
    np.testing.assert_array_equal(out.accepted[:4], [True, False, False, False])
    np.testing.assert_array_equal(out.tokens[:3], best[:3])  # the target's choice
    assert out.tokens[3] != best[3]


def test_the_draw_is_jax_random_categorical_from_the_documented_key():
    logits = normal_logits(ROWS, seed=5)
    rows = [row(temperature=0.8, seed=10 + i, sample_index=i % 3, position=5 * i)
            for i in range(ROWS)]
    out = run(logits, rows)
    for i, r in enumerate(rows):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(r.seed), r.sample_index),
                                 r.position)
        scaled = jnp.asarray(logits[i]) / jnp.float32(r.temperature)
        assert out.tokens[i] == jax.random.categorical(key, scaled)


def test_a_64_bit_seed_folds_its_high_bits_into_the_key_of_its_low_bits():
    logits = np.tile(normal_logits(1, seed=13) * 0.1, (ROWS, 1))  # flat: seeds differ
    seeds = [-1, 2**40 + 5, -2**63, 2**63 - 1, 5, 2**32 - 1, 2**32, -(2**32)]
    rows = [row(seed=seed, sample_index=1, position=3) for seed in seeds]
    out = run(logits, rows)
    for seed, token in zip(seeds, out.tokens, strict=True):
        low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        key = jax.random.key(low)
        if high:
            key = jax.random.fold_in(key, high)
        key = jax.random.fold_in(jax.random.fold_in(key, 1), 3)
        assert token == jax.random.categorical(key, jnp.asarray(logits[0])), seed


# ---- the candidate fast path against the full sort ----------------------------------------


def test_candidates_give_the_full_sort_cutoffs_bit_for_bit():
    vocab = 4096
    rng = np.random.default_rng(6)
    normal = rng.standard_normal((6, vocab)).astype(np.float32)
    scaled = np.stack([
        normal[0] * 5,  # top_p 0.9: the candidates hold it
        normal[1] * 2,  # top_k 50
        1e-3 * normal[2],  # flat, top_p 0.999: only the whole sorted row answers
        normal[3] * 2,  # top_k 300 > CANDIDATES, with top_p 0.95
        normal[4] * 3,  # min_p 0.05 and top_p 0.8
        normal[5],  # no filter
    ]).astype(np.float32)
    top_k = np.array([0, 50, 0, 300, 0, 0], np.int32)
    top_p = np.array([0.9, 1.0, 0.999, 0.95, 0.8, 1.0], np.float32)
    min_p = np.array([0, 0, 0, 0, 0.05, 0], np.float32)
    assert CANDIDATES < 300 < vocab
    filtered = jax.jit(filter_logits)
    # With top_k and top_p off, filter_logits applies min_p alone.
    masked = filtered(scaled, np.zeros_like(top_k), np.ones_like(top_p), min_p)
    cutoffs = jax.jit(nucleus_cutoffs, static_argnames="size")
    fast, answered = cutoffs(masked, top_k, top_p, size=CANDIDATES)
    full, _ = cutoffs(masked, top_k, top_p, size=vocab)
    np.testing.assert_array_equal(answered, [True, True, False, False, True, True])
    np.testing.assert_array_equal(np.asarray(fast)[answered], np.asarray(full)[answered])
    # The mixed batch falls back for two rows; every row is the full sort's.
    got = np.asarray(filtered(scaled, top_k, top_p, min_p))
    np.testing.assert_array_equal(
        got, np.where(masked >= np.asarray(full)[:, None], masked, -np.inf))
    # Rows the candidates answer give the same logits in a batch that never falls back.
    fast_rows = np.flatnonzero(answered)
    alone = filtered(scaled[fast_rows], top_k[fast_rows], top_p[fast_rows], min_p[fast_rows])
    np.testing.assert_array_equal(np.asarray(alone), got[fast_rows])
    for i in range(len(scaled)):
        keep = np_keep(scaled[i], top_k[i], top_p[i], min_p[i])
        np.testing.assert_array_equal(np.isfinite(got[i]), keep, err_msg=f"row {i}")


def test_a_seeded_row_gets_its_token_alone_in_a_batch_and_reordered():
    vocab = 4096
    logits = normal_logits(4, vocab, scale=4.0, seed=7)
    logits[2] = normal_logits(1, vocab, scale=1e-3, seed=8)  # makes its batch fall back
    rows = [
        row(top_p=0.9, seed=7, position=12, sample_index=1),
        row(temperature=0.0),
        row(top_p=0.999, seed=3),
        row(top_k=20, min_p=0.01, seed=4, presence_penalty=0.5, output_token_ids=[1, 2]),
    ]
    def token_of_first(order):
        return run(logits[order], [rows[i] for i in order], num_rows=4).tokens[order.index(0)]

    assert token_of_first([0]) == token_of_first([0, 1, 2, 3]) == token_of_first([3, 2, 0])


# ---- log-probabilities, padding, host arrays -----------------------------------------


def test_logprobs_ranks_and_top_tokens_match_numpy():
    logits = normal_logits(4, scale=3.0, seed=9)
    rows = [row(temperature=0.0), row(seed=1, logprob_temperature=0.5),
            row(seed=2, top_k=4, logprob_temperature=2.0),
            row(seed=3, repetition_penalty=2.0, output_token_ids=[0, 1, 2])]
    out = run(logits, rows)
    for i, r in enumerate(rows):
        lp = np_log_softmax(logits[i].astype(np.float64) / r.logprob_temperature)
        token = out.tokens[i]
        np.testing.assert_allclose(out.logprobs[i], lp[token], rtol=1e-5)
        assert out.ranks[i] == 1 + np.sum(lp > lp[token])
        np.testing.assert_array_equal(out.top_ids[i], np.argsort(-lp)[:NUM_TOP])
        np.testing.assert_allclose(out.top_logprobs[i], np.sort(lp)[::-1][:NUM_TOP], rtol=1e-5)


def test_logprob_outputs_read_any_target():
    logits = normal_logits(5, scale=3.0, seed=11)
    targets = np.array([0, 3, 15, 7, 7], np.int32)
    bf16 = jnp.asarray(logits, jnp.bfloat16)  # as a bf16 model returns them
    lp_got, ranks, top_ids, top_lp = jax.jit(logprob_outputs, static_argnums=2)(bf16, targets, 2)
    chex.assert_shape([top_ids, top_lp], (5, 2))
    for i, t in enumerate(targets):
        lp = np_log_softmax(np.asarray(bf16[i], np.float64))
        np.testing.assert_allclose(lp_got[i], lp[t], rtol=1e-5)
        assert ranks[i] == 1 + np.sum(lp > lp[t])
        np.testing.assert_array_equal(top_ids[i], np.argsort(-lp)[:2])


@pytest.mark.parametrize("vocab", [1000, 3 * 128 + 5, 49152])
@pytest.mark.parametrize("k", [1, 7, 20])
def test_chunked_top_k_is_the_stable_sort_with_ties_and_minus_infinity(vocab, k):
    """The k largest in numpy's stable order (ties: the lower index first), on rows of
    a few distinct values with -inf among them, so that ties cross chunk boundaries."""
    rng = np.random.default_rng(vocab + k)
    x = rng.integers(-4, 4, (6, vocab)).astype(np.float32)
    x[x < -2] = -np.inf
    x[1] = -np.inf  # a row without a finite value
    x[2] = rng.standard_normal(vocab)  # and one without ties
    values, ids = jax.jit(chunked_top_k, static_argnums=1)(jnp.asarray(x), k)
    expected = np.argsort(-x, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(values, np.take_along_axis(x, expected, axis=1))


def test_padding_rows_change_nothing():
    logits = normal_logits(3, seed=10)
    rows = [row(top_p=0.8, seed=1), row(temperature=0.0),
            row(top_k=3, seed=2, frequency_penalty=0.5, output_token_ids=[4])]
    unpadded = run(logits, rows, num_rows=3)
    padded = run(logits, rows, num_rows=ROWS)
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[:3], padded), unpadded, rtol=0, atol=0)
    np.testing.assert_array_equal(padded.tokens[3:], 0)  # greedy on zero logits


def test_sampling_rows_map_vllm_conventions():
    history = dict(prompt_token_ids=[1, 2], output_token_ids=[2, 2, 5])
    plain_greedy = SamplingRow.greedy(position=3, repetition_penalty=1.5)
    assert (plain_greedy.temperature, plain_greedy.top_k, plain_greedy.top_p, plain_greedy.min_p,
            plain_greedy.penalties, plain_greedy.position) == (0.0, 0, 1.0, 0.0, (1.5, 0, 0), 3)
    greedy = SamplingRow.of(SamplingParams(temperature=5e-6, top_k=-1, top_p=0.5), seed=3,
                            sample_index=1, position=9, **history)
    sampled = SamplingRow.of(SamplingParams(temperature=0.8, top_k=-1, min_p=0.1,
                                            presence_penalty=0.5), seed=4, sample_index=0,
                             position=2, suppressed_token_ids=[7], **history)
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, 0, 0.5)
    assert (sampled.temperature, sampled.top_k, sampled.min_p) == (0.8, 0, 0.1)
    assert sampled.suppressed_token_ids == (7,)

    plain = sampling_tensors([greedy], 4, VOCAB)
    assert plain.penalties is None and plain.output_counts is None
    np.testing.assert_array_equal(plain.temperature, [0, 0, 0, 0])
    np.testing.assert_array_equal(plain.top_p, [0.5, 1, 1, 1])
    np.testing.assert_array_equal(plain.logprob_temperature, 1.0)
    np.testing.assert_array_equal(plain.positions, [9, 0, 0, 0])
    assert plain.seeds.dtype == np.uint32 and plain.top_k.dtype == np.int32

    dense = sampling_tensors([greedy, sampled], 4, VOCAB)
    chex.assert_shape([dense.output_counts, dense.prompt_mask, dense.bias], (4, VOCAB))
    np.testing.assert_array_equal(dense.penalties, [[1, 0, 0], [1, 0.5, 0], [1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(dense.output_counts[1, [2, 5]], [2, 1])
    assert dense.output_counts.sum() == 3  # only the row with penalties reads its counts
    np.testing.assert_array_equal(np.flatnonzero(dense.prompt_mask[1]), [1, 2])
    np.testing.assert_array_equal(np.flatnonzero(np.isinf(dense.bias).any(0)), [7])
    biased = sampling_tensors([SamplingRow.of(SamplingParams(logit_bias={3: -2.0}), seed=2**33,
                                              sample_index=0, position=0, **history)], 2, VOCAB)
    assert biased.penalties is not None and biased.bias[0, 3] == -2.0
    np.testing.assert_array_equal(biased.seeds, [0, 0])
    np.testing.assert_array_equal(biased.seed_high, [2, 0])
    with pytest.raises(ValueError, match="do not fit"):
        sampling_tensors([greedy] * 5, 4, VOCAB)


# ---- token masks (structured outputs' extension point) ---------------------------------


def np_pack(allowed: np.ndarray) -> np.ndarray:
    """The packing convention word by word: bit b of word w is token 32 w + b."""
    words = [sum(1 << b for b in range(32) if 32 * w + b < len(allowed) and allowed[32 * w + b])
             for w in range(-(-len(allowed) // 32))]
    return np.array(words, np.uint32).view(np.int32)


def random_masks(rows: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    """bool [rows, vocab], about half the tokens of each row allowed, never none."""
    rng = np.random.default_rng(seed)
    masks = rng.random((rows, vocab)) < 0.5
    masks[np.arange(rows), rng.integers(0, vocab, rows)] = True
    return masks


def masked(r: SamplingRow, allowed: np.ndarray) -> SamplingRow:
    return dataclasses.replace(r, allowed_tokens=pack_token_mask(allowed))


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000])
def test_token_masks_pack_and_unpack_by_the_documented_convention(vocab):
    allowed = random_masks(3, vocab, seed=vocab)
    packed = np.stack([pack_token_mask(a) for a in allowed])
    np.testing.assert_array_equal(packed, np.stack([np_pack(a) for a in allowed]))
    assert packed.dtype == np.int32 and packed.shape == (3, -(-vocab // 32))
    np.testing.assert_array_equal(np.asarray(jax.jit(token_mask, static_argnums=1)(
        packed, vocab)), allowed)


def test_sampling_tensors_carry_every_rows_token_mask():
    allowed = random_masks(1, 40)[0]
    plain = sampling_tensors([row(), row()], 4, 40)
    np.testing.assert_array_equal(np.asarray(plain.allowed_tokens), np.full((4, 2), -1))
    tensors = sampling_tensors([row(), masked(row(), allowed)], 4, 40)
    chex.assert_shape(tensors.allowed_tokens, (4, 2))
    assert tensors.allowed_tokens.dtype == np.int32
    np.testing.assert_array_equal(tensors.allowed_tokens[1], np_pack(allowed))
    # Rows without a mask, padding included, allow every token: all bits set.
    np.testing.assert_array_equal(tensors.allowed_tokens[[0, 2, 3]], -1)


def test_a_mask_allowing_every_token_leaves_the_sampler_bit_identical():
    logits = normal_logits(ROWS, seed=25)
    plain = [row(temperature=t, top_p=0.9, seed=i, position=i, **penalty)
             for i, (t, penalty) in enumerate(
                 [(0.0, {}), (0.8, {}), (1.0, {"presence_penalty": 0.5,
                                              "output_token_ids": [3]})] * 3)][:ROWS]
    every = np.ones(VOCAB, bool)
    tensors = sampling_tensors([masked(r, every) for r in plain], ROWS, VOCAB)
    assert isinstance(tensors.allowed_tokens, np.ndarray)  # the host's, not the default
    np.testing.assert_array_equal(
        np.asarray(process_logits(jnp.asarray(logits), tensors)),
        np.asarray(process_logits(jnp.asarray(logits), sampling_tensors(plain, ROWS, VOCAB))))
    out, unmasked = run(logits, [masked(r, every) for r in plain]), run(logits, plain)
    for name in ("tokens", "logprobs", "ranks", "top_ids", "top_logprobs", "finite"):
        np.testing.assert_array_equal(getattr(out, name), getattr(unmasked, name),
                                      err_msg=name)


def test_a_row_whose_mask_and_suppressed_tokens_leave_nothing_is_not_finite():
    logits = normal_logits(2, seed=26)
    only_eos = np.zeros(VOCAB, bool)
    only_eos[3] = True
    rows = [masked(row(temperature=t, suppressed_token_ids=(3,)), only_eos)
            for t in (0.0, 1.0)] + [row(temperature=0.0)]
    out = run(np.concatenate([logits, logits[:1]]), rows)
    np.testing.assert_array_equal(out.finite[:3], [False, False, True])


def test_greedy_rows_take_the_argmax_of_the_allowed_tokens():
    logits = normal_logits(ROWS, seed=20)
    allowed = random_masks(ROWS, seed=20)
    allowed[np.arange(ROWS), logits.argmax(-1)] = False  # the mask must change the choice
    plain = [row(temperature=0.0) for _ in range(ROWS)]
    plain[5] = row(temperature=0.0, repetition_penalty=1.5, output_token_ids=[1, 2, 3])
    rows = [masked(r, a) for r, a in zip(plain, allowed, strict=True)]
    rows[6] = plain[6]  # a row without a mask in a masked batch
    out = run(logits, rows)
    expected = [np.argmax(np.where(allowed[i], np_process(logits[i], r), -np.inf))
                for i, r in enumerate(rows)]
    expected[6] = np.argmax(logits[6])
    np.testing.assert_array_equal(out.tokens, expected)
    # Log-probabilities are those of the raw logits: the top ones as without masks, and
    # each token's its raw log-probability.
    unmasked = run(logits, plain)
    np.testing.assert_array_equal(out.top_ids, unmasked.top_ids)
    np.testing.assert_array_equal(out.top_logprobs, unmasked.top_logprobs)
    raw = np.array([np_log_softmax(logits[i].astype(np.float64))[t]
                    for i, t in enumerate(out.tokens)])
    np.testing.assert_allclose(out.logprobs, raw, rtol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS[:5])
def test_sampled_frequencies_follow_the_filtered_distribution_of_the_allowed_tokens(
        temperature, top_k, top_p, min_p):
    num_draws = 20_000
    logits = normal_logits(1, seed=4)[0]
    allowed = np.ones(VOCAB, bool)
    allowed[np.argsort(-logits)[::3]] = False  # every third token by rank, the best first
    rows = [masked(row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       seed=i), allowed) for i in range(num_draws)]
    out = run(np.tile(logits, (num_draws, 1)), rows, num_rows=num_draws)
    restricted = np.where(allowed, logits, -np.inf)
    assert_follows(out.tokens, np_filtered_probs(restricted, temperature, top_k, top_p, min_p))


def test_rows_without_a_mask_draw_as_in_a_batch_without_masks():
    logits = normal_logits(ROWS, seed=21)
    plain = [row(temperature=0.9, top_p=0.8, seed=i, position=i) for i in range(ROWS)]
    plain[3] = row(temperature=1.0, presence_penalty=0.5, output_token_ids=[2], seed=3)
    rows = [masked(r, a) if i % 2 else r
            for i, (r, a) in enumerate(zip(plain, random_masks(ROWS, seed=21), strict=True))]
    out, unmasked = run(logits, rows), run(logits, plain)
    for name in ("tokens", "logprobs", "ranks", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(out, name)[::2], getattr(unmasked, name)[::2],
                                      err_msg=name)
    # Every row's log-probabilities are the raw logits', masked or not.
    np.testing.assert_array_equal(out.top_logprobs, unmasked.top_logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_proposal_outside_the_mask_is_never_accepted(temperature):
    num_draws = 4_000
    logits = normal_logits(1, seed=22)[0]
    best = int(np.argmax(logits))
    allowed = np.ones(VOCAB, bool)
    allowed[best] = False
    # Half the rows propose the target's favourite, which the mask forbids; half propose
    # an allowed token.
    inside = int(np.argsort(-logits)[1])
    rows = [masked(row(temperature=temperature, seed=i, proposal=best if i % 2 else inside),
                   allowed) for i in range(num_draws)]
    out = run(np.tile(logits, (num_draws, 1)), rows, num_rows=num_draws)
    assert not out.accepted[1::2].any()
    assert out.accepted[::2].any()
    np.testing.assert_array_equal(out.tokens[out.accepted], inside)
    assert allowed[out.tokens].all()
    if temperature:
        assert_follows(out.tokens, np_filtered_probs(np.where(allowed, logits, -np.inf),
                                                     temperature))
    else:  # the argmax of the allowed tokens
        np.testing.assert_array_equal(out.tokens, inside)


def test_a_draft_model_draws_inside_the_mask():
    num_draws = 2_000
    logits = normal_logits(1, seed=23)[0]
    allowed = random_masks(1, seed=23)[0]
    rows = [masked(row(temperature=t, seed=i), allowed)
            for i, t in enumerate([0.0] + [1.0] * (num_draws - 1))]
    proposals, draft_probs = draft_sample(jnp.tile(logits, (num_draws, 1)),
                                          sampling_tensors(rows, num_draws, VOCAB))
    assert allowed[np.asarray(proposals)].all()
    assert not np.asarray(draft_probs)[:, ~allowed].any()


def test_each_row_of_a_verifying_sequence_takes_its_own_mask():
    group = SequenceGroup("r", [Sequence(0, [1, 2, 3], [4])], SamplingParams(temperature=0.5),
                          seed=7)
    group.stop_rule = StopRule.of(group, max_model_len=64)
    seq = group.seqs[0]
    masks = [pack_token_mask(a) for a in random_masks(3, seed=24)]
    proposals = [5, 6]
    rows = [sampling_row(group, seq, 0, proposals[:j], proposal, allowed_tokens=masks[j])
            for j, proposal in enumerate(proposals)]
    rows.append(sampling_row(group, seq, 0, proposals, allowed_tokens=masks[2]))
    tensors = sampling_tensors(rows, 4, VOCAB)
    np.testing.assert_array_equal(tensors.allowed_tokens[:3], np.stack(masks))
    assert sampling_row(group, seq, 0).allowed_tokens is None
