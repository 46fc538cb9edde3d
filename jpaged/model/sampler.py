"""Token selection and log-probabilities on device, with vLLM V1's sampler definitions.

Per row, from the model's raw logits l (f32 [V]), `sample` applies in this order:

1. the request's logit_bias is added, and min_tokens suppression gives the row's
   suppressed tokens (EOS, stop tokens) -inf.
2. penalties (vLLM's `apply_penalties`): where a token occurs in the prompt or the
   output so far, a positive logit is divided by repetition_penalty and a non-positive
   one multiplied by it; then frequency_penalty * (occurrences in the output) and
   presence_penalty * (occurs in the output) are subtracted.
3. greedy rows (temperature 0) take the first argmax of these logits; nothing below
   applies to them.
4. l / temperature.
5. min_p: tokens with probability below min_p times the largest probability get -inf.
6. top_k: tokens below the k-th largest logit get -inf (ties at the boundary stay).
7. top_p: over what 5 and 6 kept, renormalised and sorted descending, a token stays iff
   the probability mass strictly before it is < top_p. The last token kept gives a
   boundary logit, and every token at or above it stays (ties stay).
8. a draw over the whole vocabulary, the token `jax.random.categorical` gives (argmax
   of logits plus Gumbel noise) from the key
   fold_in(fold_in(key(seed), sample_index), position): a seeded row gets the same
   token whatever shares its batch. A 64-bit seed outside [0, 2^32) is key(its low 32
   bits) with its high 32 bits folded in; a seed inside keeps key(seed).

Speculative decoding verifies proposals with the same rows: a row with a proposal d
drawn from a distribution q (a draft model's, or one-hot for an n-gram's) accepts it
if greedy and d is the argmax of 2, else with probability min(1, p(d) / q(d))
(Leviathan et al.), p the distribution 4 to 7 leave, from a uniform drawn with the
key fold_in(row key, ACCEPT_STREAM); a row that rejects draws from the residual
max(0, p - q), normalised, with the row's key. A row without a proposal draws as in
8. A draft model draws its proposals with `draft_sample`: the same steps on its own
logits, with the key fold_in(row key, DRAFT_STREAM).

Log-probabilities come from the raw logits (before 1 and 2):
log_softmax(l / logprob_temperature), with the sampled token's rank and the top ones.

The fast path. A batch whose rows are all greedy skips 4 to 8 (a variant compiled
without them, chosen on the host: `SamplingTensors.draws`), and one where no
sampled row filters skips 5 to 7 (with lax.cond). Sorting the vocabulary costs
far more than the model's head needs: top-k / top-p only look at its start.
`filter_logits` reads each row's boundary from its CANDIDATES largest logits
(`lax.top_k`), with the top-p normaliser taken over all survivors. A row that its
candidates cannot answer (top_k > CANDIDATES, or their mass below top_p) retries alone
with ESCALATION times as many, up to the whole sorted row. Real models need this
now and then (a flat next-token distribution at temperature 1), so a large batch
often holds such a row: retrying that row alone costs a fraction of sorting the batch
(`python -m benchmarks.sampler` measures both).
Every head size gives the same cutoff, bit for bit, because each step is exact on a
prefix: the k largest logits are the first k of the sort, the normaliser is a sum in a
fixed order over the whole row, and Hillis-Steele prefix sums of a prefix do not
depend on what follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jpaged.sampling_params import SamplingParams

# Head size of the fast path: lax.top_k grows slowly with it, and 128 candidates
# answer top_p 0.9 for nearly every row of a real model at moderate temperatures.
CANDIDATES = 128
# Each retry of an unanswered row takes this many times more candidates.
ESCALATION = 8
# Columns per chunk of `chunked_top_k`: one pass over the vocabulary finds the chunks
# worth sorting, and lax.top_k then sorts a few of them.
TOP_K_CHUNK = 128
# (repetition, presence, frequency) that leave logits bit-identical.
NEUTRAL_PENALTIES = (1.0, 0.0, 0.0)
# The stream folded into a row's key for the uniform that accepts or rejects its
# proposal, apart from the Gumbel noise of its draw.
ACCEPT_STREAM = 1
# The stream of a draft model's draw for a row, independent of both of the above.
DRAFT_STREAM = 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling inputs; B = padded rows, V = vocabulary.

    temperature:         f32 [B]     0 = greedy
    top_k:               int32 [B]   0 = off
    top_p:               f32 [B]     1 = off
    min_p:               f32 [B]     0 = off
    seeds:               uint32 [B]  the seeds' low 32 bits
    seed_high:           uint32 [B]  their high 32 bits (0 for a seed in [0, 2^32))
    sample_indices:      int32 [B]   which of the request's n samples
    positions:           int32 [B]   position of the token being sampled
    logprob_temperature: f32 [B]     > 0; 1 but for beam-search rows
    The dense inputs are None unless some row has penalties, a logit bias or suppressed
    tokens (a None changes the pytree, so jit compiles the dense variant only when it is
    used):
    penalties:           f32 [B, 3]  (repetition, presence, frequency)
    output_counts:       int32 [B, V] occurrences of each token in the output so far
    prompt_mask:         bool [B, V]  token occurs in the prompt
    bias:                f32 [B, V]  added to the logits: the logit_bias, and -inf on
                                     suppressed tokens (min_tokens not reached)
    proposals:           int32 [B]   the token proposed for the row's position, -1 for
                                     none; None unless some row has one
    draft_probs:         f32 [B, V]  the distribution each proposal was drawn from (a
                                     draft model's); None: one-hot (an n-gram's)

    draws (static): some row has temperature > 0. A batch of greedy rows compiles
    without the draw and its filters, a fraction of the sampler's compile time.
    """

    temperature: chex.Array
    top_k: chex.Array
    top_p: chex.Array
    min_p: chex.Array
    seeds: chex.Array
    seed_high: chex.Array
    sample_indices: chex.Array
    positions: chex.Array
    logprob_temperature: chex.Array
    penalties: chex.Array | None = None
    output_counts: chex.Array | None = None
    prompt_mask: chex.Array | None = None
    bias: chex.Array | None = None
    proposals: chex.Array | None = None
    draft_probs: chex.Array | None = None
    draws: bool = field(default=True, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """One token per row with log-probabilities from the raw logits; K = num_top.

    tokens:       int32 [B]
    logprobs:     f32 [B]     the token's log-probability
    ranks:        int32 [B]   1 + the number of tokens with a larger log-probability
    top_ids:      int32 [B, K] the K most likely tokens, descending
    top_logprobs: f32 [B, K]
    finite:       bool [B]    every raw logit of the row is finite (else the row's
                  token means nothing)
    accepted:     bool [B]    the row accepted its proposal (then its token is the
                  proposal); False for rows without one
    """

    tokens: chex.Array
    logprobs: chex.Array
    ranks: chex.Array
    top_ids: chex.Array
    top_logprobs: chex.Array
    finite: chex.Array
    accepted: chex.Array


def process_logits(logits: chex.Array, tensors: SamplingTensors) -> chex.Array:
    """Steps 1 and 2: logit bias and min_tokens suppression, then vLLM's penalties.
    f32 [B, V] -> [B, V].

    A zero bias and neutral penalties (1, 0, 0) leave a row bit-identical, so rows
    without them need no counts.
    """
    if tensors.penalties is None:
        return logits
    logits = logits + tensors.bias
    repetition, presence, frequency = (tensors.penalties[:, i, None] for i in range(3))
    counts = tensors.output_counts
    factor = jnp.where(tensors.prompt_mask | (counts > 0), repetition, 1.0)
    logits = jnp.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency * counts
    return logits - presence * (counts > 0)


def _pairwise_sum(x: chex.Array) -> chex.Array:
    """Sum over the last axis by repeated halving. [..., N] -> [...].

    XLA may order a reduction differently for a [1, V] row than for a [B, V] batch;
    elementwise halving fixes the order, so a row retried alone sums as in the batch.
    """
    width = 1 << (x.shape[-1] - 1).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _prefix_sums(x: chex.Array) -> chex.Array:
    """Inclusive prefix sums over the last axis, Hillis-Steele. [..., N] -> [..., N].

    Entry j only ever adds entries before it (and exact zeros), so the sums of a
    head of the sorted row equal the first sums of the whole sorted row. The
    log2(N) rounds run as a loop: one compiled round, not one per shift.
    """
    index = jnp.arange(x.shape[-1])

    def add_shifted(round_, x):
        shift = jnp.left_shift(1, round_)
        return x + jnp.where(index >= shift, jnp.roll(x, shift, axis=-1), 0.0)

    return jax.lax.fori_loop(0, (x.shape[-1] - 1).bit_length(), add_shifted, x)


def _logsumexp(x: chex.Array) -> chex.Array:
    """Log of the sum of exp over the last axis, in a fixed order. [B, V] -> [B]."""
    row_max = jnp.max(x, axis=-1, keepdims=True)
    return jnp.log(_pairwise_sum(jnp.exp(x - row_max))) + row_max[:, 0]


def nucleus_cutoffs(
    masked: chex.Array, top_k: chex.Array, top_p: chex.Array, size: int
) -> tuple[chex.Array, chex.Array]:
    """The lowest logit each row keeps under top_k and top_p, read from its `size` largest.

    masked: f32 [B, V] (min_p applied); top_k int32 [B] (0 off); top_p f32 [B] (1 off);
    size: static, <= V. Returns cutoff f32 [B] (-inf keeps all) and answered bool [B]:
    where True, the cutoff is that of every larger size, the whole sorted row included.
    """
    rows = jnp.arange(masked.shape[0])
    head = jax.lax.top_k(masked, size)[0]  # [B, size], descending
    kth = head[rows, jnp.clip(top_k, 1, size) - 1]
    kth = jnp.where(top_k > 0, kth, -jnp.inf)
    # top_p renormalises over every survivor of min_p and top_k, beyond the head too.
    lse = _logsumexp(jnp.where(masked >= kth[:, None], masked, -jnp.inf))
    probs = jnp.exp(jnp.where(head >= kth[:, None], head, -jnp.inf) - lse[:, None])
    # Mass strictly before each head entry; the last column is the head's whole mass.
    before = jnp.pad(_prefix_sums(probs), ((0, 0), (1, 0)))
    reached = before >= top_p[:, None]
    # The first entry whose mass before reaches top_p ends the nucleus (not a count:
    # float prefix sums need not be monotone, and the first index is a prefix property).
    found = reached.any(axis=-1)
    nucleus = jnp.maximum(jnp.where(found, jnp.argmax(reached, axis=-1), size), 1)
    nucleus_logit = jnp.where(top_p < 1.0, head[rows, nucleus - 1], -jnp.inf)
    answered = (top_k <= size) & ((top_p >= 1.0) | found)
    return jnp.maximum(kth, nucleus_logit), answered


def _head_sizes(vocab: int) -> tuple[int, ...]:
    """CANDIDATES, then ESCALATION times more at each retry, up to the whole row."""
    sizes = [min(CANDIDATES, vocab)]
    while sizes[-1] < vocab:
        sizes.append(min(sizes[-1] * ESCALATION, vocab))
    return tuple(sizes)


def _retry(row: chex.Array, top_k: chex.Array, top_p: chex.Array,
           sizes: tuple[int, ...]) -> chex.Array:
    """Cutoff of one row ([1, V], [1], [1]) from ever larger heads. -> f32 [1]."""
    cutoff, answered = nucleus_cutoffs(row, top_k, top_p, sizes[0])
    if len(sizes) == 1:
        return cutoff
    return jax.lax.cond(answered[0], lambda: cutoff,
                        lambda: _retry(row, top_k, top_p, sizes[1:]))


def _min_p(scaled: chex.Array, min_p: chex.Array) -> chex.Array:
    """Step 5. p < min_p * max(p) iff exp(l - max l) < min_p: the normaliser cancels."""
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    return jnp.where(jnp.exp(scaled - row_max) < min_p[:, None], -jnp.inf, scaled)


def filter_logits(
    scaled: chex.Array, top_k: chex.Array, top_p: chex.Array, min_p: chex.Array
) -> chex.Array:
    """Steps 5 to 7: -inf outside each row's min_p, top_k and top_p sets.

    scaled: f32 [B, V] (temperature applied); top_k int32 [B]; top_p f32 [B];
    min_p f32 [B]. Returns f32 [B, V].
    """
    masked = _min_p(scaled, min_p)
    sizes = _head_sizes(masked.shape[-1])
    cutoff, answered = nucleus_cutoffs(masked, top_k, top_p, sizes[0])
    if len(sizes) > 1:
        def row_cutoff(args):
            row, k, p, c, ok = args
            return jax.lax.cond(ok, lambda: c,
                                lambda: _retry(row[None], k[None], p[None], sizes[1:])[0])

        cutoff = jax.lax.cond(
            answered.all(), lambda: cutoff,
            lambda: jax.lax.map(row_cutoff, (masked, top_k, top_p, cutoff, answered)))
    return jnp.where(masked >= cutoff[:, None], masked, -jnp.inf)


def _first_argmax(x: chex.Array) -> chex.Array:
    """jnp.argmax over the last axis (the first maximum), for rows without NaN. -> int32.

    Two plain reductions: several times faster on a CPU than XLA's (value, index)
    reduction.
    """
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]),
                   axis=-1)


