"""Two tiers: `python -m pytest` runs the fast tier, `python -m pytest --full` everything.

A test is fast unless it says otherwise with the `full` marker (on the test, its class
or its module's `pytestmark`): real models past their stored references, processes a
test starts (several devices, several hosts, the server's shutdown, the command line,
notebooks, clients), benchmark runs and the wide matrices. Every test collected gets
`fast` or `full` as it is collected, so `-m` selects within a tier (`-m "not
default_model"` keeps working) and the tier's deselection comes after it. Nothing is
skipped: without `--full` the full tier's tests are deselected, and CI runs them all.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="run the full tier too (real models, subprocess jobs, benchmark "
                          "runs, wide matrices): what CI runs")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: in the full tier only (`--full` runs it)")
    config.addinivalue_line("markers", "fast: in the fast tier (every test not marked full)")


def pytest_report_header(config: pytest.Config) -> str:
    return "tier: " + ("full (every test)" if config.getoption("--full") else
                       "fast (--full runs every test)")


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.get_closest_marker("full") is None:
        item.add_marker(pytest.mark.fast)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full"):
        return
    fast = [item for item in items if item.get_closest_marker("full") is None]
    if len(fast) < len(items):
        config.hook.pytest_deselected(items=[item for item in items
                                             if item.get_closest_marker("full") is not None])
        items[:] = fast
