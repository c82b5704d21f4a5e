"""``torch.save`` of a nested state (an optimizer state, a side file) through :class:`TorchZipWriter`: the same bytes,
written from the tensors where they lie (positional writes, the digest and direct I/O of :mod:`write_digest` and
:mod:`direct_io` when the caller turned them on) instead of through torch's buffered zip stream.

A tensor on the ``meta`` device stands for one whose bytes other processes write into the file this one created and
sized (:func:`write_share`, then the owner's :meth:`TorchZipWriter.add_extent_crc`): the plan needs only its dtype and
shape, the pickle is the same.

Only what the planner pickles exactly as torch does is written so: dicts, lists and tuples of plain values and
plain CPU tensors that each own exactly one storage of their own. Anything else (a view, two tensors on one storage,
an object torch pickles by its class) is left to ``torch.save`` by the caller: :func:`plan_object` says None.

    >>> entries, tensors = plan_object({"state": {"w": {"exp_avg": torch.zeros(2)}}, "step": 3})
    >>> list(tensors)
    ['state/w/exp_avg']
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from ckptconv.io.torchzip import (
    SUPPORTED_DTYPES,
    TensorAt,
    TensorMeta,
    TorchZipWriter,
    ZipLayout,
    plan_zip,
    pwrite_extent,
)

_CONTAINERS = (dict, OrderedDict, list, tuple)


class _Unplannable(Exception):
    """Raised inside the walk: the object is left to torch.save."""


def plan_object(obj: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``obj`` (a dict) as plan_zip entries (TensorMeta at the top, TensorAt below) and its tensors by entry key, or
    None when torch.save would write it otherwise than the planner (see the module)."""
    if type(obj) not in (dict, OrderedDict) or (type(obj) is OrderedDict and vars(obj)) or \
            any(not isinstance(k, str) for k in obj):
        return None
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    containers: set[int] = set()

    def walk(value: Any, key: str, top: bool) -> Any:
        if isinstance(value, torch.Tensor):
            _check(value, storages)
            tensors[key] = value
            meta = TensorMeta.of(value)
            return meta if top else TensorAt(key, meta)
        if type(value) not in _CONTAINERS or not _holds_tensor(value):
            return value  # the same object: the pickle's memo sees what torch.save's sees
        if id(value) in containers or (type(value) is OrderedDict and vars(value)):
            raise _Unplannable  # a container reached twice would be one memo entry in torch.save's pickle
        containers.add(id(value))
        if isinstance(value, dict):
            return type(value)((k, walk(v, f"{key}/{k}", False)) for k, v in value.items())
        return type(value)(walk(v, f"{key}/{i}", False) for i, v in enumerate(value))

    try:
        entries = {k: walk(v, str(k), True) for k, v in obj.items()}
    except _Unplannable:
        return None
    return (OrderedDict(entries) if type(obj) is OrderedDict else entries), tensors


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if type(value) in (list, tuple):
        return any(_holds_tensor(v) for v in value)
    return False


def _check(t: torch.Tensor, storages: set[int]) -> None:
    """A tensor torch.save writes as the planner does: plain, on the CPU (or a meta stand-in), alone on a storage
    it fills."""
    if (type(t) is not torch.Tensor or t.device.type not in ("cpu", "meta") or t.requires_grad or t.is_conj() or t.is_neg()
            or t.dtype not in SUPPORTED_DTYPES or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        raise _Unplannable
    try:
        TensorMeta.of(t)
    except ValueError:  # a stride that is not a dense layout
        raise _Unplannable from None
    storage = t.untyped_storage().data_ptr() if t.numel() and t.device.type == "cpu" else id(t)
    if storage in storages:
        raise _Unplannable
    storages.add(storage)


def save_object(obj: Any, path: str | os.PathLike[str]) -> bool:
    """``torch.save(obj, path)`` through TorchZipWriter; False (nothing written) when :func:`plan_object` declines."""
    planned = plan_object(obj)
    if planned is None:
        return False
    entries, tensors = planned
    try:
        layout = plan_zip(path, entries)
    except ValueError:  # a value the safe pickle does not allow (torch.save pickles it by class)
        return False
    with TorchZipWriter(path, layout) as writer:
        for key, tensor in tensors.items():
            writer.write_tensor(key, tensor)
    return True


Extent = tuple[str, int, int, int]  # (record key, byte offset in the record, length, CRC-32): add_extent_crc's


def write_share(path: str | os.PathLike[str], layout: ZipLayout, extents: list[tuple[str, int, torch.Tensor]]) -> \
        list[Extent]:
    """This process's share of a zip another process planned (``layout``), created and sized at ``path`` (its
    :class:`TorchZipWriter`): each (key, byte offset in the record, contiguous CPU tensor) written in place. Never
    creates the file. Returns what the owner's :meth:`TorchZipWriter.add_extent_crc` takes."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return [(key, offset, t.numel() * t.element_size(), pwrite_extent(fd, layout, key, offset, t))
                for key, offset, t in extents]
    finally:
        os.close(fd)
