"""Sequences and sequence groups: the host-side state of a request.

A request is a SequenceGroup. It starts with one Sequence holding the prompt;
parallel sampling (n > 1) and beam search fork more sequences from it once the
prompt is computed, and all of them share the prompt's KV blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # could never fit the KV pool
    FINISHED_ERROR = enum.auto()  # its step failed, or its logits were not finite

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
            SequenceStatus.FINISHED_IGNORED,
            SequenceStatus.FINISHED_ERROR,
        )


@dataclass(eq=False)
class Sequence:
    """One token stream. `num_computed_tokens` counts tokens whose K/V are in the cache."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id(self, index: int) -> int:
        """Token at position `index` without building the full list."""
        num_prompt = len(self.prompt_token_ids)
        if index < num_prompt:
            return self.prompt_token_ids[index]
        return self.output_token_ids[index - num_prompt]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 without building the full list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass(eq=False)
class SequenceGroup:
    """All sequences of one request.

    cache_salt:       isolates prefix-cache tenants.
    num_samples:      sequences the prompt's one sequence turns into in the step
                      that computes its last prompt token (parallel sampling's n):
                      that step draws a token for each, from the same logits.
    use_prefix_cache: False for a request that needs the logits of every prompt
                      token (prompt logprobs): cached blocks would skip them.
    reserved_len:     token slots each of its sequences (up to num_samples of them)
                      holds from admission until the request ends, as Orca
                      reserves (jpaged.memory.reservation); 0 allocates blocks as
                      tokens arrive (paging).
    """

    request_id: str
    seqs: list[Sequence]
    arrival_time: float = 0.0
    cache_salt: str | None = None
    num_samples: int = 1
    use_prefix_cache: bool = True
    reserved_len: int = 0

    def seqs_with(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids
