"""Checks on plain option values, shared by the config and the modules it imports (a leaf: imports nothing of
nxdtrain, so :mod:`nxdtrain.config.fsdp_checks` can use it without a circle through :mod:`nxdtrain.config.options`).

    >>> is_int(2), is_int(True), is_int(2.0)
    (True, False, False)
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer, not a bool (YAML's ``true`` is no count of ranks or steps)."""
    return isinstance(value, int) and not isinstance(value, bool)
