"""Fixtures and helpers of the test suite, one module per concern."""
