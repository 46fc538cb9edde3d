"""Every padded shape a step can take: buckets, the shapes of a step, and the list warm-up
compiles.

The jit-compiled model step sees only padded shapes, so it compiles once per
bucket. A step's shape is (tokens, sequence rows, blocks per sequence,
decode_only); the sampler's rows, the block ops' pairs and the prompt
log-probabilities' chunks are padded here too. `StepShapes` holds an engine's
buckets and limits and answers every question about its shapes; `step_shapes`
lists the shapes `LLMEngine.warmup` compiles.

numpy-free and jax-free: the host side sizes, the device side compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rows of logits `ModelRunner.token_logprobs` materialises at once: bounds its memory
# to this many vocabulary-sized rows, and it compiles for this one shape whatever the
# step's token count.
LOGPROB_ROWS = 16


@dataclass(frozen=True)
class BucketSizes:
    """Smallest padded sizes; a padded size is the next power of two >= max(actual, minimum).

    linear_step > 0 pads token and sequence counts past it to a multiple of it
    instead: 48 rather than 64 rows for 33 sequences, fewer wasted rows for
    more compiled shapes (worth it where rows cost compute, as on CPUs).

    mixed_num_seqs > 0 pads the sequence rows of every mixed step (more tokens
    than sequences) to at least this many, so mixed steps vary by token count
    alone: one compiled shape per token bucket instead of one per (tokens, rows)
    pair. Padding rows are empty sequences, which the attention skips, and the
    logits are still taken for the rows in use only (`ModelInput.num_rows`).

    mixed_min_tokens and mixed_token_step > 0 pad a mixed step's tokens to at least
    mixed_min_tokens and, past mixed_token_step, to a multiple of it (else the
    token buckets of decode steps): a mixed step's tokens vary more than a decode
    step's rows, so coarser buckets there save compiles for little padding.
    """

    min_num_tokens: int = 16
    min_num_seqs: int = 8
    min_blocks_per_seq: int = 8
    linear_step: int = 0
    mixed_num_seqs: int = 0
    mixed_min_tokens: int = 0
    mixed_token_step: int = 0

    def __post_init__(self):
        for name in ("min_num_tokens", "min_num_seqs", "min_blocks_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("linear_step", "mixed_num_seqs", "mixed_min_tokens", "mixed_token_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def bucket(n: int, minimum: int, linear_step: int = 0) -> int:
    """Next power of two >= max(n, minimum); past linear_step (if > 0), next multiple of it."""
    size = max(n, minimum)
    if 0 < linear_step < size:
        return -(-size // linear_step) * linear_step
    return 1 << (size - 1).bit_length()


def padded_sizes(
    num_tokens: int, num_rows: int, buckets: BucketSizes, decode_only: bool,
    speculative_tokens: int = 0,
) -> tuple[int, int, int]:
    """(padded tokens, padded sequence rows, padded logit rows) of a step.

    Logit rows are the bucket of num_rows. A decode-only step has as many token
    rows as sequence rows; a step of decodes verifying up to speculative_tokens
    proposals each (> 0) has the decode step's rows and 1 + speculative_tokens
    tokens per row; a mixed step pads its tokens on their own, and its sequence
    rows to at least buckets.mixed_num_seqs.
    """
    logit_rows = bucket(num_rows, buckets.min_num_seqs, buckets.linear_step)
    if speculative_tokens:
        return logit_rows * (1 + speculative_tokens), logit_rows, logit_rows
    if decode_only:
        tokens = bucket(max(num_tokens, logit_rows), buckets.min_num_tokens, buckets.linear_step)
        return tokens, logit_rows, logit_rows
    tokens = bucket(num_tokens, max(buckets.min_num_tokens, buckets.mixed_min_tokens),
                    buckets.mixed_token_step or buckets.linear_step)
    return tokens, max(logit_rows, buckets.mixed_num_seqs), logit_rows


def sampler_rows(num_draws: int, max_rows: int) -> int:
    """Padded rows of the sampler: the next power of 8 >= num_draws, at most max_rows
    (but never below num_draws). A padding row costs the sampler little next to a
    model step, while each row count compiles the sampler's variants anew."""
    size = 1
    while size < num_draws:
        size *= 8
    return max(num_draws, min(size, max_rows))


