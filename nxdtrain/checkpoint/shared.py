"""FSDP saves without a gather (``--shard-params``, ``--hybrid-shard N``): each file of a (tp, pp) shard written in
place by every dp rank of the shard group that holds it.

A tag holds whole per-tp-rank tensors; with FSDP each dp rank holds ``torch.chunk``'s rows (dim 0) of most of
them. torch.save's zip layout is a function of the tensors' dtypes and shapes (:func:`ckptconv.io.torchzip.plan_zip`),
so the owner (dp rank 0; with hybrid sharding, of the first replica) plans each file, creates and sizes it, and every
rank of its shard group writes its rows (a contiguous byte range of each row-major record) where they belong
(:func:`ckptconv.io.torch_save.write_share`); the others hand their extents' CRC-32s over, and the owner writes the
records' descriptors and the central directory (:meth:`ckptconv.io.torchzip.TorchZipWriter.add_extent_crc`) and the
file's digest, reading back only the other ranks' ranges (its own bytes are hashed from memory:
:class:`ckptconv.io.write_digest.WriteDigest`'s ``hold``). The exchange is :meth:`SharedSave.seal`, run by the thread
that wrote (an ``--async-save``'s background thread too) on a gloo group of its own, which no other thread uses
(``TagWriter.save_group``): the files are finished before the save's writes are, so before training may change the
memory they were written from (``TagWriter.fence``). Records not laid out by rows (column-major ``o_proj``) and
tensors every rank holds whole (AdamW's steps) are written whole by the owner, the former gathered first
(collectively, in the stall).

The bytes are a gathered save's (:meth:`nxdtrain.parallel.fsdp.Sharding.gathered`; compared in
tests/nxdtrain/checkpoint/test_shared_save.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ckptconv.core import OutTensor
from ckptconv.engine import file_records
from ckptconv.io import (
    DEFAULT,
    Extent,
    TensorMeta,
    TorchZipWriter,
    WriteDigests,
    ZipLayout,
    place,
    plan_object,
    plan_zip,
    recording,
    remove_path,
    transposed,
    write_share,
)
from ckptconv.training import MASTER, state_key
from nxdtrain.errors import TrainError

Part = tuple[str, int, torch.Tensor]  # (record key, byte offset in the record, the bytes: a contiguous CPU tensor)


@dataclass
class SharedFile:
    """One file of a tag written by a shard group: the owner's writer (None on the other ranks) and this rank's
    parts of it."""

    rel: str                  # its path, the same on every rank: how the ranks' CRCs find it
    final: Path
    partial: Path             # where it is written, renamed to ``final`` by the owner when finished
    layout: ZipLayout
    parts: list[Part]
    writer: TorchZipWriter | None = None

    def write(self) -> list[Extent]:
        """Write this rank's parts; the CRCs the owner needs (none from the owner: its writer recorded them)."""
        if self.writer is None:
            return write_share(self.partial, self.layout, self.parts)
        for key, offset, data in self.parts:
            self.writer.write_extent(key, offset, data)
        return []

    def finish(self, extents: list[Extent]) -> Path:
        """The owner: the other ranks' ``extents`` recorded, descriptors, central directory and digest, renamed."""
        assert self.writer is not None
        for extent in extents:
            self.writer.add_extent_crc(*extent)
        self.writer.finish()
        place(self.partial, self.final)
        if self.partial.parent != self.final.parent:  # a shard's own temporary directory (save_shard's naming)
            self.partial.parent.rmdir()
        return self.final


@dataclass
class SharedSave:
    """What one rank writes of a gather-free save, and (the owner) the digests of the files it creates."""

    group: Any = None         # the save group: the writing threads' exchange
    files: list[SharedFile] = field(default_factory=list)
    digests: WriteDigests | None = None
    dtype: str = ""           # the shard's dtype as ckptconv.json records it

    def seal(self, extents: dict[str, list[Extent]], error: str | None, tag: Path) -> dict[str, dict[str, Any]]:
        """Every rank's CRC-32s (by file) to every rank, then the owner finishes its files: their ckptconv.json
        records. Collective over the save group (every rank's writing thread, ``error`` or not: a rank that failed
        to write makes every rank raise, and none finishes a file)."""
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (extents, error), group=self.group)
        errors = [e for _, e in gathered if e is not None]
        if errors:
            self.close()
            raise TrainError(errors[0])
        merged: dict[str, list[Extent]] = {}
        for shares, _ in gathered:
            for rel, crcs in shares.items():
                merged.setdefault(rel, []).extend(crcs)
        owned = [f for f in self.files if f.writer is not None]
        # each file's digest is one thread's sequential hash: the files on threads of their own (the other ranks
        # wait here, so the host's cores are free)
        with ThreadPoolExecutor(max(1, len(owned)), thread_name_prefix="seal") as pool:
            written = list(pool.map(lambda f: f.finish(merged.get(f.rel, [])), owned))
        return file_records(written, tag, self.digests)

    def close(self) -> None:
        """Release the owner's files after a failure (the tag stays without markers)."""
        for f in self.files:
            if f.writer is not None:
                f.writer.close()


