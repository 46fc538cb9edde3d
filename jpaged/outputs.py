"""What a request gives back, with vLLM's names: RequestOutput, CompletionOutput,
Logprob, and BeamSearchOutput for `LLM.beam_search`."""

from __future__ import annotations

from dataclasses import dataclass, field

from jpaged.sequence import SequenceStatus

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_IGNORED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass
class Logprob:
    """A token's log-probability (float32 log-softmax of the model's logits), its rank
    (1 is the most likely token) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, token id -> Logprob: the chosen token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# The same for prompt tokens; the first prompt token has nothing to condition on: None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence (a sample, or a beam).

    cumulative_logprob: sum of the chosen tokens' log-probabilities.
    logprobs:           per output token, when the request asked for them.
    finish_reason:      None while running, else "stop", "length", "abort" or "error"
                        (its step failed, or its logits were NaN or infinite).
    stop_reason:        the stop string or stop token id that ended it, if any
                        (None for EOS).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) and KV blocks of one request.

    logical_block_steps / physical_block_steps: over the steps the request held
    device blocks, the sum of its sequences' block-table lengths, and of the
    distinct blocks among them. Their ratio is the memory its sequences saved by
    sharing blocks (parallel samples, beams).

    num_draft_tokens / num_accepted_tokens: with speculative decoding, the tokens
    proposed for the request's sequences and those the target model accepted.
    """

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    logical_block_steps: int = 0
    physical_block_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)

    @property
    def kv_memory_saved(self) -> float:
        """(logical - physical) / logical block-steps: what sharing saved; 0 without sharing."""
        if self.logical_block_steps == 0:
            return 0.0
        return 1.0 - self.physical_block_steps / self.logical_block_steps


@dataclass
class RequestOutput:
    """A request's outputs: all of them (cumulative), or what is new (delta).

    num_cached_tokens: prompt tokens the prefix cache served when the request was first
    admitted (vLLM's name); None before then.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    num_cached_tokens: int | None = None


@dataclass(frozen=True)
class ReservedPrefix:
    """A prefix whose full KV blocks stay in the device pool until it is released
    (`LLM.reserve_prefix`; the paper's Section 4.4: a shared prefix stored in advance).

    prefix_id:         names it to `release_prefix`; never reused.
    num_tokens:        the prefix's tokens.
    num_cached_tokens: of those, the tokens of its full blocks: what a request whose
                       prompt extends the prefix finds cached (its
                       `RequestOutput.num_cached_tokens`); 0 for a prefix shorter than
                       a block, which holds nothing.
    num_blocks:        device blocks it holds, over every KV cache group.
    """

    prefix_id: int
    num_tokens: int
    num_cached_tokens: int
    num_blocks: int


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the output, as in vLLM; `text` and
    `logprobs` cover the output only (logprobs: per step, the candidates the beam's
    scores came from)."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]
