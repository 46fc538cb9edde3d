"""When a sequence's output ends: one rule for every place that needs it.

A sequence of a request ends at one of its stop tokens (EOS unless ignore_eos, and
stop_token_ids), or where its structured output's grammar is complete, once it has
min_tokens output tokens, and at its length limit: the
output length max_tokens allows, or what max_model_len leaves after the prompt,
whichever comes first. Before min_tokens the sampler suppresses the stop tokens.

The scheduler applies the rule to every token it appends (and to its prediction of
a running step's tokens, and to beams); the proposer's limits, a beam search's length
and the decode loop's device columns are read from it. `stops`, `reaches_length` and
`suppresses_stops` are the rule's arithmetic on plain ints, numpy or jax arrays alike,
so the jitted decode loop (jpaged.worker.decode_loop) ends its rows by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

from jpaged.sequence import SequenceGroup, SequenceStatus

_STOPPED = SequenceStatus.FINISHED_STOPPED
_LENGTH = SequenceStatus.FINISHED_LENGTH


def stops(is_stop_token, num_output, min_tokens):
    """Whether output token number `num_output` (counting from 1), a stop token where
    `is_stop_token`, ends its sequence as stopped."""
    return is_stop_token & (num_output >= min_tokens)


def reaches_length(num_output, max_output):
    """Whether `num_output` output tokens end a sequence at its length limit."""
    return num_output >= max_output


def suppresses_stops(num_output, min_tokens):
    """Whether the next draw after `num_output` output tokens must not be a stop token."""
    return num_output < min_tokens


@dataclass(frozen=True, slots=True)
class StopRule:
    """The stop rule of one request's sequences (they share a prompt).

    stop_token_ids: the tokens that stop a sequence once it has min_tokens outputs.
    min_tokens:     outputs before a stop token may end it.
    max_output:     the output length that ends a sequence: max_tokens, or what
                    max_model_len leaves after the prompt, whichever is smaller.
    max_proposed_output: the output length proposals may reach: they fit before
                    max_model_len and leave the last token max_tokens allows to the
                    target model.
    """

    stop_token_ids: frozenset[int]
    min_tokens: int
    max_output: int
    max_proposed_output: int

    @classmethod
    def of(cls, group: SequenceGroup, max_model_len: int) -> StopRule:
        max_len_output = max_model_len - group.seqs[0].num_prompt_tokens
        max_tokens = group.max_tokens
        if max_tokens is None:
            return cls(group.stop_token_ids, group.min_tokens, max_len_output, max_len_output)
        return cls(group.stop_token_ids, group.min_tokens, min(max_tokens, max_len_output),
                   min(max_tokens - 1, max_len_output))

    def finish_status(self, token: int, num_output: int, grammar_complete: bool = False
                      ) -> SequenceStatus | None:
        """How a sequence ends whose output token number `num_output` is `token` (None: it
        goes on); grammar_complete: its grammar allows nothing more after the token."""
        if stops(grammar_complete or token in self.stop_token_ids, num_output,
                 self.min_tokens):
            return _STOPPED
        if reaches_length(num_output, self.max_output):
            return _LENGTH
        return None

    def reaches_length(self, num_output: int) -> bool:
        return reaches_length(num_output, self.max_output)

    def suppresses_stops(self, num_output: int) -> bool:
        return suppresses_stops(num_output, self.min_tokens)

    def max_proposals(self, num_output: int, num_speculative_tokens: int) -> int:
        """Proposals a sequence with `num_output` outputs may have verified in one step."""
        return max(0, min(num_speculative_tokens, self.max_proposed_output - num_output))
