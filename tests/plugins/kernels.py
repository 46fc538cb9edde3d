"""The kernels' interpret policy.

The Pallas kernels run in interpret mode, so that every one of them runs on a CPU.
`JPAGED_TEST_COMPILED=1` compiles instead the kernel of the machine's own backend
(the Triton kernel and, on Hopper, the Mosaic GPU kernel on a GPU, the Mosaic
kernel on a TPU) and skips the tests of a kernel that cannot compile there: the run
that checks the kernels on an accelerator.
"""

from __future__ import annotations

import os

import pytest

COMPILED_KERNELS = os.environ.get("JPAGED_TEST_COMPILED") == "1"


def kernel_interpret(implementation: str | None) -> bool:
    """`interpret=` for a test that runs the Pallas kernel `implementation` (None: the
    backend's own). True, unless JPAGED_TEST_COMPILED=1: then False, and a test of
    another backend's kernel is skipped (it cannot compile here)."""
    if not COMPILED_KERNELS:
        return True
    # Imported here: loading this plugin must not start JAX for the host-only tests.
    import jax

    import kernels_pallas

    backend = jax.default_backend()
    if implementation == "mosaic_gpu" and (reason := kernels_pallas.mosaic_gpu_support()):
        pytest.skip(reason)
    if implementation in ("triton", "tpu") and backend != {"triton": "gpu"}.get(
            implementation, implementation):
        pytest.skip(f"the {implementation} kernel does not compile on {backend}")
    return False
