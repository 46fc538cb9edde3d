"""Proposals from a draft model: a smaller model with the target's vocabulary, run by the
same engine.

The draft keeps its own layers' K/V in a cache of its own, laid out like the target's
and addressed by the target's block ids: the scheduler's one set of block tables serves
both, so copy-on-write copies, swaps and prefix-cache hits give the draft its K/V with
the target's. It runs on every step's input after the target (`observe`), so it holds
K/V for every token the target does. In a verifying
step it first drafts: k decode steps, each over the sequences that still draw a
proposal, writing its K/V into the slots the scheduler reserved for the proposals.

Before the step is scheduled a sequence holds UNDRAFTED once per proposal to come: how
many it verifies is known then (k, within max_tokens and max_model_len), the tokens
only once their slots exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.attention_metadata import AttentionMetadata
from jpaged.core.batch_builder import BlockTables, build_model_input
from jpaged.core.step_modes import Feature, ModeFallbacks
from jpaged.core.step_shapes import StepShapes
from jpaged.model.config import LlamaConfig
from jpaged.model.loader import read_model_config
from jpaged.model.verification import draft_sample
from jpaged.sequence import Sequence
from jpaged.speculative.config import SpeculativeConfig
from jpaged.speculative.proposer import RowOf, TokenProposer
from jpaged.worker.model_runner import ModelRunner
from jpaged.worker.sampling_rows import sampling_tensors

# A proposal the draft model has not drawn yet.
UNDRAFTED = -1


def check_draft_model(config: SpeculativeConfig, target: LlamaConfig) -> None:
    """ValueError unless the draft model shares `target`'s vocabulary (read from its
    config, before any weights load)."""
    draft = read_model_config(config.model)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config['model']={config.model!r} has a vocabulary of "
            f"{draft.vocab_size} tokens, the target model {target.vocab_size}: a draft model "
            "must share the target's vocabulary")


@dataclass(frozen=True)
class Drafts:
    """One step's draws of a draft model.

    probs: f32 [k, R, V] the distribution of draft step j's row r (R: the padded rows).
    rows:  id(sequence) -> its row in every draft step it took part in.
    """

    probs: jax.Array
    rows: dict[int, int]

    def row_probs(self, draft_steps: list[tuple[int, int, int]], num_rows: int) -> jax.Array:
        """f32 [num_rows, V]: the draft's distribution of each sampling row's proposal
        (draft_steps: (sampling row, draft step, draft row)); zeros elsewhere."""
        steps, rows = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
        for sampling_row, step, row in draft_steps:
            steps[sampling_row], rows[sampling_row] = step, row
        return draft_rows(self.probs, steps, rows)


@jax.jit
def _stack(*probs: jax.Array) -> jax.Array:
    return jnp.stack(probs)


@jax.jit
def draft_rows(probs: jax.Array, steps: jax.Array, rows: jax.Array) -> jax.Array:
    """probs [k, R, V], steps and rows int32 [S] -> the S distributions [S, V]."""
    return probs[steps, rows]


class DraftModelProposer(TokenProposer):
    """Draws k proposals per verifying sequence from a draft model's runner.

    runner: the draft's ModelRunner (its cache has the target's blocks);
    block_tables: the target's KV cache manager; shapes: the target's step shapes.
    """

    feature = Feature.DRAFT_MODEL

    def __init__(self, runner: ModelRunner, block_tables: BlockTables, shapes: StepShapes,
                 vocab_size: int, *, fallbacks: ModeFallbacks | None = None):
        super().__init__(shapes.num_speculative_tokens, fallbacks)
        self.runner = runner
        self.runners = (runner,)
        self.block_tables = block_tables
        self.shapes = shapes
        self.vocab_size = vocab_size

    def propose_tokens(self, seq: Sequence, num_tokens: int) -> list[int]:
        """num_tokens proposals to draw once the step is scheduled."""
        return [UNDRAFTED] * num_tokens

    def observe(self, input_ids: jax.Array, metadata: AttentionMetadata, *,
                decode_only: bool) -> None:
        self.runner.advance(input_ids, metadata, decode_only=decode_only)

    def draft(self, verifying: list[tuple[Sequence, RowOf]]) -> Drafts | None:
        """Draw each verifying sequence's proposals into its spec_token_ids.

        verifying: each sequence with the maker of its sampling rows (the row of the
        token after a list of proposals: its request's parameters, seed and position).
        """
        if not verifying:
            return None
        # Those with fewer proposals stop drafting first and come last: a sequence keeps
        # its row in every draft step it takes part in.
        verifying = sorted(verifying, key=lambda entry: -len(entry[0].spec_token_ids))
        drafted: list[list[int]] = [[] for _ in verifying]
        step_probs = []
        for step in range(len(verifying[0][0].spec_token_ids)):
            taking = [entry for entry in verifying if len(entry[0].spec_token_ids) > step]
            tokens, probs = self._draft_step(taking, drafted[: len(taking)], len(verifying))
            for so_far, token in zip(drafted, tokens.tolist(), strict=False):
                so_far.append(token)
            step_probs.append(probs)
        for (seq, _), proposals in zip(verifying, drafted, strict=True):
            seq.spec_token_ids = proposals
        return Drafts(_stack(*step_probs), {id(seq): row for row, (seq, _) in enumerate(
            verifying)})

    def _draft_step(self, verifying: list[tuple[Sequence, RowOf]], drafted: list[list[int]],
                    num_rows: int) -> tuple[np.ndarray, jax.Array]:
        """One decode step of the draft over each sequence extended by its proposals so
        far, padded to at least num_rows rows: (the tokens it draws, host; their
        distributions [R, V], device)."""
        views = [dataclasses.replace(seq, output_token_ids=seq.output_token_ids + so_far,
                                     num_computed_tokens=len(seq) - 1 + len(so_far),
                                     spec_token_ids=[])
                 for (seq, _), so_far in zip(verifying, drafted, strict=True)]
        model_input = build_model_input([(view, 1) for view in views], self.block_tables,
                                        self.shapes.buckets, num_rows,
                                        self.shapes.num_speculative_tokens)
        logits = self.runner.execute(model_input.input_ids, model_input.metadata,
                                     decode_only=True, num_rows=model_input.num_rows)[0]
        rows = [row_of(so_far) for (_, row_of), so_far in zip(verifying, drafted, strict=True)]
        tensors = sampling_tensors(rows, model_input.num_rows, self.vocab_size)
        tokens, probs = draft_sample(logits, tensors)
        return np.asarray(tokens)[: len(views)], probs
