"""The command line's process-wide side effects, undone after each test that runs it."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def jpaged_logger_restored():
    """The CLI sends the jpaged logger to stderr; leave no handler behind for other tests."""
    logger = logging.getLogger("jpaged")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
