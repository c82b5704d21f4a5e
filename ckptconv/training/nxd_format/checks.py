"""Checks of a parsed NxD optimizer file's structure (:mod:`ckptconv.training.nxd_format.files`): each failure
is one line naming the file and the key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError
from ckptconv.training.nxd_format.files import ADAMW_KEYS, Leaf, NumberLeaf


def without_leaves(value: Any) -> Any:
    """The structure without tensors (to compare param groups across dp ranks)."""
    if isinstance(value, dict):
        return {k: without_leaves(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_leaves(v) for v in value]
    return None if isinstance(value, Leaf) else value


def checked_param_groups(groups: Any, path: Path) -> list[dict[str, Any]]:
    if not isinstance(groups, list) or not groups:
        raise ConversionError(f"{path}: 'param_groups' must be a non-empty list, got {type(groups).__name__}")
    start = 0
    for g, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or params != list(range(start, start + len(params))):
            raise ConversionError(f"{path}: param_groups[{g}]['params'] must number the parameters "
                                  f"{start}, {start + 1}, ... in order, got {params!r}")
        start += len(params)
    return groups


def indexed(table: Any, i: int, path: Path, where: str) -> Any:
    if not isinstance(table, dict):
        raise ConversionError(f"{path}: {where!r} must be a dict by optimizer index, got {type(table).__name__}")
    if i not in table:
        raise ConversionError(f"{path}: {where!r} has no entry for optimizer index {i} (a parameter never stepped?)")
    return table[i]


def no_extra_indices(table: dict[Any, Any], count: int, path: Path, where: str) -> None:
    extra = [k for k in table if not (isinstance(k, int) and 0 <= k < count)]
    if extra:
        raise ConversionError(f"{path}: {where!r} has key {extra[0]!r}; the param groups number {count} parameters")


def adamw_state(state: Any, path: Path, where: str) -> dict[str, Leaf]:
    if not isinstance(state, dict) or set(state) != set(ADAMW_KEYS):
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        extra = sorted(map(str, set(state) - set(ADAMW_KEYS))) if isinstance(state, dict) else []
        what = f"unknown key {extra[0]!r}" if extra else f"keys {keys}"
        raise ConversionError(f"{path}: {where} has {what}; expected AdamW's {', '.join(ADAMW_KEYS)}")
    step = state["step"]
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        state = {**state, "step": NumberLeaf(step)}
    return {k: tensor_leaf(state[k], path, f"{where}[{k!r}]") for k in ADAMW_KEYS}


def tensor_leaf(value: Any, path: Path, where: str) -> Leaf:
    if not isinstance(value, Leaf):
        raise ConversionError(f"{path}: {where} must be a tensor, got {type(value).__name__}")
    return value


def stored_shape(value: Any, path: Path, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise ConversionError(f"{path}: {where} must be a list of sizes, got {value!r}")
    return tuple(value)


def chunk_shape(shape: tuple[int, ...], dp: int, path: Path, i: int) -> tuple[int, ...]:
    if not shape:
        raise ConversionError(f"{path}: shape_info[{i}] is a scalar parameter; ZeRO-1 partitions dim 0")
    return (math.ceil(shape[0] / dp), *shape[1:])


def chunk_error(path: Path, what: str, i: int, actual: Any, want: tuple[int, ...], full: tuple[int, ...],
                 dp: int) -> str:
    message = (f"{path}: {what} of optimizer index {i} has shape {list(actual)}; the parameter is {list(full)}, so "
               f"{dp} dp rank file(s) imply {list(want)}")
    if dp == 1 and what != "step" and len(actual) == len(full) and 0 < actual[0] < full[0]:
        message += (" (one dp rank's ZeRO-1 chunk of a run with more dp ranks whose other files are absent: NxDT "
                    "saves ZeRO-1 state as if replicated unless its model config sets wrap_with_zero)")
    return message