def op_pairs(num_pairs: int) -> int:
    """Padded rows of a step's block copies or swaps: the next power of two."""
    return bucket(num_pairs, 1)


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """Block-table entries a sequence of max_model_len tokens needs."""
    return -(-max_model_len // block_size)


def default_buckets(attention_backend: str, max_blocks_per_seq: int, max_num_seqs: int
                    ) -> BucketSizes:
    """Padded step shapes: token and sequence counts by powers of two, then multiples
    of 16; a mixed step's tokens from 16 on, by powers of two, then multiples of
    32. Mixed steps pad their sequence rows to the largest row bucket, so they
    vary by token count alone (empty rows cost the attention nothing and the
    logits are taken for the rows in use only). The XLA loop stops each tile at
    its own context, so there the block table can always have full width: one
    width instead of several, a fraction of the compiles. The reference gathers
    the whole table and the TPU kernel prefetches it into scalar memory, so other
    backends get power-of-two widths from 8."""
    linear_step = 16
    min_blocks = max_blocks_per_seq if attention_backend == "xla" else 8
    return BucketSizes(min_num_tokens=1, min_num_seqs=1, min_blocks_per_seq=min_blocks,
                       linear_step=linear_step,
                       mixed_num_seqs=bucket(max_num_seqs, 1, linear_step),
                       mixed_min_tokens=16, mixed_token_step=32)


def step_shapes(
    buckets: BucketSizes, max_tokens: int, max_seqs: int, max_blocks: int
) -> list[tuple[int, int, int, bool]]:
    """Every padded (tokens, sequences, blocks per sequence, decode_only) a step can take.

    A step runs 1..max_seqs sequences with at least one new token each, and at
    most max_tokens tokens; decode-only steps have one token per sequence. Its
    sequence rows may be more than its sequences, up to max_seqs: the draws of
    parallel samples (`build_model_input`'s min_rows).
    """
    row_buckets = sorted({bucket(n, buckets.min_num_seqs, buckets.linear_step)
                          for n in range(1, max_seqs + 1)})
    # A mixed step of t tokens may hold 1..t-1 sequences, and any rows up to max_seqs.
    mixed = {
        (*padded_sizes(num_tokens, num_rows, buckets, False)[:2], False)
        for num_tokens in range(2, max_tokens + 1)
        for num_rows in row_buckets
    }
    decode = {
        (*padded_sizes(num_seqs, num_rows, buckets, True)[:2], True)
        for num_seqs in range(1, min(max_seqs, max_tokens) + 1)
        for num_rows in row_buckets
        if num_rows >= num_seqs
    }
    token_seq_pairs = mixed | decode
    block_sizes = {bucket(n, buckets.min_blocks_per_seq) for n in range(1, max_blocks + 1)}
    return sorted(
        (num_tokens, num_seqs, num_blocks, decode_only)
        for num_tokens, num_seqs, decode_only in token_seq_pairs
        for num_blocks in block_sizes
    )


@dataclass(frozen=True)
class StepShapes:
    """An engine's buckets and the limits its steps stay within; num_speculative_tokens:
    the k proposals a sequence may verify per step (0: no speculative decoding)."""

    buckets: BucketSizes
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int
    num_speculative_tokens: int = 0

    @property
    def max_rows(self) -> int:
        """The largest padded row count of a step: max_num_seqs' bucket."""
        return bucket(self.max_num_seqs, self.buckets.min_num_seqs, self.buckets.linear_step)

    def sampler_rows(self, num_draws: int) -> int:
        """Padded sampler rows; a verifying sequence draws once per proposal and once more."""
        return sampler_rows(num_draws, self.max_rows * (1 + self.num_speculative_tokens))

    def warmup_shapes(self) -> list[tuple[int, int, int, bool]]:
        """Every (tokens, sequences, blocks per sequence, decode_only) a step can take:
        with speculative decoding, also the verifying steps (1 + k tokens a row) of every
        row bucket that fits the token budget."""
        shapes = step_shapes(self.buckets, self.max_num_batched_tokens, self.max_num_seqs,
                             self.max_blocks_per_seq)
        k = self.num_speculative_tokens
        if not k:
            return shapes
        decode = {(rows, blocks) for _, rows, blocks, decode_only in shapes if decode_only}
        verifying = {(rows * (1 + k), rows, blocks, False) for rows, blocks in decode
                     if self._verifies(rows)}
        return sorted(set(shapes) | verifying)

    def _verifies(self, rows: int) -> bool:
        """Whether a verifying step can have `rows` padded rows: the fewest sequences that
        pad to it, plus one proposal, fit the token budget."""
        fewest = min(n for n in range(1, self.max_num_seqs + 1)
                     if bucket(n, self.buckets.min_num_seqs, self.buckets.linear_step) == rows)
        return fewest + 1 <= self.max_num_batched_tokens

    def smallest(self, decode_only: bool) -> tuple[int, int, int, bool]:
        """The smallest step shape of its kind: the one a kernel check at start-up runs."""
        num_tokens, num_seqs, _ = padded_sizes(1 if decode_only else 2, 1, self.buckets,
                                               decode_only)
        return num_tokens, num_seqs, bucket(1, self.buckets.min_blocks_per_seq), decode_only

