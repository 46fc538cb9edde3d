"""The suite's fixtures and hooks, one plugin per concern in tests/plugins.

`python -m pytest` runs the fast tier; `--full` runs every test (tests/plugins/tiers.py).

The tests are laid out like the packages they test (tests/memory for jpaged.memory,
...). Every directory is a package, so that pytest imports each test module by its
full name (tests/memory and tests/engine may both hold a test_prefix_collision.py) and
tests import shared helpers from where they live (tests.plugins.hf_models, ...). The
plugins import torch, transformers and JAX only where a fixture or helper needs them,
so that tests/memory and tests/core run without any of the three.

Tests of tensor and data parallelism live in tests/multidevice and run in a
process of their own on 8 simulated CPU devices (tests/test_multidevice.py
starts it); the rest of the suite sees one device.
"""

from __future__ import annotations

import os

pytest_plugins = [
    # First: it sets JAX's compilation cache before anything imports JAX.
    "tests.plugins.compilation_cache",
    "tests.plugins.tiers",
    "tests.plugins.shuffle",
    "tests.plugins.kernels",
    "tests.plugins.hf_models",
    "tests.plugins.paged_pool",
    "tests.plugins.default_model",
    "tests.plugins.http_server",
    "tests.plugins.prefix_hash",
    "tests.plugins.cli",
]

# tests/multidevice needs 8 simulated devices, set before JAX starts: test_multidevice.py
# runs it in a process of its own with this variable set, and no other run collects it.
MULTIDEVICE = os.environ.get("JPAGED_TEST_MULTIDEVICE") == "1"
collect_ignore = [] if MULTIDEVICE else ["multidevice"]
