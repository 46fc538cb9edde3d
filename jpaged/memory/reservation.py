"""Orca's reservation policies: how many token slots a sequence holds from admission.

The vLLM paper compares paging with Orca-style systems that reserve a request's
KV memory for its whole possible length when it is admitted (Section 2.3,
Figures 2 and 12). One vocabulary names the allocations everywhere (the
engine's `allocation=`, the simulator, experiments/); each Orca policy reserves
per sequence:

- "orca-max":    max_model_len tokens, whatever the request needs;
- "orca-pow2":   the prompt plus the next power of two of the output (a
                 25-token output reserves 32 output slots): the output
                 over-reserved by less than 2x, as the paper defines it;
- "orca-oracle": exactly prompt + output, as if the output length were known.

Every reservation is capped at max_model_len: no sequence grows past it.
"paged" reserves nothing: blocks are allocated as tokens arrive.

The engine reserves paged blocks (jpaged.memory.reserving_block_manager): any
`ceil(tokens / block_size)` blocks of the pool, which fragments nothing beyond
the last block's tail, so these policies flatter Orca there. The simulator's
contiguous arena (experiments.baselines) places each reservation as one slab,
whose freed holes fragment the pool as Orca's do.
"""

from __future__ import annotations

from typing import Literal

from jpaged.sampling_params import SamplingParams
from jpaged.sequence import SequenceGroup

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


def known_output_len(group: SequenceGroup, max_model_len: int) -> int | None:
    """The output length `group`'s sequences will reach, or None if EOS or a stop may end
    them sooner: known when it ignores EOS and has no stop strings or stop token ids
    (max_tokens, or else max_model_len, is then the length)."""
    params = group.params
    if not params.ignore_eos:
        return None
    if isinstance(params, SamplingParams) and (params.stop or params.stop_token_ids):
        return None
    # A prompt of max_model_len tokens still samples one.
    room = max(max_model_len - group.seqs[0].num_prompt_tokens, 1)
    return room if params.max_tokens is None else min(params.max_tokens, room)
