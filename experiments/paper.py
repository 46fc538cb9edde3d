"""Every figure this project quotes from the vLLM paper, each in one place.

Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023. The paper measured OPT-13B (LLaMA-13B for shared
prefixes) on NVIDIA A100 GPUs with the ShareGPT and Alpaca traces; this project
measures a small model on a CPU and synthetic workloads fitted to Figure 11's
means, so the figures below are what its own measurements are set beside, not
targets they must meet. Tables, figures, JSON reports and docs take them from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A figure the paper gives as a range, low to high (over the settings it spans)."""

    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.low:g}-{self.high:g}"


@dataclass(frozen=True)
class MeanLengths:
    """A dataset's mean prompt and output lengths, in tokens."""

    input_tokens: float
    output_tokens: float


FIGURE1_KV_CACHE_SHARE = 0.30
"""Figure 1: the share of an A100-40GB's memory that holds the KV cache when serving a
13B-parameter model (">30%" beside 65% of parameters)."""

FIGURE2_SHAREGPT_TOKEN_STATES_PCT = {
    "orca-max": 20.4, "orca-pow2": 26.8, "orca-oracle": 38.2, "paged": 96.3}
"""Figure 2: % of KV cache memory holding token states, by system (this project's
allocator names; "paged" is vLLM), averaged over Section 6.2's ShareGPT serving runs."""

FIGURE11_MEAN_LENGTHS = {
    "sharegpt": MeanLengths(input_tokens=161.31, output_tokens=337.99),
    "alpaca": MeanLengths(input_tokens=19.31, output_tokens=58.45),
}
"""Figure 11: mean input and output lengths of the ShareGPT and Alpaca traces, tokens."""

FIGURE12_SHAREGPT_RATE_RATIO = {
    "vs_orca_oracle": Span(1.7, 2.7), "vs_orca_max": Span(2.7, 8.0)}
"""Figure 12 (Section 6.2): the request rate vLLM sustains at the same normalized
latency over Orca (Oracle)'s and Orca (Max)'s on ShareGPT, across the figure's settings (x)."""

FIGURE15_MEMORY_SAVED_PCT = {
    "alpaca": {"parallel": Span(6.1, 9.8), "beam": Span(37.6, 55.2)},
    "sharegpt": {"parallel": Span(16.2, 30.5), "beam": Span(44.3, 66.3)},
}
"""Figure 15 (Alpaca) and Section 6.3's text (ShareGPT): % of KV blocks saved by sharing,
by dataset, for parallel sampling and beam search with n or beam width 2 to 6, OPT-13B."""

FIGURE16_PREFIX_TOKENS = {"one-shot": 80, "five-shot": 341}
"""Figure 16 (Section 6.4): tokens of the shared translation prefix, one example or five."""

FIGURE16_RATE_RATIO = {"one-shot": 1.67, "five-shot": 3.58}
"""Figure 16 (Section 6.4): the request rate vLLM sustains over Orca (Oracle)'s with the
shared translation prefix, LLaMA-13B on WMT16 English-to-German, by prefix (x)."""

FIGURE17_RATE_RATIO = 2.0
"""Figure 17 (Section 6.5): the request rate vLLM sustains over each of the three Orca
baselines on the chatbot workload (ShareGPT conversations, prompts cut to their last
1,024 tokens, up to 1,024 output tokens), OPT-13B (x)."""

BLOCK_SIZE_TOKENS = 16
"""Section 7.2: vLLM's default KV block size, in tokens (Figure 18 finds it best)."""



def published() -> dict:
    """Every figure above, JSON-ready (a Span as [low, high]), for the reports that set
    measurements beside them."""
    def plain(value):
        if isinstance(value, Span):
            return [value.low, value.high]
        if isinstance(value, MeanLengths):
            return {"input_tokens": value.input_tokens, "output_tokens": value.output_tokens}
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return plain({
        "figure1_kv_cache_share": FIGURE1_KV_CACHE_SHARE,
        "figure2_sharegpt_token_states_pct": FIGURE2_SHAREGPT_TOKEN_STATES_PCT,
        "figure11_mean_lengths": FIGURE11_MEAN_LENGTHS,
        "figure12_sharegpt_rate_ratio": FIGURE12_SHAREGPT_RATE_RATIO,
        "figure15_memory_saved_pct": FIGURE15_MEMORY_SAVED_PCT,
        "figure16_prefix_tokens": FIGURE16_PREFIX_TOKENS,
        "figure16_rate_ratio": FIGURE16_RATE_RATIO,
        "figure17_rate_ratio": FIGURE17_RATE_RATIO,
        "block_size_tokens": BLOCK_SIZE_TOKENS,
    })
