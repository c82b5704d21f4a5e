"""Writing NxD shards: the executor's sinks for each serialization flavour, one rank's shard written from memory,
and a tag's markers.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.families.moe import NXD_DOWN, NXD_GATE_UP
from ckptconv.core.plan import NESTED_TORCH, OutFile, OutTensor, Piece, Source
from ckptconv.io.atomic import move_into_place
from ckptconv.io.nxd import INFO_SUFFIX, TENSORS_SUFFIX, Flavour
from ckptconv.io.safe_load import TensorReference
from ckptconv.io.torchzip import TensorMeta, TorchZipWriter, plan_zip, save_state_dict
from ckptconv.io.torchzip_pickle import map_tensor_at
from ckptconv.io.transpose import transposed

BARE_TENSOR_KEY = ""  # how the torch zip layer names the one tensor of a torch.save(tensor) file


class TorchZipSink:
    """One shard as a torch.save zip, filled by extents; optionally with the empty xser dir."""

    def __init__(self, out_file: OutFile, tmp: Path, *, empty_tensors_dir: bool = False) -> None:
        self.path = tmp / out_file.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        metas: dict[str, Any] = dict(out_file.plain)
        if out_file.format != NESTED_TORCH:  # nested: the tensors are placed inside ``plain`` already
            metas.update({t.key: TensorMeta(t.dtype, t.shape, t.stride) for t in out_file.tensors})
        self._writer = TorchZipWriter(self.path, plan_zip(self.path, metas))
        self._empty_dir = Path(str(self.path) + TENSORS_SUFFIX) if empty_tensors_dir else None

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None:
        self._writer.write_extent(key, offset, data)  # thread-safe: positional writes, locked bookkeeping

    def file_offset(self, key: str, offset: int) -> int:
        return self._writer.file_offset(key, offset)

    def claim(self, key: str, offset: int, nbytes: int) -> Callable[[], None]:
        return self._writer.claim(key, offset, nbytes)

    def finish(self) -> list[Path]:
        self._writer.finish()
        paths = [self.path]
        if self._empty_dir is not None:
            self._empty_dir.mkdir(exist_ok=True)
            paths.append(self._empty_dir)
        return paths


class XserSplitSink:
    """NxD training's layout: refs file, ``.info.pt`` and one torch file per tensor. A NESTED_TORCH file (NxD's
    optimizer state) keeps its structure, each TensorAt a TensorReference numbered depth-first, as NxD's xser
    save numbers them."""

    def __init__(self, out_file: OutFile, tmp: Path, *, ep: int = 1) -> None:
        self.path = tmp / out_file.path
        self.ep = ep  # the layout's expert-parallel degree (expert_parallel_keys)
        self.tensor_dir = Path(str(self.path) + TENSORS_SUFFIX)
        self.tensor_dir.mkdir(parents=True, exist_ok=True)
        self.out_file = out_file
        if out_file.format == NESTED_TORCH:
            order: list[str] = []
            map_tensor_at(dict(out_file.plain), lambda t: order.append(t.key))
        else:
            order = [t.key for t in out_file.tensors]
        self.tid = {key: tid for tid, key in enumerate(order)}
        self._writers: dict[str, TorchZipWriter] = {}
        for t in out_file.tensors:
            file = self.tensor_dir / f"tensor_{self.tid[t.key]}.pt"
            meta = TensorMeta(t.dtype, t.shape, TensorMeta.contiguous(t.dtype, t.shape).stride)
            self._writers[t.key] = TorchZipWriter(file, plan_zip(file, meta))
        self._column_major = {t.key for t in out_file.tensors if t.column_major}

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None:
        if key in self._column_major:  # per-tensor files are contiguous: store rows, not columns
            data = transposed(data)
        self._writers[key].write_extent(BARE_TENSOR_KEY, offset, data)

    def file_offset(self, key: str, offset: int) -> int:
        return self._writers[key].file_offset(BARE_TENSOR_KEY, offset)

    def claim(self, key: str, offset: int, nbytes: int) -> Callable[[], None]:
        return self._writers[key].claim(BARE_TENSOR_KEY, offset, nbytes)

    def finish(self) -> list[Path]:
        for writer in self._writers.values():
            writer.finish()
        refs: dict[str, Any]
        if self.out_file.format == NESTED_TORCH:
            refs = map_tensor_at(dict(self.out_file.plain), lambda t: TensorReference(self.tid[t.key]))
        else:
            refs = {t.key: TensorReference(self.tid[t.key]) for t in self.out_file.tensors}
        by_tid = sorted(self.out_file.tensors, key=lambda t: self.tid[t.key])
        experts = expert_parallel_keys(self.out_file, self.ep)
        info = {self.tid[t.key]: {"dtype": t.dtype, "shape": torch.Size(t.shape),
                                  "expert_model_parallel": t.key in experts} for t in by_tid}
        info_path = Path(str(self.path) + INFO_SUFFIX)
        torch.save(info, info_path)  # plain data
        save_state_dict(self.path, refs)  # our writer names TensorReference without importing torch_xla
        return [self.tensor_dir, info_path, self.path]


def expert_parallel_keys(out_file: OutFile, ep: int) -> frozenset[str]:
    """The keys NxD's xser save marks ``expert_model_parallel`` in ``out_file``'s ``.info.pt``: the stacked expert
    weights (``ExpertFusedLinear._mark_expert_parallel_weights``), marked only when the layout's ``ep`` > 1, in a
    model shard (optimizer files carry no marks). NxD's loader reads a marked tensor from the file's own ep rank,
    the rest from ep rank 0's."""
    if ep == 1:
        return frozenset()
    return frozenset(t.key for t in out_file.tensors if t.key.endswith((NXD_GATE_UP, NXD_DOWN)))


