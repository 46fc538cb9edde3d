"""The covering array the engine's options are tested on: KV cache layouts and block sizes.

An engine option (beam search, n > 1, preemption, prefix caching, logprobs, speculative
decoding, the decode loop, async scheduling, a quantized cache, tensor parallelism)
meets a model family only through the model's KV cache layout, and meets the block size
only where it changes which blocks a sequence holds. So each option runs on one row per
layout kind, the rows spread over the block-size regimes, instead of on every family at
every block size:

    row          layout                                        block size
    llama-128    no window                                     128: a sequence in one block
    mistral-4    a window of 8 on every layer                  4: whole blocks leave it
    mistral-16   a window of 8 on every layer                  16: its edge inside a block
    gemma3-1     local (window 8) and global layers in four    1: a block per token, one
                 KV cache groups                               leaving each local group
                                                               every step

Each family's mathematics (RoPE variants, biases, norms, soft-caps, fused projections) is
held to transformers in tests/model/test_model.py, and tensor parallelism, which splits
parameters as well as the cache, keeps its families (tests/multidevice); Phi-3's window of
12 meets the options there too. The row FAST_LAYOUT runs in the fast tier, the others in
the full tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Layout:
    """One row: the tiny model's fixture (tests/plugins/hf_models.py) and a block size."""

    model_dir: str
    block_size: int

    @property
    def id(self) -> str:
        return f"{self.model_dir.removeprefix('tiny_').removesuffix('_dir')}-{self.block_size}"


LAYOUTS = (Layout("tiny_llama_dir", 128), Layout("tiny_mistral_dir", 4),
           Layout("tiny_mistral_dir", 16), Layout("tiny_gemma3_dir", 1))
# The fast tier's row: the most paths at once (groups, windows, a block per token).
FAST_LAYOUT = LAYOUTS[3]


def layout_params(layouts=LAYOUTS) -> list:
    """pytest params of the rows, every row but FAST_LAYOUT in the full tier."""
    return [pytest.param(layout, id=layout.id,
                         marks=() if layout == FAST_LAYOUT else pytest.mark.full)
            for layout in layouts]


def layout_models(request: pytest.FixtureRequest, layout: Layout) -> tuple:
    """(jpaged's loaded model, transformers' model, block size) of a row."""
    from jpaged.model.loader import load_model
    from tests.plugins.hf_models import oracle_transformers

    directory = request.getfixturevalue(layout.model_dir)
    oracle = oracle_transformers().AutoModelForCausalLM.from_pretrained(directory).eval()
    return load_model(directory), oracle, layout.block_size
