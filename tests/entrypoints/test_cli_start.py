"""What `python -m jpaged generate` sets up before its answer: a KV pool for the
prompts it runs, sized from the memory the host can give, and stdout for answers only."""

from __future__ import annotations

import math

import psutil

from jpaged import __main__ as cli
from jpaged.engine.machine import available_host_memory
from jpaged.model.loader import read_hf_config
from tests.plugins.hf_models import transformers_answer


def test_available_host_memory_counts_what_the_kernel_can_reclaim():
    """psutil's `available` (MemAvailable on Linux: free pages plus reclaimable page
    cache), not the free pages alone, within what other processes change meanwhile."""
    tolerance = 0.05 * psutil.virtual_memory().total
    assert abs(available_host_memory() - psutil.virtual_memory().available) < tolerance


def test_generate_pools_blocks_for_its_prompts_and_prints_only_answers(
        tiny_llama_dir, capsys, jpaged_logger_restored):
    prompts = ["the theme in the", "in the air"]
    status = cli.main(["generate", "--model", str(tiny_llama_dir), "--raw", "--max-tokens", "5",
                       "--block-size", "16", *prompts])
    out, err = capsys.readouterr()
    assert status == 0, err
    max_model_len = read_hf_config(tiny_llama_dir).max_position_embeddings
    num_blocks = len(prompts) * math.ceil(max_model_len / 16)  # the null block aside
    assert f"KV cache: {num_blocks} blocks x 16 tokens" in err
    expected = "".join(f"### {p}\n{transformers_answer(tiny_llama_dir, p, 5)}\n" for p in prompts)
    assert out == expected