def _seed_key(seed: chex.Array, seed_high: chex.Array) -> chex.Array:
    """The key of a 64-bit seed given as two uint32 halves: key(seed) for a seed below 2^32,
    so 32-bit seeds keep their stream, else that key with the high half folded in."""
    key = jax.random.key(seed)
    return jax.lax.cond(seed_high == 0, lambda: key,
                        lambda: jax.random.fold_in(key, seed_high))


def _categorical(seed: chex.Array, seed_high: chex.Array, sample_index: chex.Array,
                 position: chex.Array, logits: chex.Array) -> chex.Array:
    """jax.random.categorical(key, logits) for one row ([V] -> int32 []): its definition,
    the argmax of logits plus Gumbel noise, with the faster argmax."""
    key = _row_key(seed, seed_high, sample_index, position)
    return _first_argmax(logits + jax.random.gumbel(key, logits.shape))


def _row_key(seed: chex.Array, seed_high: chex.Array, sample_index: chex.Array,
             position: chex.Array) -> chex.Array:
    return jax.random.fold_in(jax.random.fold_in(_seed_key(seed, seed_high), sample_index),
                              position)


def _verify(seed: chex.Array, seed_high: chex.Array, sample_index: chex.Array,
            position: chex.Array, logits: chex.Array, proposal: chex.Array,
            draft_probs: chex.Array | None) -> tuple[chex.Array, chex.Array]:
    """One row's proposal (-1: none), drawn from draft_probs (f32 [V]; None: one-hot),
    accepted with probability min(1, p / q) at it, else a draw from max(0, p - q); a row
    without a proposal draws as `_categorical` does.
    logits: f32 [V], filtered. -> (token int32 [], accepted bool [])."""
    key = _row_key(seed, seed_high, sample_index, position)
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
    drawn = _first_argmax(jnp.log(residual) + jax.random.gumbel(key, logits.shape))
    return jnp.where(accepted, proposed, drawn), accepted


