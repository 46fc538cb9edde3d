"""The prefix cache's block hash replaced by one that collides, for the tests that check
a lookup never trusts the hash alone (on the group tables and in the engine)."""

from __future__ import annotations

import pytest

from jpaged.memory import group_tables

THE_HASH = 12345


@pytest.fixture
def colliding_hash(monkeypatch):
    """Every block of every request hashes to THE_HASH."""
    monkeypatch.setattr(group_tables, "hash_block", lambda parent, tokens, salt: THE_HASH)


@pytest.fixture
def depth_hash(monkeypatch):
    """Block i of every chain hashes to i + 1: the blocks at one depth collide."""
    monkeypatch.setattr(group_tables, "hash_block", lambda parent, tokens, salt: parent + 1)
