"""benchmarks.matmul's attention section times the same attention on both sides: the
engine's XLA op and torch's scaled_dot_product_attention over the same pages agree."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.matmul import attention_rates


@pytest.mark.parametrize("context_lens,q_lens", [
    ([40, 7, 33, 1], [1, 1, 1, 1]),  # decode rows, one in the first block
    ([100, 20], [30, 20]),  # a prefill chunk after cached tokens, and a whole prompt
])
def test_xla_and_torch_attend_alike(context_lens, q_lens):
    result = attention_rates(np.array(context_lens), np.array(q_lens), repeats=1)
    assert result["max_abs_difference"] < 1e-5
    assert result["kv_mib"] == pytest.approx(
        2 * sum(-(-n // 16) for n in context_lens) * 3 * 16 * 64 * 4 / 2**20)