def sink_factory(flavour: Flavour, *, ep: int = 1):  # type: ignore[no-untyped-def]
    """The executor's sink factory for NxD shards of ``flavour``, of a layout of expert-parallel degree ``ep``."""
    flavour = Flavour(flavour)

    def make(out_file: OutFile, tmp: Path):  # type: ignore[no-untyped-def]
        if flavour is Flavour.XSER_SPLIT:
            return XserSplitSink(out_file, tmp, ep=ep)
        return TorchZipSink(out_file, tmp, empty_tensors_dir=flavour is Flavour.XSER_INLINE)

    return make


# --------------------------------------------------------------------------------------------
# Whole shards in memory (training saves and loads one rank's state at a time)


def save_shard(path: Path, state: Mapping[str, torch.Tensor], flavour: Flavour | str = Flavour.PLAIN, *,
               column_major: Collection[str] | None = None, ep: int = 1) -> list[Path]:
    """Write one rank's shard from memory, byte-identical to ``torch.save`` for ``plain``.

    Tensors may live on any device: each is copied to the CPU only when it is written, one at a
    time. ``column_major``: the keys stored column-major; by default read from each tensor's
    strides (an XLA tensor reports contiguous strides whatever its layout, so its caller says). ``ep``: the
    layout's expert-parallel degree (xser marks the expert weights when > 1: :func:`expert_parallel_keys`).
    Written under a temp directory beside ``path`` with the final basename (torch.save output
    depends on it) and renamed into place, the main ``.pt`` last. Returns the paths written.
    """
    path = Path(path)
    flavour = Flavour(flavour)

    def is_column_major(key: str, t: torch.Tensor) -> bool:
        if column_major is not None:
            return key in column_major
        return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride() == (1, t.shape[0])

    out_file = OutFile(
        path.name, "torch",
        tuple(
            OutTensor(k, t.dtype, tuple(t.shape), 0, (Piece(Source(None, k), 0, t.shape[0] if t.dim() else 1),),
                      column_major=is_column_major(k, t))
            for k, t in state.items()
        ),
    )
    tmp = path.parent / f".{path.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    sink = sink_factory(flavour, ep=ep)(out_file, tmp)
    for t_out in out_file.tensors:
        t = _own_storage(state[t_out.key])
        data = transposed(t) if t_out.column_major else t.contiguous()
        sink.write_extent(t_out.key, 0, data.reshape(()) if t.dim() == 0 else data)
        del t, data
    written = move_into_place(sink, tmp, path.parent)
    tmp.rmdir()
    return written


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its storage (a view would serialize its whole parent)."""
    t = t.detach().cpu()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    if not (t.is_contiguous() or (t.dim() == 2 and t.stride() == (1, t.shape[0]))):
        t = t.contiguous()
    return t


__all__ = ["TorchZipSink", "XserSplitSink", "save_shard", "sink_factory"]
