"""Verification of proposals (speculative decoding), on the sampler's rows.

A row with a proposal d drawn from a distribution q (a draft model's, or one-hot for an
n-gram's) accepts it if greedy and d is the argmax of the processed logits (steps 1
and 2 of jpaged.model.sampler), else with probability min(1, p(d) / q(d)) (Leviathan
et al.), p the distribution the sampler's steps 4 to 7 leave, from a uniform drawn with
the key fold_in(row key, ACCEPT_STREAM); a row that rejects draws from the residual
max(0, p - q), normalised, with the row's key. A row of the batch without a proposal
draws from p with its key. A draft model draws its proposals with `draft_sample`: the
sampler's steps on its own logits, with the key fold_in(row key, DRAFT_STREAM).
Log-probabilities are the sampler's, from the raw logits. A row's token mask (step 1)
leaves a token outside it probability 0, so a proposal outside the mask is never
accepted, and greedy rows' argmax lies inside it.
"""

from __future__ import annotations

from functools import cache

import chex
import jax
import jax.numpy as jnp

from jpaged.model.sampler import (
    SamplerOutput,
    SamplingTensors,
    compiler_options,
    filtered_logits,
    first_argmax,
    process_logits,
    row_key,
    sampler_output,
)

# The stream folded into a row's key for the uniform that accepts or rejects its
# proposal, apart from the Gumbel noise of its draw.
ACCEPT_STREAM = 1
# The stream of a draft model's draw for a row, independent of both of the above.
DRAFT_STREAM = 2


def verify(logits: chex.Array, tensors: SamplingTensors, num_top: int) -> SamplerOutput:
    """`sample` for rows that carry proposals (tensors.proposals, -1 for none): each row's
    token, and whether it is the row's accepted proposal. logits: [B, V]."""
    return _compiled_verify()(logits, tensors, num_top)


def verify_tokens(logits: chex.Array, tensors: SamplingTensors, num_top: int
                  ) -> SamplerOutput:
    """What `verify` compiles."""
    raw = logits.astype(jnp.float32)
    processed = process_logits(raw, tensors)
    tokens = first_argmax(processed)
    accepted = tokens == tensors.proposals  # greedy rows accept their argmax
    if tensors.draws:
        sampled = tensors.temperature > 0
        drawn, drawn_accepted = _verify_draws(processed, tensors)
        tokens = jnp.where(sampled, drawn, tokens)
        accepted = jnp.where(sampled, drawn_accepted, accepted)
    return sampler_output(raw, processed, tensors, tokens, accepted, num_top)


def _verify_draws(processed: chex.Array, tensors: SamplingTensors
                  ) -> tuple[chex.Array, chex.Array]:
    """Every row's draw under its proposal (greedy rows' are discarded)."""
    masked = filtered_logits(processed, tensors)
    streams = (tensors.seeds, tensors.seed_high, tensors.sample_indices, tensors.positions)
    if tensors.draft_probs is None:
        return jax.vmap(lambda *args: _verify_row(*args, None))(*streams, masked,
                                                                 tensors.proposals)
    return jax.vmap(_verify_row)(*streams, masked, tensors.proposals, tensors.draft_probs)


def _verify_row(seed: chex.Array, seed_high: chex.Array, sample_index: chex.Array,
                position: chex.Array, logits: chex.Array, proposal: chex.Array,
                draft_probs: chex.Array | None) -> tuple[chex.Array, chex.Array]:
    """One row's proposal (-1: none), drawn from draft_probs (f32 [V]; None: one-hot),
    accepted with probability min(1, p / q) at it, else a draw from max(0, p - q).
    logits: f32 [V], filtered. -> (token int32 [], accepted bool [])."""
    key = row_key(seed, seed_high, sample_index, position)
    has_proposal = proposal >= 0
    proposed = jnp.maximum(proposal, 0)
    probs = jnp.exp(logits - jax.nn.logsumexp(logits))
    if draft_probs is None:
        draft_probs = (jnp.arange(logits.shape[-1]) == proposed).astype(probs.dtype)
    draft_probs = jnp.where(has_proposal, draft_probs, 0.0)
    ratio = probs[proposed] / jnp.maximum(draft_probs[proposed], jnp.finfo(jnp.float32).tiny)
    accepted = has_proposal & (
        jax.random.uniform(jax.random.fold_in(key, ACCEPT_STREAM)) < ratio)
    residual = jnp.maximum(probs - draft_probs, 0.0)
    # p <= q everywhere leaves no residual: such a row accepts (p = q) but for rounding.
    residual = jnp.where(residual.sum() > 0, residual, probs)
    drawn = first_argmax(jnp.log(residual) + jax.random.gumbel(key, logits.shape))
    return jnp.where(accepted, proposed, drawn), accepted


def draft_sample(logits: chex.Array, tensors: SamplingTensors) -> tuple[chex.Array, chex.Array]:
    """A draft model's proposals: one token per row and the distribution it was drawn
    from, by the sampler's steps (greedy rows: the argmax, one-hot) with the key
    fold_in(row key, DRAFT_STREAM). logits: [B, V] -> (int32 [B], f32 [B, V])."""
    return _compiled_draft_sample()(logits, tensors)


def _draft_sample(logits: chex.Array, tensors: SamplingTensors
                  ) -> tuple[chex.Array, chex.Array]:
    processed = process_logits(logits.astype(jnp.float32), tensors)
    greedy_tokens = first_argmax(processed)
    sampled = tensors.temperature > 0
    masked = filtered_logits(processed, tensors)

    def draw(seed, seed_high, sample_index, position, row):
        key = jax.random.fold_in(row_key(seed, seed_high, sample_index, position), DRAFT_STREAM)
        return first_argmax(row + jax.random.gumbel(key, row.shape))

    drawn = jax.vmap(draw)(tensors.seeds, tensors.seed_high, tensors.sample_indices,
                           tensors.positions, masked)
    tokens = jnp.where(sampled, drawn, greedy_tokens)
    one_hot = jax.nn.one_hot(greedy_tokens, logits.shape[-1], dtype=jnp.float32)
    probs = jnp.where(sampled[:, None], jax.nn.softmax(masked, axis=-1), one_hot)
    return tokens, probs


@cache
def _compiled_verify():
    return jax.jit(verify_tokens, static_argnames="num_top",
                   compiler_options=compiler_options())


@cache
def _compiled_draft_sample():
    return jax.jit(_draft_sample, compiler_options=compiler_options())
