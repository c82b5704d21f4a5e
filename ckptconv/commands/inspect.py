"""``ckptconv inspect``: what a directory holds (HF, NxD or DCP), its layout, dtypes, sizes, completeness."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ckptconv.commands.inspect_dcp import inspect_dcp, is_dcp, model_summary
from ckptconv.core.mapping import stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.engine.finalize import refuse_unfinished
from ckptconv.errors import AmbiguousLayout, ConversionError, IntegrityError
from ckptconv.io.hf import HfCheckpoint
from ckptconv.io.metadata import METADATA_FILE, read_metadata
from ckptconv.io.quantized import describe
from ckptconv.io.safetensors_io import TruncatedSafetensorsError
from ckptconv.io.tags import DONE_MARKER
from ckptconv.sources.hub import resolve_hf
from ckptconv.training.nxd_format.read import OPTIM_DIR, nxd_optimizer_summary
from ckptconv.training.nxdtrain_format.masters import nxdtrain_optimizer_summary


def inspect(path: str | Path, *, config: str | Path | None = None, revision: str | None = None,
            check: bool = True, masters: bool | None = None) -> dict[str, Any]:
    """Describe an HF, NxD or DCP checkpoint (or hub id ``org/name``); for NxD, also check that its files are intact.

    A DCP directory or a TorchTitan checkpoint root: its steps and the newest complete one, what the step holds
    (model, optimizer, lr_scheduler, train_state, dataloader), the model (:mod:`ckptconv.commands.inspect_dcp`).

    With ``check`` (the default) every NxD shard is read once: its size and digest against
    ``ckptconv.json`` and every torch zip record's CRC-32; a mismatch raises IntegrityError naming
    the file, so ``complete`` is never reported for damaged shards. ``check=False``
    (``--no-check``) reads headers only and compares sizes. HF checkpoints: headers only.

    An NxD training tag also reports ``weights_from`` (its model files, or the fp32 masters in
    ``optim/``: ``masters=True``, or an NxD tag whose model files hold no tensors) and ``optimizer``
    (what :class:`ckptconv.training.nxd_format.read.NxdOptimizer` reads there, or why it could not).

    Example:
        >>> inspect("llama-nxd")["layout"]["tp"]     # doctest: +SKIP
        2
    """
    path = resolve_hf(path, revision=revision, flag="PATH")
    if not path.exists():
        raise ConversionError(f"{path}: no such file or directory")
    refuse_unfinished(path)  # neither NxD nor HF yet: the conversion that writes it was interrupted
    if is_dcp(path):
        return inspect_dcp(path, config, check)
    try:
        return _inspect_nxd(path, config, check, masters)
    except IntegrityError:
        raise  # NxD shards that fail their checks: say so, not "neither NxD nor HF"
    except ConversionError as nxd_error:
        try:
            return _inspect_hf(path, config)
        except TruncatedSafetensorsError as cut:  # what inspect is for: say what is wrong with the files
            return {"kind": "hf", "path": str(path), "complete": False, "problems": [str(cut)]}
        except ConversionError as hf_error:
            raise ConversionError(f"{path}: neither NxD ({nxd_error}) nor HF ({hf_error})") from None


def _inspect_hf(path: Path, config: str | Path | None) -> dict[str, Any]:
    with HfCheckpoint(path, config=config) as hf:
        shapes, dtypes = hf.shapes(), hf.dtypes()
        params = sum(_numel(s) for s in shapes.values())
        nbytes = sum(_numel(shapes[k]) * dtypes[k].itemsize for k in shapes)
        files = [p.name for p in hf.weight_files()]
        spec = hf.spec
        quantized = _quantization(hf)
    return {
        "kind": "hf",
        "path": str(path),
        "model": model_summary(spec),
        "tensors": len(shapes),
        "parameters": params,
        "bytes": nbytes,
        "dtypes": dict(Counter(str(d).removeprefix("torch.") for d in dtypes.values())),
        "files": files,
        "complete": True,
        "metadata": (path / METADATA_FILE).is_file() if path.is_dir() else False,
        **quantized,
    }


def _quantization(hf: HfCheckpoint) -> dict[str, Any]:
    """What inspect says of quantized weights (read dequantized: ``dtypes`` and ``bytes`` count them so)."""
    if not hf.quantized.tensors:
        return {}
    return {"quantization": f"{describe(hf.spec.config)}: {len(hf.quantized.tensors)} weights, read as "
                            f"{str(hf.quantized.dtype).removeprefix('torch.')}",
            "quantized_tensors": sorted(hf.quantized.tensors)}  # which weights are stored quantized (MXFP4, FP8)


def _inspect_nxd(path: Path, config: str | Path | None, check: bool, masters: bool | None) -> dict[str, Any]:
    from ckptconv.sources.nxd import open_nxd

    try:
        opened = open_nxd(path, config=config, check=check, masters=masters, keep_nxd_optimizer=True)
        undecided = None
    except AmbiguousLayout as exc:  # describe what is known; the layout's hardware stays open
        opened = open_nxd(path, config=config, check=check, hints={"hw": "trn1"}, masters=masters,
                          keep_nxd_optimizer=True)
        undecided = str(exc)
    ckpt, spec, layout, notes = opened.ckpt, opened.spec, opened.layout, opened.notes
    if undecided is not None:
        notes = [n for n in notes if "trn1" not in n] + [f"hw undecided: {undecided}"]  # trn1 was only a stand-in
    with ckpt:
        dtypes: Counter[str] = Counter()
        nbytes = 0
        for file in ckpt.files:
            for key in ckpt.keys(file):
                dtype, shape, _ = ckpt.info(Source(file, key))
                dtypes[str(dtype).removeprefix("torch.")] += 1
                nbytes += _numel(shape) * dtype.itemsize
        checked = ckpt.checks.finish(only_read=False) if check else 0  # every shard opened above: read them whole
        source = ckpt.weight_source
        if check and source is not None:
            checked += source.finish_checks(only_read=False)
        # NxD's optimizer, already read for the weights' notes, or nxdtrain's (else why NxD's could not be read)
        optimizer = (nxd_optimizer_summary(ckpt, check) if ckpt.nxd_optimizer is not None
                     else nxdtrain_optimizer_summary(ckpt, spec, layout) or nxd_optimizer_summary(ckpt, check))
        meta = read_metadata(ckpt.root)
        complete, problems = _completeness(ckpt.root, meta, ckpt.found_as)
        return {
            "kind": "nxd",
            "path": str(path),
            "root": str(ckpt.root),
            "found_as": ckpt.found_as,
            "model": model_summary(spec),
            "layout": {**layout.to_json(), **({"hw": "trn1|trn2-official", "trn2_kv_layout": None} if undecided else {})},
            "lm_head": _lm_head_form(spec, ckpt.keys(ckpt.file_of(tp_rank=0, pp_rank=layout.pp - 1))),
            "flavour": ckpt.flavour.value,
            "shards": len(ckpt.files),
            "bytes": nbytes,
            "dtypes": dict(dtypes),
            "metadata": meta is not None,
            "complete": complete,
            "problems": problems,
            "checked_files": checked,
            "weights_from": f"{OPTIM_DIR}/ ({source.label})" if source is not None else "model files",
            "optimizer": optimizer,
            "notes": notes,
        }


def _completeness(root: Path, meta: Any, found_as: str) -> tuple[bool, list[str]]:
    """Sizes against ckptconv.json (cheap; ``verify --files`` checks hashes) and the done marker."""
    problems = []
    if meta is not None:
        for rel, rec in meta.files.items():
            file = root / rel
            if not file.is_file():
                problems.append(f"missing {rel}")
            elif file.stat().st_size != rec["size"]:
                problems.append(f"{rel}: size {file.stat().st_size}, recorded {rec['size']}")
    if found_as == "tag" and not (root / DONE_MARKER).is_file():
        problems.append(f"no '{DONE_MARKER}' marker")
    return not problems, problems


def _lm_head_form(spec: ModelSpec, last_stage_keys: list[str]) -> str:
    """How the output projection is stored: its own weights, or a tied model's two valid forms."""
    if not spec.tied:
        return "lm_head.weight"
    if stores_lm_head(spec, last_stage_keys):
        return "tied: lm_head.weight is a copy of the embedding"
    return "tied: no lm_head.weight (the official converter's form); the embedding is the output projection"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
