"""What a request gives back (vLLM's names): RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from jpaged.sequence import SequenceStatus

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_IGNORED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class CompletionOutput:
    """One generated sequence. finish_reason: None while running, else stop / length / abort."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
