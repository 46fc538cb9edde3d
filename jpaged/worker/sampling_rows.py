"""The sampler's rows of a plan, built on the host: which row draws which sequence's
token, with which parameters, seed, position and proposal (jpaged.model.sampler reads
them as SamplingTensors).

A draw of a scheduled sequence has one row, or with speculative decoding one row per
proposal (the logits before it, checking it) and one after them. A row's penalties
and min_tokens count the proposals before it as output; beam searches draw greedy rows
and choose their beams on the host from the top log-probabilities. A row may carry a
token mask (the tokens it allows, packed as jpaged.model.sampler describes): each of a
verifying sequence's rows its own, the mask after the proposals before it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.scheduler_output import SchedulerOutput
from jpaged.model.sampler import NEUTRAL_PENALTIES, SamplingTensors
from jpaged.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup


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
    prompt_token_ids: Tokens[int] = ()
    output_token_ids: Tokens[int] = ()
    suppressed_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    proposal: int = -1  # the token proposed for `position`, -1 for none
    # int32 [ceil(V / 32)] packed token mask (`pack_token_mask`); None allows every token.
    allowed_tokens: np.ndarray | None = None

    @classmethod
    def of(cls, params: SamplingParams, *, seed: int, sample_index: int, position: int,
           prompt_token_ids: Tokens[int], output_token_ids: Tokens[int],
           suppressed_token_ids: tuple[int, ...] = (), proposal: int = -1,
           allowed_tokens: np.ndarray | None = None) -> SamplingRow:
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
            proposal=proposal, allowed_tokens=allowed_tokens,
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


def pack_token_mask(allowed: np.ndarray) -> np.ndarray:
    """bool [V], True where a token is allowed -> int32 [ceil(V / 32)], bit v % 32 of word
    v // 32 set iff token v is allowed (jpaged.model.sampler's convention)."""
    num_words = -(-len(allowed) // 32)
    bits = np.zeros(num_words * 32, bool)
    bits[: len(allowed)] = allowed
    # Little-endian bit order within each byte and bytes within each word: bit v of the
    # whole array is token v.
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


@functools.cache
def _every_token(num_rows: int, vocab_size: int) -> jax.Array:
    """int32 [B, ceil(V / 32)], every bit set, kept on the device: the masks of a batch
    without grammars cost no transfer."""
    return jnp.full((num_rows, -(-vocab_size // 32)), -1, jnp.int32)


def _token_masks(rows: Tokens[SamplingRow], num_rows: int, vocab_size: int):
    """allowed_tokens int32 [B, ceil(V / 32)]: each row's mask, all bits set (every token)
    for rows without one and padding rows."""
    if all(row.allowed_tokens is None for row in rows):
        return _every_token(num_rows, vocab_size)
    masks = np.full((num_rows, -(-vocab_size // 32)), -1, np.int32)
    for i, row in enumerate(rows):
        if row.allowed_tokens is not None:
            masks[i] = row.allowed_tokens
    return masks


def _dense(rows: Tokens[SamplingRow], num_rows: int, vocab_size: int) -> dict:
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
    rows: Tokens[SamplingRow], num_rows: int, vocab_size: int, dense: bool = False
) -> SamplingTensors:
    """Host numpy inputs of `sample`, padded to num_rows with greedy, neutral rows.

    The dense [B, V] arrays are built only when some row needs them (SamplingRow.dense)
    or `dense` asks for them (the decode loop updates them on the device). The token
    masks always are: a batch where no row has one gets a device array that allows
    every token.
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
        allowed_tokens=_token_masks(rows, num_rows, vocab_size),
        draws=any(r.temperature > 0 for r in rows),
    )


def sampling_row(group: SequenceGroup, seq: Sequence, sample_index: int,
                 before: Tokens[int] = (), proposal: int = -1,
                 allowed_tokens: np.ndarray | None = None) -> SamplingRow:
    """The row that draws seq's token after its proposals `before` (penalties and
    min_tokens count them as output), checking `proposal` if one is given, among the
    tokens `allowed_tokens` allows (a packed mask, the one after `before`; None: all)."""
    params = group.params
    position = len(seq) + len(before)
    if group.is_beam_search:
        # Beams are chosen on the host from the candidates' log-probabilities.
        temperature = params.temperature if params.temperature >= GREEDY_TEMPERATURE else 1.0
        return SamplingRow.greedy(position=position, logprob_temperature=temperature,
                                  allowed_tokens=allowed_tokens)
    output = seq.output_token_ids
    if before:
        output = [*output, *before]
    suppressed = ()
    if group.stop_rule.suppresses_stops(len(output)):
        suppressed = tuple(group.stop_token_ids)
    return SamplingRow.of(
        params, seed=group.seed, sample_index=sample_index, position=position,
        prompt_token_ids=seq.prompt_token_ids, output_token_ids=output,
        suppressed_token_ids=suppressed, proposal=proposal, allowed_tokens=allowed_tokens,
    )


def sample_indices(group: SequenceGroup, plan: SchedulerOutput, rows: tuple[int, ...]
                   ) -> list[tuple[int, int]]:
    """(sample index, row) of each draw of `group`: a prompt becoming n samples draws
    sample j from its one row; otherwise a sequence's index is its place in the group."""
    if len(group.seqs) == 1:
        return list(enumerate(rows))
    index_of = {id(seq): i for i, seq in enumerate(group.seqs)}
    return [(index_of[id(plan.scheduled[row][0])], row) for row in rows]
