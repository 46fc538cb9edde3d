"""tests/multidevice in a process of its own on 8 simulated CPU devices.

JAX fixes its device count when it starts, so the tensor- and data-parallel tests
cannot share this process (which keeps one device for the rest of the suite).
Their failures come back as this test's failure, with the inner pytest's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jpaged.entrypoints.llm import LLM

ROOT = Path(__file__).resolve().parent.parent
# A hung inner run fails this test instead of using up the suite's time.
TIMEOUT_S = 1800


def run_multidevice(marker_expression: str, *, full: bool) -> None:
    """Run tests/multidevice's tests selected by `-m marker_expression` (of its full tier
    with `full`, else of its fast tier); fail with their output."""
    env = dict(os.environ, JPAGED_TEST_MULTIDEVICE="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""),
                                   "--xla_force_host_platform_device_count=8"]).strip())
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
               *(["--full"] if full else []), "-m", marker_expression,
               str(ROOT / "tests" / "multidevice")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    # The inner tests print how many near-tie steps they met; -rA passes it on.
    print(result.stdout[-20000:])
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]


def test_tensor_and_data_parallel_on_eight_devices():
    """The fast tier's tests of tensor and data parallelism."""
    run_multidevice("not default_model", full=False)


@pytest.mark.full
def test_tensor_and_data_parallel_on_eight_devices_in_full():
    """The rest of them on tiny models: the covering arrays' other rows."""
    run_multidevice("full and not default_model", full=True)


@pytest.mark.full
@pytest.mark.default_model
def test_default_model_tensor_parallel_on_eight_devices():
    run_multidevice("default_model", full=True)


def test_more_devices_than_there_are_is_an_error(tiny_llama_dir):
    available = jax.device_count()
    with pytest.raises(ValueError, match=rf"\({available + 1}\).*exceeds the {available} "):
        LLM(str(tiny_llama_dir), tensor_parallel_size=available + 1, num_blocks=8)
