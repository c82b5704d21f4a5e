"""Open NxD shards as a conversion source: model spec and layout (recorded or inferred), shards checked.

Every command that reads NxD shards (``to-hf``, ``reshard``, ``verify``, ``inspect``, ``nxd-compat``,
nxdtrain's resume) opens them through :func:`open_nxd`, so a shard set is understood and refused
the same way everywhere.

Example:
    >>> opened = open_nxd("llama-nxd")                                      # doctest: +SKIP
    >>> with opened.ckpt:                                                   # doctest: +SKIP
    ...     opened.layout.tp, opened.spec.hidden, opened.notes[0]
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptconv.core.heads import ShardRecord
from ckptconv.core.layout import HF_FILES_DIR, ParallelLayout, layout_shard_file
from ckptconv.core.layout_flags import OVERRIDE_FLAG, LayoutOverrides, apply_to_record, as_hints
from ckptconv.core.mapping import all_ep_shard_records, hf_record_shape, hf_shapes, stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.engine.finalize import refuse_unfinished
from ckptconv.errors import ConversionError
from ckptconv.io.hf import CONFIG
from ckptconv.io.metadata import METADATA_FILE
from ckptconv.io.nxd_read import NxdCheckpoint
from ckptconv.sources.masters import nxd_masters, nxdtrain_masters


def model_spec_of(root: Path, meta: Any, config: str | Path | None, *, missing: str) -> ModelSpec:
    """The model of a checkpoint directory we read: ``--config`` if given, else the HF config its
    ``ckptconv.json`` records, else its ``hf/config.json``; else an error ``ROOT: <missing>``."""
    if config is not None:
        return ModelSpec.from_file(config)
    if meta is not None and meta.hf_config:
        return ModelSpec.from_config(meta.hf_config, source=str(root / METADATA_FILE))
    if (root / HF_FILES_DIR / CONFIG).is_file():
        return ModelSpec.from_file(root / HF_FILES_DIR / CONFIG)
    raise ConversionError(f"{root}: {missing}")


@dataclass(frozen=True)
class OpenedNxd:
    """NxD shards opened by :func:`open_nxd`: the checkpoint (open until ``ckpt.close()``) and what it was
    understood to hold."""

    ckpt: NxdCheckpoint  # the shards, opened lazily, reads checked unless check=False
    spec: ModelSpec  # the model (--config, ckptconv.json's HF config, or hf/config.json)
    layout: ParallelLayout  # as ckptconv.json records it, else inferred from the shards; with_inv_freq as read
    notes: list[str]  # how the checkpoint was read and understood, one line each, for the report

    @property
    def with_inv_freq(self) -> bool:
        """Whether the shards hold rotary_emb.inv_freq (the layout read says it)."""
        return self.layout.with_inv_freq


def open_nxd(
    src: str | Path,
    *,
    config: str | Path | None = None,
    hints: dict[str, Any] | None = None,
    io: str = "mmap",
    check: bool = True,
    masters: bool | None = None,
    prefer_masters: bool = False,
    keep_nxd_optimizer: bool = False,
    stages_only: bool = False,
) -> OpenedNxd:
    """Open NxD shards with their model spec and layout, from metadata or inferred (with notes).

    ``hints`` are the layout flags the user gave (``None``: not given; a
    :class:`ckptconv.core.layout_flags.LayoutOverrides` also says how to name them and whether they may
    override): what ``ckptconv.json`` records wins, and a given value that contradicts it is refused.

    ``masters`` (the fp32 master weights in a training tag's ``optim/``, see :mod:`ckptconv.sources.masters`):
    True reads them (an error where there are none), False the shards; None the shards, or the
    masters where ``prefer_masters`` and they exist. An NxD tag whose model files hold no tensors
    (``avoid_saving_lower_precision_weights``) is read from its masters unless ``masters`` is False.
    ``keep_nxd_optimizer``: NxD's optimizer, once opened for that, stays open as ``ckpt.nxd_optimizer``.

    With ``check`` (the default) reads are checked (see :class:`ckptconv.io.checked.CheckedFiles`):
    sizes at once, digests and zip CRC-32s as data is read; call ``ckpt.finish_checks()`` before
    trusting what was read.

    ``stages_only`` (one ``--part`` of a conversion): of the model files, only one per pp stage
    (``ckpt.stage_files()``) has its header opened and checked here, and the K/V replica order is not read; the
    caller checks the files it reads with :func:`check_files_read`. Without it every file is checked.
    """
    refuse_unfinished(src)  # an interrupted conversion's OUT: rerun it, rather than hear of files missing
    ckpt = NxdCheckpoint(src, io=io, check=check)
    try:
        # NxD's masters before the checks (a masters-only tag has nothing else to check), nxdtrain's after
        # (ckptconv.json records the shards' dtype, not the masters')
        checked = ckpt.stage_files() if stages_only else sorted(ckpt.files)
        weights = nxd_masters(ckpt, masters, prefer=prefer_masters, io=io, check=check, keep=keep_nxd_optimizer,
                              only=checked if stages_only else None)
        spec, layout, notes = _understand(ckpt, config, as_hints(hints), checked)
        notes[1:1] = weights
        notes += nxdtrain_masters(ckpt, masters, prefer=prefer_masters, spec=spec, layout=layout)
    except BaseException:
        ckpt.close()  # refused: no file stays open
        raise
    return OpenedNxd(ckpt, spec, layout, notes)


def _understand(ckpt: NxdCheckpoint, config: str | Path | None, hints: LayoutOverrides,
                files: list[str]) -> tuple[ModelSpec, ParallelLayout, list[str]]:
    """``files``: the model files checked (every file, or one per stage: open_nxd's ``stages_only``). The layout
    returned carries whether the shards hold inv_freq (as recorded, else as the first file holds)."""
    from ckptconv.sources.infer import check_replica_order, infer_layout

    notes = [f"reading {ckpt.root} ({ckpt.found_as}, {ckpt.flavour.value})"]
    meta = ckpt.metadata
    spec = model_spec_of(ckpt.root, meta, config,
                         missing=f"no {METADATA_FILE} and no {HF_FILES_DIR}/{CONFIG}; pass --config PATH/config.json")
    spec.check_counts((k for f in files for k in ckpt.keys(f)), _spec_source(ckpt, config, meta))
    if meta is not None and meta.layout is not None:
        where = str(ckpt.root / METADATA_FILE)
        recorded, overridden = apply_to_record(meta.layout, hints, where)
        layout = replace(ParallelLayout.from_json(recorded), with_inv_freq=meta.with_inv_freq)
        notes.append(f"layout from {METADATA_FILE}")
        notes.extend(overridden)
        if len(files) == len(ckpt.files):  # it reads a K head of every tp rank; a part's replica groups check
            check_replica_order(ckpt, spec, layout, f"{where} and {OVERRIDE_FLAG}" if overridden else where)
    else:
        layout, inferred = infer_layout(ckpt, spec, hints)
        layout = replace(layout, with_inv_freq=any(k.endswith("inv_freq") for k in ckpt.keys(sorted(ckpt.files)[0])))
        notes.extend(f"inferred {n}" for n in inferred)
    if (layout.tp, layout.pp, layout.ep) != (ckpt.tp, ckpt.pp, ckpt.ep):
        ep = ckpt.ep > 1 or layout.ep > 1  # a dense model's message names no ep

        def grid(tp: int, pp: int, ep_size: int) -> str:
            return f"tp {tp} x pp {pp}" + (f" x ep {ep_size}" if ep else "")

        raise ConversionError(f"{ckpt.model_dir}: holds {grid(ckpt.tp, ckpt.pp, ckpt.ep)} shards, but the layout says "
                              f"{grid(layout.tp, layout.pp, layout.ep)}")
    check_shards(ckpt, spec, layout, recorded_dtype=meta.dtype if meta is not None else None,
                 files=files)
    return spec, layout, notes


def check_files_read(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout, files: Collection[str]) -> None:
    """What :func:`open_nxd` with ``stages_only`` left unchecked of the model files a part reads: their keys and
    shapes (:func:`check_shards`), and that they declare their stage's keys and dtypes (``check_stages``)."""
    meta = ckpt.metadata
    check_shards(ckpt, spec, layout, recorded_dtype=meta.dtype if meta is not None else None,
                 files=files)
    ckpt.check_stages(files)


def _spec_source(ckpt: NxdCheckpoint, config: str | Path | None, meta: Any) -> str:
    if config is not None:
        return str(config)
    return str(ckpt.root / (METADATA_FILE if meta is not None and meta.hf_config else f"{HF_FILES_DIR}/{CONFIG}"))


def check_shards(ckpt: NxdCheckpoint, spec: ModelSpec, layout: ParallelLayout, *,
                 recorded_dtype: str | None = None, files: Collection[str] | None = None) -> None:
    """Every shard holds exactly the keys and shapes the layout implies (else: reshard hint), in the
    dtype ckptconv.json records when it records one.

    A tied model's last stage may hold ``lm_head.weight`` (ours) or not (the official converter's);
    its tp-0 shard decides which, and every other last-stage shard must agree. ``files``: only these (default all).
    """
    allowed = set(recorded_dtype.split(",")) if recorded_dtype else None
    shapes = hf_shapes(spec, with_inv_freq=layout.with_inv_freq)
    lm_head_copy = stores_lm_head(spec, ckpt.keys(layout_shard_file(layout, ep_rank=0, tp_rank=0, pp_rank=layout.pp - 1)))
    records_of = all_ep_shard_records(spec, layout, lm_head_copy=lm_head_copy)
    for (ep, tp, pp), records in records_of.items():
        file = layout_shard_file(layout, ep_rank=ep, tp_rank=tp, pp_rank=pp)
        if files is not None and file not in files:
            continue
        present = set(ckpt.keys(file))
        # read from NxD's masters: ckptconv.json's dtype is the model files' (an NxD-format tag written here)
        declared = ckpt.declared(file) if allowed and ckpt.weight_source is not None else None
        for record in records:
            if record.key not in present:
                raise ConversionError(
                    f"{ckpt.files[file]}: missing {record.key!r} expected by layout "
                    f"{_describe(layout)}; shards of another layout must be converted with matching flags or resharded"
                )
            expected = hf_record_shape(record, shapes[record.segments[0].hf_key])
            dtype, actual, _ = ckpt.info(Source(file, record.key))
            name = str(declared[record.key][0] if declared else dtype).removeprefix("torch.")
            if allowed and name not in allowed and not record.key.endswith("inv_freq"):
                raise ConversionError(f"{ckpt.files[file]}: {record.key!r} is {name}, "
                                      f"{ckpt.root / METADATA_FILE} records {recorded_dtype}")
            if tuple(actual) != expected:
                raise ConversionError(
                    f"{ckpt.files[file]}: {record.key!r} has shape {list(actual)}, layout {_describe(layout)} "
                    f"implies {list(expected)}{_transposed_hint(record, tuple(actual), expected)}"
                )
        extra = present - {r.key for r in records}
        if extra:
            raise ConversionError(f"{ckpt.files[file]}: unexpected key {sorted(extra)[0]!r} for layout {_describe(layout)}")


def _describe(layout: ParallelLayout) -> str:
    return (f"tp {layout.tp}" + (f" ep {layout.ep}" if layout.ep > 1 else "") + f" pp {layout.pp} vpp {layout.vpp} "
            f"kvm {layout.kvm} {layout.attention.value}" + (" fused" if layout.fuse_qkv else "") + f" {layout.hw.value}")


def _transposed_hint(record: ShardRecord, actual: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """What a stack of experts with its last two dims swapped is: HF's ``[out, in]`` stacked untransposed (the
    official Mixtral converter's defect, docs/nxd-format.md "MoE layers")."""
    if record.slabs and len(actual) == 3 and actual == (expected[0], expected[2], expected[1]):
        return ": the experts are stored transposed (HF's [out, in] stacked instead of NxD's [in, out])"
    return ""
