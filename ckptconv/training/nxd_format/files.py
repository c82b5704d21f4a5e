"""One of NxD's optimizer files (``optim/dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt``, plain torch zip or xser-split) as
its structure, each stored tensor a leaf whose dtype and shape are known and whose bytes are read when asked; the keys
such a file holds. Which parameter each leaf belongs to: :mod:`ckptconv.training.nxd_format.ranks`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError
from ckptconv.io.checked import CheckedFiles, check_whole_file
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.io.nxd import INFO_SUFFIX, TENSORS_SUFFIX
from ckptconv.io.safe_load import PickledTensor, TensorReference, is_torch_zip, load_small
from ckptconv.io.torchzip import StoredTensor, TorchZipReader

MOMENTS = ("exp_avg", "exp_avg_sq")
ADAMW_KEYS = ("step", *MOMENTS)
ZERO1_KEYS = ("state", "param_groups", "base_state", "shape_info")
MASTERS_KEY = "sharded_master_weights"
# NeuronEPZero1Optimizer.state_dict()'s own keys (ep > 1), in its order: where the expert optimizer's state starts
OFFSET_KEYS = ("ep_param_id_offset", "ep_param_group_offset", "ep_base_state_offset", "ep_shape_info_offset")


def ep_offset(count: int) -> int:
    """NxD's ``_get_offset`` of a dict holding indices 0..count-1: its largest key + 1, and 1 for an empty dict."""
    return count if count else 1


class Leaf:
    """One stored tensor of an optimizer file: dtype and shape known, bytes read on demand."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def open(self) -> None:
        """Open its file now (so that a check of every opened file covers it); reads nothing."""

    def read(self) -> torch.Tensor:
        rows = self.shape[0] if self.shape else 1
        return self.read_rows(0, rows).reshape(self.shape)


class _ZipLeaf(Leaf):
    def __init__(self, reader: TorchZipReader, stored: StoredTensor) -> None:
        self.reader, self.stored = reader, stored
        self.dtype, self.shape = stored.dtype, tuple(stored.shape)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.reader.read_stored_rows(self.stored, start, stop)


class _SplitLeaf(Leaf):
    """``<file>.tensors/tensor_<tid>.pt``, opened at the first read."""

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], io: str, checks: CheckedFiles) -> None:
        self.path, self.dtype, self.shape, self.io, self.checks = path, dtype, shape, io, checks
        self._reader: TorchZipReader | None = None
        self._lock = threading.Lock()  # the executor's workers may ask for the same master at once

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        self.open()
        assert self._reader is not None
        return self._reader.read_rows("", start, stop)

    def open(self) -> None:
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self._reader is None:
            if not self.path.is_file():
                raise ConversionError(f"{self.path}: missing; its .info.pt lists it")
            reader = TorchZipReader(self.path, io=self.io, checks=self.checks)
            stored = reader.entry(reader.keys()[0]) if reader.keys() == [""] else None
            if not isinstance(stored, StoredTensor) or (stored.dtype, tuple(stored.shape)) != (self.dtype, self.shape):
                reader.close()
                raise ConversionError(f"{self.path}: expected one {self.dtype} tensor of shape {list(self.shape)} "
                                      "as its .info.pt records")
            self._reader = reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class NumberLeaf(Leaf):
    """A ``step`` saved as a plain number (torch before 1.12), read as a 0-d float32 tensor."""

    def __init__(self, value: float) -> None:
        self.value, self.dtype, self.shape = value, torch.float32, ()

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor([float(self.value)], dtype=self.dtype)[start:stop]


class DcpLeaf(Leaf):
    def __init__(self, dcp: DcpCheckpoint, key: str) -> None:
        self.dcp, self.key = dcp, key
        self.dtype, self.shape = dcp.info(Source(None, key))[:2]

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.dcp.read_rows(Source(None, self.key), start, stop)


# --------------------------------------------------------------------------------------------
# One optimizer file: its structure with the tensors as leaves


def _walk(obj: Any, where: str, leaf: Callable[[Any, str], Leaf | None]) -> Any:
    """The structure with each tensor replaced by its leaf; only plain containers and values allowed."""
    made = leaf(obj, where)
    if made is not None:
        return made
    if isinstance(obj, dict):
        return {k: _walk(v, f"{where}[{k!r}]", leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk(v, f"{where}[{i}]", leaf) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype)):
        return obj
    raise ConversionError(f"{where}: unexpected {type(obj).__name__} in an optimizer file")


class OptimFile:
    """A ``dp_rank_XX_tp_rank_YY_pp_rank_ZZ.pt`` of ``optim/``, plain torch zip or xser-split."""

    def __init__(self, path: Path, io: str, checks: CheckedFiles) -> None:
        self.path = path
        self._zip: TorchZipReader | None = None
        self._split: list[_SplitLeaf] = []
        info_path = Path(str(path) + INFO_SUFFIX)
        if info_path.is_file():
            for small in (path, info_path):  # small files loaded whole: checked whole first
                check_whole_file(small, checks.record(small) if checks.enabled else None)
            info = load_small(info_path)
            tensors = Path(str(path) + TENSORS_SUFFIX)

            def split_leaf(obj: Any, where: str) -> Leaf | None:
                if not isinstance(obj, TensorReference):
                    return None
                tid = getattr(obj, "tid", None)
                entry = info.get(tid) if isinstance(info, dict) and isinstance(tid, int) else None
                if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), torch.dtype):
                    raise ConversionError(f"{info_path}: no dtype and shape for tid {tid} ({where})")
                made = _SplitLeaf(tensors / f"tensor_{tid}.pt", entry["dtype"],
                                  tuple(int(d) for d in entry["shape"]), io, checks)
                self._split.append(made)
                return made

            self.top = _walk(load_small(path), str(path), split_leaf)
        elif is_torch_zip(path):
            reader = self._zip = TorchZipReader(path, io=io, checks=checks)

            def zip_leaf(obj: Any, where: str) -> Leaf | None:
                if isinstance(obj, StoredTensor):
                    return _ZipLeaf(reader, obj)
                if isinstance(obj, PickledTensor):
                    return _ZipLeaf(reader, reader.locate(where, obj))
                return None

            self.top = _walk({k: reader.entry(k) for k in reader.keys()}, str(path), zip_leaf)
        else:
            raise ConversionError(f"{path}: not a torch zip file (torch.save of torch >= 1.6) nor xser-split")
        if not isinstance(self.top, dict):
            raise ConversionError(f"{path}: expected an optimizer state dict, got {type(self.top).__name__}")

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
        for leaf in self._split:
            leaf.close()

