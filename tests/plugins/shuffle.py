"""`--shuffle-seed N`: run the test modules, and the tests within each, in an order drawn
from N, to show tests that depend on others' side effects."""

from __future__ import annotations

import random
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle-seed", type=int, default=None, metavar="N",
                     help="run test modules, and the tests within each, in an order drawn from N")


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle-seed")
    return None if seed is None else f"shuffle seed: {seed}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Last, so that no other hook (pytest groups tests by fixture parameters) reorders them.
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        items[:] = shuffled_by_module(items, random.Random(seed))


def shuffled_by_module(items: list[pytest.Item], rng: random.Random) -> list[pytest.Item]:
    """Modules in a random order, each one's tests in a random order. A module's tests stay
    together so that its module-scoped fixtures (an oracle's outputs, a loaded model) are
    built once, not once per visit."""
    by_module: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.path, []).append(item)
    modules = list(by_module.values())
    rng.shuffle(modules)
    for module_items in modules:
        rng.shuffle(module_items)
    return [item for module_items in modules for item in module_items]