def draft_sample(logits: chex.Array, tensors: SamplingTensors) -> tuple[chex.Array, chex.Array]:
    """A draft model's proposals: one token per row and the distribution it was drawn
    from, by the steps of `sample` (greedy rows: the argmax, one-hot) with the key
    fold_in(row key, DRAFT_STREAM). logits: [B, V] -> (int32 [B], f32 [B, V])."""
    return _compiled_draft_sample()(logits, tensors)


def _draft_sample(logits: chex.Array, tensors: SamplingTensors
                  ) -> tuple[chex.Array, chex.Array]:
    processed = process_logits(logits.astype(jnp.float32), tensors)
    greedy_tokens = _first_argmax(processed)
    sampled = tensors.temperature > 0
    masked = _filtered(processed, tensors)

    def draw(seed, seed_high, sample_index, position, row):
        key = jax.random.fold_in(_row_key(seed, seed_high, sample_index, position), DRAFT_STREAM)
        return _first_argmax(row + jax.random.gumbel(key, row.shape))

    drawn = jax.vmap(draw)(tensors.seeds, tensors.seed_high, tensors.sample_indices,
                           tensors.positions, masked)
    tokens = jnp.where(sampled, drawn, greedy_tokens)
    one_hot = jax.nn.one_hot(greedy_tokens, logits.shape[-1], dtype=jnp.float32)
    probs = jnp.where(sampled[:, None], jax.nn.softmax(masked, axis=-1), one_hot)
    return tokens, probs


