"""Sequences and sequence groups: the host-side state of a request.

A request is a SequenceGroup. It starts with one Sequence holding the prompt;
parallel sampling (n > 1) and beam search fork more sequences from it once the
prompt is computed, and all of them share the prompt's KV blocks. Only the
scheduler, and the KV cache manager it calls, change them.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jpaged.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from jpaged.core.stop_rule import StopRule
    from jpaged.lora.peft import LoRAAdapter
    from jpaged.structured_output.grammar import Grammar


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


# The output token of a draw still running on the device (async scheduling): the next
# schedule counts it, and the draw's result replaces it (AsyncScheduler.reconcile).
PLACEHOLDER_TOKEN = -1


@dataclass(eq=False)
class Sequence:
    """One token stream. `num_computed_tokens` counts tokens whose K/V are in the cache.

    seq_id: given by the scheduler when it admits or forks the sequence.
    spec_token_ids: tokens proposed to follow it (speculative decoding), which the next
    step computes after its last token and the target model accepts or rejects; never
    part of the sequence until accepted.
    grammar: where its output stands in its request's structured-output grammar (None
    without one); the scheduler advances it with every token it appends.
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    grammar: Grammar | None = None

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


# What a group without parameters of its own runs to: max_model_len, one sequence.
UNTIL_MAX_MODEL_LEN = SamplingParams(max_tokens=None, ignore_eos=True)


@dataclass(eq=False)
class SequenceGroup:
    """All sequences of one request, and what decides how they grow and end.

    params:        SamplingParams (n parallel samples, stop conditions) or
                   BeamSearchParams (beam_width beams, which beam search ends).
    arrival_time:  when the request arrived (time.perf_counter seconds).
    cache_salt:    isolates prefix-cache tenants (with LoRA, it carries the adapter's
                   name and weights hash too: jpaged.lora.slots.prefix_salt).
    adapter:       the LoRA adapter it runs with (None: the base model).
    eos_token_ids: the tokens that end a sample unless params.ignore_eos.
    seed:          the seed of the request's draws (params.seed, or one the engine
                   chose for an unseeded request).

    The sequences of a sampling request stay in sample order: seqs[i] is sample i.
    """

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams | BeamSearchParams = UNTIL_MAX_MODEL_LEN
    arrival_time: float = 0.0
    cache_salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0
    adapter: LoRAAdapter | None = None
    # Read from params once: the scheduler reads them for every group and token.
    # max_seqs: the most sequences the group holds at once (n samples, or beam_width
    # beams); stop_token_ids, min_tokens, max_tokens: what its stop rule is made of.
    is_beam_search: bool = field(init=False, repr=False)
    max_seqs: int = field(init=False, repr=False)
    stop_token_ids: frozenset[int] = field(init=False, repr=False)
    min_tokens: int = field(init=False, repr=False)
    max_tokens: int | None = field(init=False, repr=False)
    # When its sequences end, given by the scheduler that admits it (it knows max_model_len).
    stop_rule: StopRule | None = field(init=False, repr=False, default=None)
    # Prompt tokens the prefix cache served at its first admission (set by the scheduler).
    num_cached_tokens: int | None = field(init=False, repr=False, default=None)
    # The device slot of its adapter while admitted (jpaged.lora.slots); 0: none.
    adapter_slot: int = field(init=False, repr=False, default=0)

    def __post_init__(self):
        params = self.params
        self.is_beam_search = isinstance(params, BeamSearchParams)
        self.max_seqs = params.beam_width if self.is_beam_search else params.n
        stop = () if params.ignore_eos else self.eos_token_ids
        if not self.is_beam_search:
            stop = (*stop, *params.stop_token_ids)
        self.stop_token_ids = frozenset(stop)
        self.min_tokens = getattr(params, "min_tokens", 0)
        self.max_tokens = params.max_tokens

    @property
    def use_prefix_cache(self) -> bool:
        """False for a request that needs the logits of every prompt token (prompt
        logprobs): cached blocks would skip them."""
        return self.is_beam_search or self.params.prompt_logprobs is None

    @property
    def num_samples(self) -> int:
        """Deprecated: `max_seqs` (this held the beam width too)."""
        warnings.warn("SequenceGroup.num_samples is deprecated: use max_seqs",
                      DeprecationWarning, stacklevel=2)
        return self.max_seqs

    @property
    def forks_at_next_draw(self) -> bool:
        """Its one sequence, a prompt, becomes max_seqs parallel samples when it draws."""
        return len(self.seqs) == 1 and not self.is_beam_search and self.max_seqs > 1

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
