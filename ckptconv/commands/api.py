"""The Python API: ``to_nxd``, ``to_hf``, ``reshard``, ``inspect``. The CLI is a thin layer over it.

Example:
    >>> import ckptconv
    >>> ckptconv.to_nxd("llama-hf", "llama-nxd", tp=8, pp=2, attention="qkv_linear",
    ...                 kv_size_multiplier=1, fuse_qkv=True)        # doctest: +SKIP
    >>> ckptconv.to_hf("llama-nxd", "llama-hf-again")               # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.layout import (
    HF_FILES_DIR,
    Attention,
    Hardware,
    ParallelLayout,
    Trn2KvLayout,
    default_kvm,
    shard_file,
)
from ckptconv.core.mapping import check_source_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import NESTED_TORCH, Plan, cast_floats_to, keep_dtype, plan_reshard, plan_to_hf, plan_to_nxd
from ckptconv.engine import outdir
from ckptconv.engine.execute import ExecOptions, run_plan
from ckptconv.engine.finalize import (
    FinalizeSpec,
    assign_files,
    pending_fingerprint,
    record_part,
    state_name,
    try_finalize,
    write_spec,
)
from ckptconv.engine.options import DTYPES as DTYPE_NAMES
from ckptconv.engine.options import RunOptions  # also reached as ckptconv.commands.api.RunOptions
from ckptconv.engine.progress import byte_progress, note
from ckptconv.errors import ConversionError, VerificationError, choice
from ckptconv.io.digest import FileRecord
from ckptconv.io.hf import CONFIG, HfCheckpoint, config_text, has_tokenizer, index_text, tokenizer_side_files
from ckptconv.io.metadata import read_metadata, tool_version
from ckptconv.io.nxd import TENSORS_SUFFIX, Flavour
from ckptconv.io.nxd_write import sink_factory
from ckptconv.io.safetensors_sink import safetensors_sink
from ckptconv.sources.hub import resolve_hf
from ckptconv.sources.masters import MasterWeights, nxdtrain_optimizer
from ckptconv.sources.nxd import (  # open_nxd also reached as ckptconv.commands.api.open_nxd (README)
    check_files_read,
    open_nxd,
)
from ckptconv.training.nxd_optimizer import OPTIM_DIR
from ckptconv.training.nxd_optimizer_write import DEFAULT_RULE, check_rule, check_written, describe_rule, rule_of
from ckptconv.training.nxd_tag_optimizer import NxdTagOptimizer
from ckptconv.training.state import TagOptimizer, is_training_tag
from ckptconv.training.tag_parts import TagPart
from ckptconv.training.tag_reshard import NxdFormat, TrainingTag, check_nxd_trainer

DTYPES = {name: None if attr is None else getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}


@dataclass
class Result:
    out: Path
    files: dict[str, FileRecord]
    bytes_written: int
    seconds: float
    notes: list[str]
    layout: dict[str, Any] | None = None
    skipped: bool = False
    finalized: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "files": len(self.files),
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "layout": self.layout,
            "notes": self.notes,
            "up_to_date": self.skipped,
            "complete": self.finalized,
        }


def dtype_policy(dtype: str):  # type: ignore[no-untyped-def]
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target = DTYPES[dtype]
    return keep_dtype if target is None else cast_floats_to(target)


SOURCE_DTYPE = "source"  # to-hf's default --dtype: what the source model had
_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def export_dtype(dtype: str, config: dict[str, Any], shard_dtypes: dict[str, torch.dtype], notes: list[str]) -> str:
    """The ``--dtype`` an export writes: ``source`` becomes the dtype the model's HF config declares
    (``dtype``, or transformers 4's ``torch_dtype``: what the source weights were) where the shards
    hold another (a run trained in bf16 from fp32 weights, a ``to-nxd --dtype bf16``), else ``keep``."""
    if dtype != SOURCE_DTYPE:
        return dtype
    declared = _CONFIG_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    held = {d for k, d in shard_dtypes.items() if d.is_floating_point and not k.endswith("inv_freq")}
    if declared is None or held == {DTYPES[declared]}:
        return "keep"
    target = DTYPES[declared]
    assert target is not None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in held))
    widened = all(d.itemsize < target.itemsize for d in held)
    lost = "what the cast to the shards' dtype rounded away stays lost"
    notes.append(f"writing {str(target).removeprefix('torch.')}, the dtype of the source model (its config.json), "
                 f"from {names} shards" + (f" (widened: {lost})" if widened else "")
                 + "; --dtype keep writes the shards' dtype")
    return declared


# --------------------------------------------------------------------------------------------
# HF -> NxD


def to_nxd(
    src: str | Path,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    kv_size_multiplier: int = 1,
    attention: str | Attention = Attention.SEPARATE,
    fuse_qkv: bool = False,
    hw_backend: str | Hardware = Hardware.TRN1,
    trn2_kv_layout: str | Trn2KvLayout = Trn2KvLayout.RUNTIME,
    flavour: str | Flavour = Flavour.PLAIN,
    config: str | Path | None = None,
    dtype: str = "keep",
    verify_layers: int = 0,
    revision: str | None = None,
    tokenizer: str | Path | None = None,
    options: RunOptions | None = None,
) -> Result:
    """Convert an HF Llama checkpoint (directory, single file, or hub id ``org/name``) into NxD shards under ``out/model``.

    ``tokenizer``: a directory whose tokenizer (and generation) files are kept in ``out/hf/`` instead of
    those beside ``src`` (a single ``.pt``/``.bin`` file usually has none), so that exports carry them.

    A hub id is resolved by :func:`ckptconv.sources.hub.resolve_hf` (the local cache first; ``revision``: branch, tag
    or commit). With ``verify_layers`` > 0, :func:`ckptconv.commands.verify.verify` then checks that many sampled
    layers (plus embedding and lm_head) numerically and raises ``VerificationError`` on a mismatch.
    """
    options = options or RunOptions()
    started = time.monotonic()
    src = resolve_hf(src, revision=revision, quiet=options.quiet)
    layout = target_layout(tp=tp, pp=pp, vpp=vpp, kv_size_multiplier=kv_size_multiplier, attention=attention,
                           fuse_qkv=fuse_qkv, hw_backend=hw_backend, trn2_kv_layout=trn2_kv_layout)
    flavour = choice(Flavour, flavour, "flavour")
    notes: list[str] = []
    out = Path(out)
    with HfCheckpoint(src, config=config, io=options.io) as hf:
        layout.check_model(hf.spec)
        layout = _padded(layout, hf.spec, notes)
        with_inv_freq = check_source_shapes(hf.spec, hf.shapes(), str(src))
        if layout.hw is Hardware.TRN2 and layout.kvm > 1 and layout.trn2_kv_layout is Trn2KvLayout.OFFICIAL:
            message = ("--trn2-kv-layout official writes the official converter's trn2 K/V order, which pairs "
                       "query heads with the wrong K/V head on the NxD trn2 runtime")
            warnings.warn(message, stacklevel=2)
            notes.append(message)
        plan = plan_to_nxd(hf.spec, layout, hf.dtypes(), dtype_policy(dtype))
        fingerprint = _fingerprint("nxd", layout.to_json(), dtype, flavour.value, _identity(hf.weight_files()),
                                   _tokenizer_identity(tokenizer))
        copies = _with_tokenizer(_hf_side_copies(hf, notes), tokenizer, f"{HF_FILES_DIR}/", notes)
        if not has_tokenizer([Path(target).name for _, target in copies]):
            notes.append(f"no tokenizer beside {src}: {out}/{HF_FILES_DIR}/ keeps none, so exports will have none; "
                         "pass --tokenizer DIR")
        hf_config, copies, texts = _config_as_written(hf.spec.config, dtype, plan, copies)
        spec = FinalizeSpec(
            fingerprint,
            metadata=dict(kind="nxd", hf_config=hf_config, layout=layout.to_json(), flavour=flavour.value,
                          dtype=_dtype_name(plan), with_inv_freq=with_inv_freq, fingerprint=fingerprint),
            texts=texts, copies=copies,
        )
        result = _convert(plan, hf, out, sink_factory(flavour), options, spec, "to-nxd", sources=[Path(src)])
    result.notes[:0] = notes
    result.layout = layout.to_json()
    if verify_layers and result.finalized:
        _verify_after(src, out, config, verify_layers, result.notes)
    result.seconds = time.monotonic() - started
    return result


def _padded(layout: ParallelLayout, spec: ModelSpec, notes: list[str]) -> ParallelLayout:
    """``layout`` with its vocabulary padding recorded, and said (never silent)."""
    layout = layout.padded_for(spec)
    if layout.padded_vocab is not None:
        notes.append(f"vocab_size {spec.vocab} is padded to {layout.padded_vocab} rows (a multiple of tp {layout.tp}) "
                     "with zero rows in the embedding and lm_head shards; recorded in ckptconv.json, stripped by to-hf")
    return layout


def target_layout(*, tp: int, pp: int, vpp: int, kv_size_multiplier: int, attention: str | Attention, fuse_qkv: bool,
                  hw_backend: str | Hardware, trn2_kv_layout: str | Trn2KvLayout) -> ParallelLayout:
    """The layout an API call names with its keyword arguments (to_nxd's, from_dcp's), values checked."""
    return ParallelLayout(
        tp=tp, pp=pp, vpp=vpp, kvm=kv_size_multiplier, attention=choice(Attention, attention, "attention"),
        fuse_qkv=fuse_qkv, hw=choice(Hardware, hw_backend, "--hw-backend"),
        trn2_kv_layout=choice(Trn2KvLayout, trn2_kv_layout, "--trn2-kv-layout"),
    )


def _verify_after(src: str | Path, out: Path, config: str | Path | None, layers: int, notes: list[str]) -> None:
    from ckptconv.commands.verify import verify

    report = verify(src, out, layers=layers, config=config)
    if not report["ok"]:
        raise VerificationError(f"{out} was written but does not compute what {src} computes: " + "; ".join(report["problems"][:3]))
    worst = max(c["rel"] for layer in report["layers"].values() for c in layer.values())
    notes.append(f"verified {len(report['layers'])} layers, embedding and lm_head: max relative error {worst:.2g}")


def _kept_hf_files(root: Path, notes: list[str], *, into: str, skip: str = "") -> list[tuple[str, str]]:
    """(source, target) for the files ``to-nxd`` kept under ``root/hf/``, targets prefixed by ``into``."""
    side = root / HF_FILES_DIR
    if not side.is_dir() or side.is_symlink():
        return []
    names = [p.name for p in sorted(side.iterdir()) if p.name != skip and not p.is_dir()]
    return [(source, into + name) for name, source in outdir.confined_files(root, HF_FILES_DIR, names, notes)]


def _with_tokenizer(copies: list[tuple[str, str]], tokenizer: str | Path | None, into: str,
                    notes: list[str]) -> list[tuple[str, str]]:
    """``copies`` with the side files of the ``--tokenizer`` directory instead of same-named ones."""
    if tokenizer is None:
        return copies
    directory = Path(tokenizer)
    found = outdir.confined_files(directory, "", tokenizer_side_files(directory), notes)
    targets = {into + name for name, _ in found}
    notes.append(f"tokenizer from {directory}: {', '.join(name for name, _ in found)}")
    return [c for c in copies if c[1] not in targets] + [(source, into + name) for name, source in found]


def _tokenizer_identity(tokenizer: str | Path | None) -> list[tuple[str, int, int]] | None:
    if tokenizer is None:
        return None
    return _identity(sorted(p for p in Path(tokenizer).iterdir() if p.is_file()))


def _hf_side_copies(hf: HfCheckpoint, notes: list[str]) -> list[tuple[str, str]]:
    """config.json and tokenizer/generation files, kept under OUT/hf/ so to-hf can restore them."""
    copies = [(str(hf.config_path.resolve()), f"{HF_FILES_DIR}/{CONFIG}")]
    found = outdir.confined_files(hf.directory, "", [p.name for p in hf.side_files()], notes)
    return copies + [(source, f"{HF_FILES_DIR}/{name}") for name, source in found]


# --------------------------------------------------------------------------------------------
# NxD -> HF


def to_hf(
    src: str | Path,
    out: str | Path,
    *,
    config: str | Path | None = None,
    hints: dict[str, Any] | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: str = SOURCE_DTYPE,
    kv_replicas: str = "error",
    tokenizer: str | Path | None = None,
    masters: bool | None = None,
    options: RunOptions | None = None,
) -> Result:
    """Convert NxD shards (a converted dir, a tag, or a checkpoint root) into an HF directory.

    ``masters``: read the weights from the fp32 master weights in the tag's ``optim/``: those an nxdtrain
    bf16 run keeps, or NxD's own (ZeRO-1 ``sharded_master_weights``, see :mod:`ckptconv.sources.masters`).
    None, the default: when present (and always for an NxD tag whose model files hold no tensors);
    True: required; False: the shards.

    ``dtype``: ``source`` (the default) writes the dtype the model's HF config declares (see
    :func:`export_dtype`), ``keep`` the shards' dtype, or a cast (``bf16``, ``fp16``, ``fp32``).
    The tokenizer and generation files kept in the source's ``hf/`` come along; ``tokenizer`` (a
    directory) replaces them. An export that would have no tokenizer warns.
    """
    options = options or RunOptions()
    started = time.monotonic()
    out = Path(out)
    opened = open_nxd(src, config=config, hints=hints, io=options.io, check=options.check, masters=masters,
                      prefer_masters=True)
    ckpt, spec, layout, with_inv_freq, notes = (opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq,
                                                opened.notes)
    with ckpt:
        dtype = export_dtype(dtype, spec.config, ckpt.dtypes(), notes)
        for line in notes:
            note(line, quiet=options.quiet)
        plan = plan_to_hf(spec, layout, ckpt.dtypes(), with_inv_freq=with_inv_freq,
                          max_shard_size=max_shard_size, dtype_policy=dtype_policy(dtype),
                          average_replicas=kv_replicas == "mean")
        fingerprint = _fingerprint("hf", layout.to_json(), dtype, max_shard_size, kv_replicas,
                                   _identity(_input_files(ckpt)), _tokenizer_identity(tokenizer),
                                   ckpt.masters_identity())
        # config.json is rewritten with the dtype written; the tokenizer files come along as they are
        copies = _with_tokenizer(_kept_hf_files(ckpt.root, notes, into="", skip=CONFIG), tokenizer, "", notes)
        if not has_tokenizer([target for _, target in copies]):
            message = (f"{out} will have no tokenizer ({ckpt.root}/{HF_FILES_DIR}/ holds none), so AutoTokenizer "
                       "cannot load it; ckptconv to-hf --tokenizer DIR (or to-nxd --tokenizer DIR before training) "
                       "adds one")
            warnings.warn(message, stacklevel=2)
            notes.append(message)
        spec_ = FinalizeSpec(
            fingerprint,
            metadata=dict(kind="hf", hf_config=spec.config, dtype=_dtype_name(plan), with_inv_freq=with_inv_freq,
                          fingerprint=fingerprint, extra={"from_layout": layout.to_json()}),
            texts={CONFIG: config_text(spec.config, plan.files[0].tensors[0].dtype), **index_text(plan.files)},
            copies=copies,
        )
        result = _convert(plan, ckpt, out, safetensors_sink, options, spec_, "to-hf", kv_replicas,
                          sources=[Path(src), ckpt.root])
    result.notes[:0] = notes
    result.layout = layout.to_json()
    result.seconds = time.monotonic() - started
    return result


# --------------------------------------------------------------------------------------------
# NxD -> NxD


def reshard(
    src: str | Path,
    out: str | Path,
    *,
    tp: int,
    pp: int,
    vpp: int = 1,
    kv_size_multiplier: int | None = None,
    attention: str | Attention | None = None,
    fuse_qkv: bool | None = None,
    hw_backend: str | Hardware | None = None,
    trn2_kv_layout: str | Trn2KvLayout = Trn2KvLayout.RUNTIME,
    flavour: str | Flavour | None = None,
    config: str | Path | None = None,
    hints: dict[str, Any] | None = None,
    dtype: str = "keep",
    kv_replicas: str = "error",
    masters: bool | None = None,
    dp: int | None = None,
    zero1: bool | None = None,
    weights_only: bool = False,
    optimizer_format: str = "nxdtrain",
    nxd_param_groups: str | None = None,
    drop_masters: bool = False,
    nxd_trainer: str | None = None,
    options: RunOptions | None = None,
) -> Result:
    """NxD -> NxD for a new layout, streaming, without writing HF to disk.

    Unset layout options keep the source's values; ``kv_size_multiplier`` defaults to what the
    new tp needs (tp / kv heads when tp > kv heads, else 1) on the qkv_linear path. ``masters``: as
    for :func:`to_hf`, but by default the shards.

    A training tag (nxdtrain's: ``optim/`` and ``user_content.pt`` beside the shards) gives a training tag
    at the new layout: the optimizer state moves with the weights (:mod:`ckptconv.training.state`), over
    ``dp`` ranks with ZeRO-1 (``zero1``; both default to the tag's) or in one file per shard without;
    step, consumed samples, schedule and options come along. A tag of NxD's own code (``optim/`` in NxD's
    format, :mod:`ckptconv.training.nxd_tag_optimizer`) gives the same: an nxdtrain training tag, its step and schedule
    mapped by :mod:`ckptconv.training.position`. ``weights_only``: the shards alone.

    ``optimizer_format="nxd"`` writes the optimizer state in NxD's own format instead
    (:mod:`ckptconv.training.nxd_optimizer_write`): its param groups by ``nxd_param_groups`` (default ``bias-norm``,
    NxD's Llama example; ``bias-LayerNorm``; ``one``), checked by reading the files back; ``drop_masters``
    accepts losing a bf16 model's fp32 state without ZeRO-1; ``nxd_trainer`` (``nxd-example``, ``nxdt``; default:
    the source's own, else ``nxd-example``) whose side files to write (:mod:`ckptconv.training.trainer_files`).
    """
    options = options or RunOptions()
    rule = _nxd_rule(optimizer_format, nxd_param_groups, drop_masters)  # bad flags refused before anything opens
    check_nxd_trainer(optimizer_format, nxd_trainer)
    started = time.monotonic()
    out = Path(out)
    parted = options.part[1] > 1  # a part checks one model file per stage, then the files it reads (below)
    opened = open_nxd(src, config=config, hints=hints, io=options.io, check=options.check, masters=masters,
                      stages_only=parted, keep_nxd_optimizer=True)  # NxD's tag: its state moves too
    ckpt, spec, old, with_inv_freq, notes = opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq, opened.notes
    with ckpt:
        attention_mode = choice(Attention, attention, "attention") if attention is not None else old.attention
        if kv_size_multiplier is None:
            kv_size_multiplier = default_kvm(tp, spec.kv_heads, attention_mode)
        new = ParallelLayout(
            tp=tp, pp=pp, vpp=vpp, kvm=kv_size_multiplier, attention=attention_mode,
            fuse_qkv=old.fuse_qkv if fuse_qkv is None else fuse_qkv,
            hw=old.hw if hw_backend is None else choice(Hardware, hw_backend, "--hw-backend"),
            trn2_kv_layout=choice(Trn2KvLayout, trn2_kv_layout, "--trn2-kv-layout"),
        )
        new.check_model(spec)
        new = _padded(new, spec, notes)
        target_flavour = ckpt.flavour if flavour is None else choice(Flavour, flavour, "flavour")
        plan = plan_reshard(spec, old, new, ckpt.dtypes(stages_only=parted), with_inv_freq=with_inv_freq,
                            dtype_policy=dtype_policy(dtype))
        training = None
        if not weights_only and is_training_tag(ckpt.root):
            training = TrainingTag.open(ckpt, spec, old, with_inv_freq, dp=dp, zero1=zero1, io=options.io,
                                        optim=nxdtrain_optimizer(ckpt),  # a part: its own ranks' files added below
                                        only={(0, 0)} if parted else None)
        elif not weights_only and (ckpt.root / OPTIM_DIR).is_dir():  # NxD's own tag: into nxdtrain's format
            training = TrainingTag.open_nxd(ckpt, dp=dp, zero1=zero1, io=options.io)
        if training is None and (dp is not None or zero1 is not None or optimizer_format != "nxdtrain"):
            flags = "--dp and --zero1 place" if dp is not None or zero1 is not None else "--optimizer-format nxd writes"
            raise ConversionError(f"{ckpt.root}: {flags} optimizer state; "
                                  + ("--weights-only writes none" if weights_only else "this is not a training "
                                     "tag (no optim/)"))
        if parted and training is None:  # the weights alone: split by _convert, so every file is checked here
            check_files_read(ckpt, spec, old, with_inv_freq, ckpt.files)
        if training is not None and optimizer_format == "nxd":
            saved = rule_of(training.optim.optim) if isinstance(training.optim, NxdTagOptimizer) else None
            if nxd_param_groups is None and saved is not None:  # NxD's tag: its own groups, which its run rebuilds
                rule = saved
                notes.append(f"param groups as NxD's tag has them ({describe_rule(saved)})")
            elif saved is not None and rule != saved:
                notes.append(f"param groups regrouped by --nxd-param-groups {rule}: NxD's tag had "
                             f"{describe_rule(saved)}; the NxD run that loads it must build the new groups")
            training.nxd_format = NxdFormat(rule or DEFAULT_RULE, drop_masters, spec, with_inv_freq, nxd_trainer, out)
        fingerprint = _fingerprint("reshard", old.to_json(), new.to_json(), dtype, target_flavour.value,
                                   _identity(_input_files(ckpt)),
                                   None if training is None else training.identity())
        hf_config, copies, texts = _config_as_written(spec.config, dtype, plan,
                                                      _kept_hf_files(ckpt.root, notes, into=f"{HF_FILES_DIR}/"))
        metadata = dict(kind="nxd", hf_config=hf_config, layout=new.to_json(), flavour=target_flavour.value,
                        dtype=_dtype_name(plan), with_inv_freq=with_inv_freq, fingerprint=fingerprint)
        spec_ = FinalizeSpec(fingerprint, metadata=metadata, texts=texts, copies=copies)
        reader: Any = ckpt
        sinks = sink_factory(target_flavour)
        part: TagPart | None = None
        with training or contextlib.nullcontext():  # a training tag: its optimizer files closed after the write
            if training is not None:  # the optimizer files join the plan, read beside the weights
                if parted:  # one of several parts: the optimizer state of its own files only
                    part = TagPart.split(plan, options.part, dp=training.dp, zero1=training.zero1)
                    sources = part.sources()
                    check_files_read(ckpt, spec, old, with_inv_freq,
                                     [shard_file(tp_rank=tp, pp_rank=pp) for tp, pp in sources])
                    everything, whole = _outputs(plan, spec_), plan
                    if isinstance(training.optim, TagOptimizer):  # nxdtrain's files: those this part reads
                        training.optim.widen(sources)
                    plan = part.planned()
                plan, reader = training.extend(plan, spec_, new, notes)
                if part is not None:
                    training.read_back_all(whole.files, new)  # the last part reads back every part's files
                    plan = part.narrowed(plan)
                    part = part.declaring(everything + _outputs(plan, spec_))
                sinks = training.sinks(sinks, split=target_flavour is Flavour.XSER_SPLIT)
            result = _convert(plan, reader, out, sinks, options, spec_, "reshard", kv_replicas,
                              sources=[Path(src), ckpt.root], part_of=part)
        if training is not None and training.written is not None and not result.skipped and result.finalized:
            check_written(out, training.written)  # every optimizer index read back as intended
            notes.append(f"read back with NxD's optimizer reader: every index named as written "
                         f"({describe_rule(training.written.rule)})")
    result.notes[:0] = notes
    result.layout = new.to_json()
    result.seconds = time.monotonic() - started
    return result


def _nxd_rule(optimizer_format: str, rule: str | None, drop_masters: bool) -> str | None:
    """``--optimizer-format``/``--nxd-param-groups``/``--drop-masters`` checked: the param-group rule (None:
    nxdtrain's format)."""
    if optimizer_format not in ("nxdtrain", "nxd"):
        raise ConversionError(f"--optimizer-format must be nxdtrain or nxd, got {optimizer_format!r}")
    if optimizer_format == "nxdtrain":
        if rule is not None or drop_masters:
            raise ConversionError("--nxd-param-groups and --drop-masters apply to --optimizer-format nxd only")
        return None
    return check_rule(DEFAULT_RULE if rule is None else rule)


# --------------------------------------------------------------------------------------------
# Shared steps


def _convert(plan: Plan, reader: Any, out: Path, sinks: Any, options: RunOptions, spec: FinalizeSpec,
             label: str, kv_replicas: str = "error", *, sources: list[Path], part_of: TagPart | None = None) -> Result:
    """Write this process's part of ``plan`` under OUT's lock; finalize when it is the last part to finish.
    ``part_of``: a training tag's part, whose ``plan`` holds its own files only (:mod:`ckptconv.training.tag_parts`)."""
    part = options.part
    spec.parts = part[1]
    spec.hash = options.digest
    if part[1] > 1 and options.overwrite:
        raise ConversionError("--overwrite cannot be combined with several parts; run without --part first")
    outdir.check_separate(sources, out)
    with outdir.acquire(out, fingerprint=spec.fingerprint, parts=part[1]) as lock:
        if not lock.shared:  # the first (or only) process: check OUT and set it up
            if _up_to_date(out, spec.fingerprint, options):
                outdir.clear_tmp(out)  # what a run killed after writing ckptconv.json left behind
                return Result(out, _recorded(out), 0, 0.0, ["output is up to date"], skipped=True)
            _prepare_out(out, spec.fingerprint, options)
            outdir.declare(out, spec.fingerprint[:16], _outputs(plan, spec) if part_of is None else list(part_of.declared))
            write_spec(out, spec)
            if part[1] > 1:
                lock.share()
        mine = assign_files(plan, part) if part_of is None else set(part_of.mine)
        total = sum(f.nbytes for f in plan.files if f.path in mine)
        with byte_progress(f"{label} {out.name}", total, quiet=options.quiet) as advance:
            exec_options = ExecOptions(workers=options.workers, max_memory=options.max_memory, replicas=kv_replicas,
                                       fingerprint=spec.fingerprint, hash=spec.hash, progress=advance)
            files = run_plan(plan, reader, out, sinks, exec_options, only_files=mine, state_file=state_name(part))
        if hasattr(reader, "finish_checks"):  # every input file read from matches its record, before OUT is complete
            reader.finish_checks(workers=options.workers)
        record_part(out, part, files)
        finalized = try_finalize(out, lock)
    count = len(plan.files) if part_of is None else part_of.count
    notes = [] if part[1] == 1 else [f"part {part[0]}/{part[1]}: {len(mine)} of {count} files"]
    if finalized is None:
        notes.append(f"other parts are still running; the last one (or `ckptconv finalize {out}`) finishes OUT")
    return Result(out, finalized or files, total, 0.0, notes, finalized=finalized is not None)


def _outputs(plan: Plan, spec: FinalizeSpec) -> list[str]:
    """Every path this conversion may create in OUT (declared before the first byte is written)."""
    paths = [f.path for f in plan.files] + [f.path + TENSORS_SUFFIX for f in plan.files
                                            if f.format in ("torch", NESTED_TORCH)]
    return paths + list(spec.texts) + list(spec.blobs) + [rel for _, rel in spec.copies] + spec.markers


def _input_files(ckpt: Any) -> list[Path]:
    """The files a conversion of ``ckpt`` reads: its model shards, and the optimizer files when the
    weights are NxD's masters (so that an output is never "up to date" with other inputs)."""
    files = sorted(ckpt.files.values())
    if isinstance(ckpt.weight_source, MasterWeights):  # nxdtrain's masters: named apart (ckpt.masters_identity)
        files += sorted(p for p in (ckpt.root / OPTIM_DIR).rglob("*") if p.is_file())
    return files


def _identity(files: list[Path]) -> list[tuple[str, int, int]]:
    """What identifies the inputs cheaply: names, sizes, modification times."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _fingerprint(*parts: Any) -> str:
    payload = json.dumps([tool_version(), *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _up_to_date(out: Path, fingerprint: str, options: RunOptions) -> bool:
    meta = read_metadata(out) if out.is_dir() else None
    if meta is None or meta.fingerprint != fingerprint or options.overwrite:
        return False
    return all(FileRecord.from_json(rec).matches(out / rel) for rel, rec in meta.files.items())


def _recorded(out: Path) -> dict[str, FileRecord]:
    meta = read_metadata(out)
    assert meta is not None
    return {rel: FileRecord.from_json(rec) for rel, rec in meta.files.items()}


def _prepare_out(out: Path, fingerprint: str, options: RunOptions) -> None:
    """Under OUT's lock: resume this conversion, or start it in an empty OUT, or (``--overwrite``)
    replace an earlier ckptconv conversion. Never removes what no ckptconv writer recorded."""
    meta = read_metadata(out) if out.is_dir() else None
    if meta is not None and meta.fingerprint == fingerprint:
        return  # same conversion, some files damaged or missing: redo those
    if meta is None and pending_fingerprint(out) == fingerprint:
        return  # an interrupted run of this same conversion (or another part of it): resume
    strangers, ours = outdir.foreign(out), outdir.present(out)
    if strangers and options.overwrite:
        raise ConversionError(
            f"{out}: --overwrite only replaces files a ckptconv conversion recorded; {strangers[0]!r} is not one of "
            "them; choose another OUT (or move that file away yourself)"
        )
    if (strangers or ours) and not options.overwrite:
        what = (f"another conversion ({meta.kind}, fingerprint {meta.fingerprint[:12]})" if meta is not None
                else "files of an unfinished conversion" if ours else f"files ckptconv did not write ({strangers[0]!r})")
        raise ConversionError(f"{out}: not empty; holds {what}; choose another OUT")
    outdir.remove_owned(out)  # only ours: listed in ckptconv.json or declared in the temporary directory


def _config_as_written(config: dict[str, Any], dtype: str, plan: Plan, copies: list[tuple[str, str]]
                       ) -> tuple[dict[str, Any], list[tuple[str, str]], dict[str, str]]:
    """(HF config to record, side-file copies, texts) of a converted checkpoint: after a deliberate
    ``--dtype`` cast the written dtype becomes the model's, in ckptconv.json and in the kept
    ``hf/config.json`` (so ``to-hf --dtype source`` keeps it); otherwise all as they were."""
    name = _dtype_name(plan)
    if dtype == "keep" or "," in name:
        return config, copies, {}
    config = {**config, "torch_dtype": name, "dtype": name}
    kept = f"{HF_FILES_DIR}/{CONFIG}"
    return config, [c for c in copies if c[1] != kept], {kept: config_text(config, plan.files[0].tensors[0].dtype)}


def _dtype_name(plan: Plan) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for f in plan.files for t in f.tensors
                    if not t.key.endswith("inv_freq")})
    return names[0] if len(names) == 1 else ",".join(names)