def _filtered(processed: chex.Array, tensors: SamplingTensors) -> chex.Array:
    """Steps 4 to 7: the sampled rows' logits over temperature, -inf outside their
    filters (greedy rows: divided by 1, unfiltered). f32 [B, V] -> [B, V]."""
    sampled = tensors.temperature > 0
    scaled = processed / jnp.where(sampled, tensors.temperature, 1.0)[:, None]
    # Greedy rows ignore the filters; off, they cannot send the batch down a slow path.
    top_k = jnp.where(sampled, tensors.top_k, 0)
    top_p = jnp.where(sampled, tensors.top_p, 1.0)
    min_p = jnp.where(sampled, tensors.min_p, 0.0)
    filters = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    return jax.lax.cond(filters.any(), filter_logits, lambda s, *_: s,
                        scaled, top_k, top_p, min_p)


def _draw(processed: chex.Array, tensors: SamplingTensors
          ) -> tuple[chex.Array, chex.Array | None]:
    """Steps 4 to 8 for every row (greedy rows' draws are discarded), verifying the rows'
    proposals if they have any. -> (int32 [B], accepted bool [B] or None)."""
    masked = _filtered(processed, tensors)
    streams = (tensors.seeds, tensors.seed_high, tensors.sample_indices, tensors.positions)
    if tensors.proposals is None:
        return jax.vmap(_categorical)(*streams, masked), None
    if tensors.draft_probs is None:
        return jax.vmap(lambda *args: _verify(*args, None))(*streams, masked,
                                                             tensors.proposals)
    return jax.vmap(_verify)(*streams, masked, tensors.proposals, tensors.draft_probs)


