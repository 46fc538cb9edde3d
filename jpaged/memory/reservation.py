"""Orca's reservation policies: how many token slots a sequence holds from admission.

The vLLM paper compares paging with Orca-style systems that reserve a request's
KV memory for its whole possible length when it is admitted (Section 2.3,
Figures 2 and 12). An engine run with one of these allocations keeps paging's
blocks, kernels and pool, but reserves per sequence:

- "orca-max":    max_model_len tokens, whatever the request needs;
- "orca-pow2":   the prompt plus the next power of two of the output (a
                 25-token output reserves 32 output slots): the output
                 over-reserved by less than 2x, as the paper defines it;
- "orca-oracle": exactly prompt + output, as if the output length were known.

Every reservation is capped at max_model_len: no sequence grows past it.
"paged" reserves nothing: blocks are allocated as tokens arrive.

These policies flatter Orca. Its reservations are contiguous slabs, so freed
slabs leave holes and a request can wait while enough memory is free in total
(external fragmentation); here a reservation is any `ceil(tokens / block_size)`
blocks of the pool, which fragments nothing beyond the last block's tail.
"""

from __future__ import annotations

from typing import Literal

Allocation = Literal["paged", "orca-max", "orca-pow2", "orca-oracle"]
ALLOCATIONS: tuple[Allocation, ...] = ("paged", "orca-max", "orca-pow2", "orca-oracle")


def check_allocation(allocation: str) -> None:
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")


def next_power_of_two(n: int) -> int:
    """The least power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()


def reserved_tokens(
    allocation: str, num_prompt_tokens: int, output_len: int | None, max_model_len: int
) -> int:
    """Token slots each sequence of a request reserves at admission; 0 under "paged".

    output_len: the request's true output length (tokens), or None when it is
    not known in advance; "orca-pow2" and "orca-oracle" need it.
    """
    check_allocation(allocation)
    if allocation == "paged":
        return 0
    if allocation == "orca-max":
        return max_model_len
    if output_len is None:
        raise ValueError(
            f"allocation={allocation!r} reserves for the request's true output length, "
            "which is known only when it sets max_tokens and ignore_eos=True (and no stop "
            "strings or stop token ids)"
        )
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if allocation == "orca-pow2":
        output_len = next_power_of_two(output_len)
    return min(num_prompt_tokens + output_len, max_model_len)