def build(shard: Path, optim: Path, model: Any, optimizer: Any, sharding: Any, *, owner: bool, writes: bool,
          group: Any, to_host: Callable[[Any], Any]) -> SharedSave:
    """This rank's share of the shard at ``shard`` and the optimizer file at ``optim``: ``writes`` (a rank of the
    writing replica) its rows, ``owner`` the files created and sized and what it writes whole. Collective (every rank
    gathers the column-major records, in the same order); ``to_host``: how a part reaches the host (a copy, for
    an asynchronous save of device state); ``group``: the save group (:meth:`SharedSave.seal`)."""
    weights = model.state_dict()
    # the owner's own parts are hashed from memory at the seal, which comes before the fence
    save = SharedSave(group, digests=WriteDigests(DEFAULT, hold=True) if owner else None)
    bf16 = sharding.bf16
    metas: dict[str, TensorMeta] = {}
    parts: list[Part] = []
    for record in model.file_records():
        t = weights[record.key].detach()
        if isinstance(t, DTensor) and record.column_major:
            t = t.full_tensor()  # collective over the mesh: strided by rows in the file
        local = t.to_local() if isinstance(t, DTensor) else t
        if bf16 and local.is_floating_point():
            local = local.to(torch.bfloat16)
        meta = TensorMeta(local.dtype, tuple(t.shape), OutTensor(record.key, local.dtype, tuple(t.shape), 0, (),
                                                                  column_major=record.column_major).stride)
        metas[record.key] = meta
        part = _part(record.key, t, local, sharding, meta, owner=owner, writes=writes)
        if part is not None:
            parts.append(part)
    first = next(iter(weights.values()), None)  # as a gathered save's rank 0 records it
    if first is not None:
        save.dtype = str(torch.bfloat16 if bf16 and first.is_floating_point() else first.dtype).removeprefix("torch.")
    if writes:
        name = shard.name
        save.files.append(_shared(str(shard), shard, shard.parent / f".{name}.partial" / name, metas, parts, save,
                                  to_host))
        state = optimizer.state_dict()
        if bf16:  # the tag holds the fp32 masters (FSDP's sharded parameters) beside the bf16 weights
            state.update({state_key(n, MASTER): weights[n].detach() for n in optimizer.names})
        save.files.append(_optimizer_file(optim, state, sharding, owner=owner, save=save, to_host=to_host))
    return save


def _part(key: str, t: torch.Tensor, local: torch.Tensor, sharding: Any, meta: TensorMeta, *, owner: bool,
          writes: bool) -> Part | None:
    """What this rank writes of one record: its rows of a DTensor (``writes``), or the whole of it (``owner``)."""
    row_major = meta.stride == TensorMeta.contiguous(meta.dtype, meta.shape).stride
    if isinstance(t, DTensor) and row_major:
        if not writes:
            return None
        start, stop = sharding.rows(t.shape[0])
        assert local.shape[0] == stop - start, (key, tuple(t.shape), tuple(local.shape), start, stop)
        row_bytes = math.prod(t.shape[1:]) * meta.dtype.itemsize
        return key, start * row_bytes, local.contiguous().reshape(-1)
    if not owner:
        return None
    whole = local.contiguous() if row_major else transposed(local)
    return key, 0, whole.reshape(-1)


def _optimizer_file(path: Path, state: dict[str, Any], sharding: Any, *, owner: bool, save: SharedSave,
                    to_host: Callable[[Any], Any]) -> SharedFile:
    """The optimizer file: its DTensors stand in by meta tensors of their whole shape for the plan (the pickle is the
    gathered state's), their rows written by each rank; every other tensor written whole by the owner."""
    locals_: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def stand_in(value: Any) -> Any:
        if isinstance(value, DTensor):
            meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
            locals_[id(meta)] = (value, value.to_local().detach())
            return meta
        if isinstance(value, dict):
            return type(value)((k, stand_in(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(stand_in(v) for v in value)
        return value

    partial = path.with_name(f".{path.name}.partial")  # save_torch's temporary name (the zip's archive name)
    planned = plan_object(stand_in(state))
    assert planned is not None, f"{path}: the optimizer state is not one torch.save writes as planned"
    entries, tensors = planned
    parts: list[Part] = []
    for key, tensor in tensors.items():
        if id(tensor) in locals_:
            value, local = locals_[id(tensor)]
            meta = TensorMeta.of(tensor)
            part = _part(key, value, local, sharding, meta, owner=owner, writes=True)
        else:
            part = (key, 0, tensor.detach().reshape(-1)) if owner else None
        if part is not None:
            parts.append(part)
    return _shared(str(path), path, partial, entries, parts, save, to_host)


def _shared(rel: str, final: Path, partial: Path, entries: Any, parts: list[Part], save: SharedSave,
            to_host: Callable[[Any], Any]) -> SharedFile:
    """A SharedFile; the owner (``save.digests``) creates it, sized, at ``partial`` (cleared first)."""
    layout = plan_zip(partial, entries)
    shared = SharedFile(rel, final, partial, layout, [(k, o, to_host(t)) for k, o, t in parts])
    if save.digests is not None:
        if os.path.lexists(partial):  # an interrupted earlier try of this save
            remove_path(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
        with recording(save.digests):
            shared.writer = TorchZipWriter(partial, layout)
    return shared