def logprob_outputs(
    logits: chex.Array, targets: chex.Array, num_top: int
) -> tuple[chex.Array, chex.Array, chex.Array, chex.Array]:
    """log_softmax(logits) in f32, read at each row's target token.

    logits: [R, V]; targets: int32 [R]; num_top: static, <= V.
    Returns the targets' log-probabilities f32 [R], their ranks int32 [R] (1 + the
    number of larger log-probabilities), and the top num_top ids int32 [R, K] and
    log-probabilities f32 [R, K], descending.
    """
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_lp = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(lp > target_lp[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = chunked_top_k(lp, num_top)
    return target_lp, ranks, top_ids, top_logprobs


def chunked_top_k(x: chex.Array, k: int) -> tuple[chex.Array, chex.Array]:
    """lax.top_k(x, k) over the last axis, bit for bit (ties: the lower index first), in a
    fraction of its time over a vocabulary: x [R, V] -> (values [R, k], int32 ids [R, k]).

    The k largest values lie in the k chunks of TOP_K_CHUNK columns with the largest
    maxima (ties: the lower chunk first): a chunk ranked after those has k chunks before
    it whose maxima come before all of its values. So one pass takes each chunk's max,
    and lax.top_k then runs over k chunk maxima and k chunks, in index order.
    """
    rows, vocab = x.shape
    num_chunks = -(-vocab // TOP_K_CHUNK)
    if num_chunks <= k:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    # -inf padding comes after every real column, -inf ones included.
    padded = jnp.pad(x, ((0, 0), (0, num_chunks * TOP_K_CHUNK - vocab)),
                     constant_values=-jnp.inf)
    chunks = padded.reshape(rows, num_chunks, TOP_K_CHUNK)
    _, best = jax.lax.top_k(chunks.max(axis=-1), k)
    best = jnp.sort(best, axis=-1)
    candidates = jnp.take_along_axis(chunks, best[:, :, None], axis=1).reshape(rows, -1)
    values, where = jax.lax.top_k(candidates, k)
    chunk_ids = jnp.take_along_axis(best, where // TOP_K_CHUNK, axis=1)
    ids = chunk_ids * TOP_K_CHUNK + where % TOP_K_CHUNK
    return values, ids.astype(jnp.int32)


def sample(logits: chex.Array, tensors: SamplingTensors, num_top: int) -> SamplerOutput:
    """One token per row, and log-probabilities of the raw logits; compiled with the
    options of the default backend (`compiler_options`).

    logits: [B, V] (any float dtype; computed in f32); num_top: static, <= V.
    """
    return _compiled_sample()(logits, tensors, num_top)


def compiler_options() -> dict[str, str] | None:
    """XLA options of the sampler on the default backend. XLA's CPU backend hands
    reductions to YNNPACK by default, and there the sampler's vocabulary-wide passes ran
    several times slower than XLA's own loops: on a CPU the sampler compiles without
    YNNPACK fusions. Read when first compiled, not at import, so that importing jpaged
    does not pick the backend."""
    if jax.default_backend() == "cpu":
        return {"xla_cpu_experimental_ynn_fusion_type": ""}
    return None


@cache
def _compiled_sample():
    return jax.jit(sample_tokens, static_argnames="num_top",
                   compiler_options=compiler_options())


@cache
def _compiled_draft_sample():
    return jax.jit(_draft_sample, compiler_options=compiler_options())


def sample_tokens(logits: chex.Array, tensors: SamplingTensors, num_top: int
                  ) -> SamplerOutput:
    """What `sample` compiles, for a caller that traces it into its own jitted function
    (the decode loop)."""
    raw = logits.astype(jnp.float32)
    processed = process_logits(raw, tensors)
    tokens = _first_argmax(processed)
    accepted = jnp.zeros(tokens.shape, bool)
    if tensors.proposals is not None:  # greedy rows accept their argmax
        accepted = tokens == tensors.proposals
    if tensors.draws:
        sampled = tensors.temperature > 0
        drawn, drawn_accepted = _draw(processed, tensors)
        tokens = jnp.where(sampled, drawn, tokens)
        if drawn_accepted is not None:
            accepted = jnp.where(sampled, drawn_accepted, accepted)
    scaled = raw / tensors.logprob_temperature[:, None]
    finite = jnp.isfinite(raw).all(axis=-1)
    return SamplerOutput(tokens, *logprob_outputs(scaled, tokens, num_top), finite, accepted)


@dataclass(frozen=True)
class SamplingRow:
    """What the host knows of one row to sample (vLLM's conventions already mapped:
    temperature 0 is greedy, top_k 0 is off)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int  # 64-bit, signed or not
    sample_index: int
    position: int
    logprob_temperature: float = 1.0
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    suppressed_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    proposal: int = -1  # the token proposed for `position`, -1 for none

    @classmethod
    def of(cls, params: SamplingParams, *, seed: int, sample_index: int, position: int,
           prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
           suppressed_token_ids: tuple[int, ...] = (), proposal: int = -1) -> SamplingRow:
        """A row of a request: temperature < 1e-5 becomes 0 (greedy), top_k -1 becomes 0."""
        return cls(
            temperature=0.0 if params.greedy else params.temperature,
            top_k=max(params.top_k, 0), top_p=params.top_p, min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=seed, sample_index=sample_index, position=position,
            prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids,
            suppressed_token_ids=tuple(suppressed_token_ids),
            logit_bias=tuple((params.logit_bias or {}).items()),
            proposal=proposal,
        )

    @classmethod
    def greedy(cls, *, position: int, **fields) -> SamplingRow:
        """A greedy row with every filter and penalty off (beam search, warm-up), but for
        `fields`."""
        return cls(**(dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                           repetition_penalty=1.0, presence_penalty=0.0,
                           frequency_penalty=0.0, seed=0, sample_index=0, position=position)
                      | fields))

    @property
    def penalties(self) -> tuple[float, float, float]:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    @property
    def dense(self) -> bool:
        """The row needs the sampler's [B, V] inputs."""
        return (self.penalties != NEUTRAL_PENALTIES or bool(self.suppressed_token_ids)
                or bool(self.logit_bias))


def _dense(rows: Sequence[SamplingRow], num_rows: int, vocab_size: int) -> dict:
    """penalties f32 [B, 3], output_counts int32 [B, V], prompt_mask bool [B, V] and bias
    f32 [B, V]; counts and prompts are filled only for rows with penalties, the only
    rows that read them."""
    penalties = np.tile(np.array(NEUTRAL_PENALTIES, np.float32), (num_rows, 1))
    counts = np.zeros((num_rows, vocab_size), np.int32)
    prompt_mask = np.zeros((num_rows, vocab_size), bool)
    bias = np.zeros((num_rows, vocab_size), np.float32)
    for i, row in enumerate(rows):
        for token_id, value in row.logit_bias:
            bias[i, token_id] = value
        bias[i, list(row.suppressed_token_ids)] = -np.inf
        if row.penalties != NEUTRAL_PENALTIES:
            penalties[i] = row.penalties
            counts[i] = np.bincount(np.asarray(row.output_token_ids, np.int64),
                                    minlength=vocab_size)
            prompt_mask[i, list(row.prompt_token_ids)] = True
    return dict(penalties=penalties, output_counts=counts, prompt_mask=prompt_mask, bias=bias)


def sampling_tensors(
    rows: Sequence[SamplingRow], num_rows: int, vocab_size: int, dense: bool = False
) -> SamplingTensors:
    """Host numpy inputs of `sample`, padded to num_rows with greedy, neutral rows.

    The dense [B, V] arrays are built only when some row needs them (SamplingRow.dense)
    or `dense` asks for them (the decode loop updates them on the device).
    """
    pad = num_rows - len(rows)
    if pad < 0:
        raise ValueError(f"{len(rows)} rows do not fit in {num_rows}")

    def column(name: str, fill, dtype) -> np.ndarray:
        return np.array([getattr(r, name) for r in rows] + [fill] * pad, dtype)

    seeds = [r.seed for r in rows] + [0] * pad
    return SamplingTensors(
        temperature=column("temperature", 0.0, np.float32),
        top_k=column("top_k", 0, np.int32),
        top_p=column("top_p", 1.0, np.float32),
        min_p=column("min_p", 0.0, np.float32),
        seeds=np.array([s & 0xFFFFFFFF for s in seeds], np.uint32),
        seed_high=np.array([(s >> 32) & 0xFFFFFFFF for s in seeds], np.uint32),
        sample_indices=column("sample_index", 0, np.int32),
        positions=column("position", 0, np.int32),
        logprob_temperature=column("logprob_temperature", 1.0, np.float32),
        **(_dense(rows, num_rows, vocab_size) if dense or any(r.dense for r in rows)
           else {}),
        proposals=(column("proposal", -1, np.int32) if any(r.proposal >= 0 for r in rows)
                   else None),
        draws=any(r.temperature > 0 for r in rows),
    )
