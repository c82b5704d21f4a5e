"""The fp32 master weights in a training tag's ``optim/`` as its model weights, for ``to-hf``, ``reshard``,
``verify`` and ``inspect``: NxD's own (ZeRO-1 with ``use_master_weights_in_ckpt``, read through
:mod:`ckptconv.training.nxd_format.read`), and those an nxdtrain bf16 run keeps (``NxdCheckpoint.use_masters``).

A tag saved with ``avoid_saving_lower_precision_weights`` (xser) holds no model tensors at all: its
weights are the masters, and they are read from there without being asked. Where a tag holds both,
``to-hf`` takes the masters (``prefer``) and the other commands the shards unless ``--masters``; the
notes say which, since the masters are what training continues from.

    >>> ckpt = NxdCheckpoint("ckpt/step_2")                                            # doctest: +SKIP
    >>> notes = nxd_masters(ckpt, None, prefer=True, io="mmap", check=True)           # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ckptconv.core.layout import ParallelLayout
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.io.nxd_read import NxdCheckpoint, ShardsWithMasters
from ckptconv.training.nxd_format.read import OPTIM_DIR, NxdOptimizer
from ckptconv.training.nxdtrain_format.masters import use_masters
from ckptconv.training.nxdtrain_format.state import TagOptimizer, is_training_tag


class MasterShard:
    """One model shard's tensors served from the optimizer's masters (the executor's ``FileReader``)."""

    def __init__(self, optim: NxdOptimizer, file: str, model_keys: list[str]) -> None:
        self.optim = optim
        self.file = file
        shard = optim.model.shard_of.get(file)  # its ranks, as the model directory was read
        if shard is None or shard.ep != 0 or (shard.tp, shard.pp) not in optim.rank_ids():
            raise ConversionError(f"{optim.dir}: no optimizer state for the model shard {file}")
        self.tp, self.pp = shard.tp, shard.pp
        names = set(optim.names(self.tp, self.pp))
        missing = [k for k in model_keys if k not in names]
        if missing:
            raise ConversionError(f"{optim.dir}: no master for {missing[0]!r} of {file}; its weights exist only in "
                                  "the model file")
        self._keys = list(model_keys)

    def keys(self) -> list[str]:
        return self._keys

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        dtype, shape = self.optim.slot_info(self.tp, self.pp, key)
        return dtype, shape, False

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.optim.rows(self.tp, self.pp, key, "master", start, stop)
        rows = rows.reshape(stop - start, *rows.shape[1:]) if rows.dim() else rows.reshape(1)
        return rows if out is None else out.view(rows.shape).copy_(rows)

    def read(self, key: str) -> torch.Tensor:
        shape = self.info(key)[1]
        return self.read_rows(key, 0, shape[0] if shape else 1).reshape(shape)

    def close(self) -> None:
        pass  # the optimizer's files are closed with it


class MasterWeights:
    """An :class:`~ckptconv.io.nxd_read.WeightSource` over :class:`NxdOptimizer`'s masters, in place of the model
    files."""

    label = "NxD's master weights"

    def __init__(self, optim: NxdOptimizer) -> None:
        if not optim.has_masters:
            raise ConversionError(f"{optim.dir}: holds no master weights (NxD writes them only with ZeRO-1 and "
                                  "use_master_weights_in_ckpt)")
        self.optim = optim

    def shard(self, file: str) -> MasterShard:
        """A shard's weights from its rank's masters (that rank's files parsed now, if not yet), in the model
        file's key order (as declared: its header, not a read through this source)."""
        keys = [k for k in self.optim.model.declared(file) if not k.endswith("inv_freq")]
        return MasterShard(self.optim, file, keys)

    def finish_checks(self, *, workers: int = 8, only_read: bool = True) -> int:
        if not only_read:  # every master, read or not
            self.optim.open_masters()
        return self.optim.finish_checks(workers=workers, only_read=only_read)

    def close(self) -> None:
        self.optim.close()


def nxd_masters(ckpt: NxdCheckpoint, masters: bool | None, *, prefer: bool, io: str, check: bool,
                keep: bool = False, only: Collection[str] | None = None) -> list[str]:
    """Point ``ckpt`` at NxD's own masters in ``optim/`` when its model files hold no tensors, when asked
    (``masters``), or by default where ``prefer``; the notes say where the weights come from. Where
    ``optim/`` is not NxD's format, nothing changes (nxdtrain's own masters: :func:`nxdtrain_masters`).
    ``keep``: the NxD optimizer opened here stays open as ``ckpt.nxd_optimizer`` (closed with ``ckpt``) for a
    caller that reads it too (inspect's summary, a resume's optimizer state), which then need not parse it again.
    ``only``: the model files the caller reads (one training rank's): only their headers are opened, and only
    their optimizer ranks' files when read (the first of them speaks for the optimizer); the notes then name
    no dtypes (they would need every header)."""
    unsaved = ckpt.unsaved_tensors(only)
    total = sum(len(ckpt.keys(f)) for f in ckpt.files if only is None or f in only) if unsaved else 0
    if unsaved and len(unsaved) != total:
        raise ConversionError(f"{ckpt.model_dir}: {len(unsaved)} of {total} model tensors were not saved "
                              f"(first: {unsaved[0]}); an incomplete tag")
    if unsaved and masters is False:
        raise ConversionError(f"{ckpt.model_dir}: the model files hold no tensors ({unsaved[0]}): the weights exist "
                              f"only as the master weights in {OPTIM_DIR}/; drop --no-masters")
    if masters is False:
        return []
    ranks = sorted((s.tp, s.pp) for s in (ckpt.shard_of.get(f) for f in only or ()) if s is not None and s.ep == 0)
    optim = _nxd_optimizer(ckpt, io=io, check=check, needed=bool(unsaved), first=ranks[0] if ranks else None)
    if optim is None:
        return []

    def release() -> None:  # the weights stay the model files'
        if keep:
            ckpt.keep_nxd_optimizer(optim)
        else:
            optim.close()

    if not optim.has_masters:
        if unsaved or masters:
            optim.close()
            raise ConversionError(f"{optim.dir}: holds no master weights (NxD writes them only with ZeRO-1 and "
                                  "use_master_weights_in_ckpt)" + (f"; the model files hold no tensors ({unsaved[0]})"
                                                                  if unsaved else ""))
        release()
        return []
    dtype = optim.dtype_of_masters()
    if not (unsaved or masters or prefer):
        release()
        if only is not None:
            return [f"weights: the model files; {OPTIM_DIR}/ also holds {dtype} master weights"]
        model = sorted({str(d).removeprefix("torch.") for f in ckpt.files for d, _ in ckpt.declared(f).values()})
        return [f"weights: the model files ({', '.join(model)}); {OPTIM_DIR}/ also holds {dtype} master weights, the "
                "state training continues from: --masters reads those"]
    ckpt.read_weights_from(MasterWeights(optim))
    if keep:
        ckpt.keep_nxd_optimizer(optim)
    why = ("the model files hold no tensors: saved with avoid_saving_lower_precision_weights" if unsaved
           else "--masters" if masters else "present; --no-masters reads the model files")
    return [f"weights: the {dtype} master weights in {OPTIM_DIR}/ ({optim.format.value}, dp {optim.dp}; {why})"]


def _nxd_optimizer(ckpt: NxdCheckpoint, *, io: str, check: bool, needed: bool,
                   first: tuple[int, int] | None = None) -> NxdOptimizer | None:
    """NxD's optimizer of the tag, or None where there is none or ``optim/`` holds another format (nxdtrain's
    own tags); when ``needed`` (the masters are the only weights), why it could not be read."""
    if not (ckpt.root / OPTIM_DIR).is_dir():
        if needed:
            raise ConversionError(f"{ckpt.root}: the model files hold no tensors and there is no {OPTIM_DIR}/")
        return None
    if not needed and is_training_tag(ckpt.root):  # nxdtrain's own files: not parsed as NxD's to be refused
        return None
    optim = None
    try:
        optim = NxdOptimizer(ckpt, io=io, check=check, first=first)
        optim.format  # noqa: B018  (the first rank's files parsed now, the rest when read: not NxD's? told here)
        return optim
    except ValueError:  # ConversionError, UnsafeCheckpointError, a zip the reader refuses
        if optim is not None:
            optim.close()
        if needed:
            raise
        return None


def nxdtrain_masters(ckpt: NxdCheckpoint, masters: bool | None, *, prefer: bool, spec: ModelSpec,
                     layout: ParallelLayout) -> list[str]:
    """Point ``ckpt`` at the fp32 masters an nxdtrain bf16 run keeps in ``optim/`` when asked or preferred
    (after the shards were checked against ``ckptconv.json``, which records their dtype); they are found by
    parameter, whichever dp rank saved them (:func:`ckptconv.training.nxdtrain_format.masters.use_masters`)."""
    if ckpt.weight_source is not None or masters is False or not (masters or prefer):
        return []
    if use_masters(ckpt, spec, layout, required=bool(masters)) is None:
        return []
    why = "--masters" if masters else "--no-masters exports the shards"
    return [f"weights from the fp32 master weights in {ckpt.root}/{OPTIM_DIR}/ (nxdtrain, a bf16 run), not the "
            f"shards' bf16 copy; {why}"]


def nxdtrain_optimizer(ckpt: NxdCheckpoint) -> TagOptimizer | None:
    """The optimizer files of nxdtrain's tag that :func:`nxdtrain_masters` opened for the weights, else None: a
    caller reading the optimizer state too (reshard's and to-dcp's training tag) takes them rather than parsing
    every file again. Closed with ``ckpt`` (a second close is harmless; a read after it fails)."""
    source = ckpt.weight_source
    return source.owner if isinstance(source, ShardsWithMasters) else None
