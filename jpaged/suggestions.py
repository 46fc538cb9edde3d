"""Unknown option names answered with the closest known ones (no jax: the CLI uses it
before loading anything)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, known: Iterable[str], count: int = 3) -> list[str]:
    """Up to `count` of `known` spelled most like `name`, closest first."""
    return difflib.get_close_matches(name, list(known), n=count, cutoff=0.6)


def unknown_message(name: str, known: Iterable[str], what: str) -> str:
    """"{what} has no option 'x'; did you mean 'y' or 'z'?" (its first part alone when
    nothing is close)."""
    matches = closest(name, known)
    if not matches:
        return f"{what} has no option {name!r}"
    return f"{what} has no option {name!r}; did you mean {' or '.join(map(repr, matches))}?"


def check_keywords(kwargs: dict, known: Iterable[str], what: str) -> None:
    """TypeError naming the first keyword of `kwargs` not in `known`, and the closest known."""
    known = list(known)
    unknown = [name for name in kwargs if name not in known]
    if unknown:
        raise TypeError(unknown_message(unknown[0], known, what))
