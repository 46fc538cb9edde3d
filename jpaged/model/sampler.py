"""Token selection and log-probabilities on device, with vLLM V1's sampler definitions.

Per row, from the model's raw logits l (f32 [V]), `sample` applies in this order:

1. tokens outside the row's allowed set (its token mask: a grammar's, for structured
   outputs) get -inf; then the request's logit_bias is added, and min_tokens
   suppression gives the row's suppressed tokens (EOS, stop tokens) -inf.
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

Rows that carry proposals (speculative decoding) are verified with the same steps by
jpaged.model.verification.

Log-probabilities come from the raw logits (before 1 and 2, so a token mask leaves
them unchanged): log_softmax(l / logprob_temperature), with the sampled token's rank and
the top ones.

Token masks are packed as structured-output libraries (llguidance, xgrammar) and vLLM
pack them: int32 words [ceil(V / 32)], bit v % 32 (least significant first) of word
v // 32 set iff token v is allowed. A mask allows at least one token (a grammar always
allows one: EOS at the end); bits past V are ignored.

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

from dataclasses import dataclass, field
from functools import cache

import chex
import jax
import jax.numpy as jnp

from jpaged._deprecation import moved_names

# Names this module held before the sampling rows and verification moved out of it.
__getattr__ = moved_names(__name__, {
    "SamplingRow": "jpaged.worker.sampling_rows",
    "sampling_tensors": "jpaged.worker.sampling_rows",
    "draft_sample": "jpaged.model.verification",
    "ACCEPT_STREAM": "jpaged.model.verification",
    "DRAFT_STREAM": "jpaged.model.verification",
})

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
    allowed_tokens:      int32 [B, ceil(V / 32)]  each row's packed token mask (the
                                     module's convention; all bits set: every token).
                                     A batch whose masks all allow every token skips
                                     them (lax.cond), so one compiled sampler serves
                                     batches with and without grammars

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
    allowed_tokens: chex.Array | None = None
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
    finite:       bool [B]    every raw logit of the row is finite and steps 1 and 2
                  leave some token (a token mask and min_tokens' suppression can leave
                  none); else the row's token means nothing
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


def token_mask(allowed_tokens: chex.Array, vocab_size: int) -> chex.Array:
    """Unpack token masks: int32 [B, ceil(V / 32)] words (the module's convention) ->
    bool [B, V], True where the token is allowed."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    # An arithmetic shift of a negative word fills with ones; the & 1 keeps its bit alone.
    bits = (allowed_tokens[:, :, None] >> shifts) & 1  # [B, W, 32]
    return bits.reshape(allowed_tokens.shape[0], -1)[:, :vocab_size].astype(bool)


def apply_token_masks(logits: chex.Array, allowed_tokens: chex.Array) -> chex.Array:
    """-inf where a row's mask does not allow the token. logits f32 [B, V], allowed_tokens
    int32 [B, ceil(V / 32)] -> f32 [B, V]."""
    return jnp.where(token_mask(allowed_tokens, logits.shape[-1]), logits, -jnp.inf)


def process_logits(logits: chex.Array, tensors: SamplingTensors) -> chex.Array:
    """Steps 1 and 2: the token mask, logit bias and min_tokens suppression, then vLLM's
    penalties. f32 [B, V] -> [B, V].

    A zero bias and neutral penalties (1, 0, 0) leave a row bit-identical, so rows
    without them need no counts; a row whose mask allows every token is bit-identical
    too (-inf stays -inf through the penalties).
    """
    if tensors.allowed_tokens is not None:
        logits = jax.lax.cond((tensors.allowed_tokens != -1).any(), apply_token_masks,
                              lambda logits, _: logits, logits, tensors.allowed_tokens)
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


def first_argmax(x: chex.Array) -> chex.Array:
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
    key = row_key(seed, seed_high, sample_index, position)
    return first_argmax(logits + jax.random.gumbel(key, logits.shape))


def row_key(seed: chex.Array, seed_high: chex.Array, sample_index: chex.Array,
             position: chex.Array) -> chex.Array:
    return jax.random.fold_in(jax.random.fold_in(_seed_key(seed, seed_high), sample_index),
                              position)


def filtered_logits(processed: chex.Array, tensors: SamplingTensors) -> chex.Array:
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


def _draw(processed: chex.Array, tensors: SamplingTensors) -> chex.Array:
    """Steps 4 to 8 for every row (greedy rows' draws are discarded). -> int32 [B]."""
    streams = (tensors.seeds, tensors.seed_high, tensors.sample_indices, tensors.positions)
    return jax.vmap(_categorical)(*streams, filtered_logits(processed, tensors))


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
    options of the default backend (`compiler_options`). Proposals are not checked
    (jpaged.model.verification does).

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


def sample_tokens(logits: chex.Array, tensors: SamplingTensors, num_top: int
                  ) -> SamplerOutput:
    """What `sample` compiles, for a caller that traces it into its own jitted function
    (the decode loop). Rows with proposals are verified by jpaged.model.verification."""
    raw = logits.astype(jnp.float32)
    processed = process_logits(raw, tensors)
    tokens = first_argmax(processed)
    if tensors.draws:
        tokens = jnp.where(tensors.temperature > 0, _draw(processed, tensors), tokens)
    return sampler_output(raw, processed, tensors, tokens, jnp.zeros(tokens.shape, bool),
                          num_top)


def sampler_output(raw: chex.Array, processed: chex.Array, tensors: SamplingTensors,
                   tokens: chex.Array, accepted: chex.Array, num_top: int) -> SamplerOutput:
    """The rows' tokens with the log-probabilities of the raw logits f32 [B, V];
    processed: the logits after steps 1 and 2, [B, V]."""
    scaled = raw / tensors.logprob_temperature[:, None]
    finite = jnp.isfinite(raw).all(axis=-1) & (processed.max(axis=-1) > -jnp.inf)
    return SamplerOutput(tokens, *logprob_outputs(scaled, tokens, num_top), finite, accepted)
