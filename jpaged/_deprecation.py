"""Old names kept for one release: a module's `__getattr__` that finds a moved name in
its new home and warns."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def moved_names(module: str, new_homes: dict[str, str]) -> Callable[[str], object]:
    """`__getattr__` for `module`: new_homes maps an old name to the module that holds it
    now (under the same name, or "module:new_name")."""

    def __getattr__(name: str) -> object:
        if name not in new_homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new_name = new_homes[name].partition(":")
        new_name = new_name or name
        warnings.warn(f"{module}.{name} is deprecated: use {home}.{new_name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new_name)

    return __getattr__
