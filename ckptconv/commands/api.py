"""The Python API: ``to_nxd``, ``to_hf``, ``reshard``, ``inspect``. The CLI is a thin layer over it.

Example:
    >>> import ckptconv
    >>> ckptconv.to_nxd("llama-hf", "llama-nxd", tp=8, pp=2, attention="qkv_linear",
    ...                 kv_size_multiplier=1, fuse_qkv=True)        # doctest: +SKIP
    >>> ckptconv.to_hf("llama-nxd", "llama-hf-again")               # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from ckptconv.commands.src_kind import open_hf, refuse_hf_source, refuse_nxd_source
from ckptconv.commands.steps import EXPORTED_FROM, config_as_written, dtype_name, input_files, trained_record
from ckptconv.core.fused_experts import check_hf_experts
from ckptconv.core.layout import (
    HF_FILES_DIR,
    Attention,
    Hardware,
    ParallelLayout,
    Trn2KvLayout,
    shard_file,
)
from ckptconv.core.layout_flags import LayoutOverrides, apply_layout, with_api_kwargs
from ckptconv.core.mapping import check_source_shapes
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Plan, cast_floats_to, keep_dtype, plan_reshard, plan_to_hf, plan_to_nxd
from ckptconv.engine import outdir
from ckptconv.engine.finalize import (
    FinalizeSpec,
)
from ckptconv.engine.options import DTYPES as DTYPE_NAMES
from ckptconv.engine.options import RunOptions  # also reached as ckptconv.commands.api.RunOptions
from ckptconv.engine.run import Result, Run, file_identity, fingerprint, planned_outputs
from ckptconv.errors import ConversionError, VerificationError, choice
from ckptconv.io.hf import CONFIG, HfCheckpoint, config_text, has_tokenizer, index_text, tokenizer_side_files
from ckptconv.io.nxd import Flavour
from ckptconv.io.nxd_write import sink_factory
from ckptconv.io.quantized import describe, plain_config
from ckptconv.io.safetensors_sink import safetensors_sink
from ckptconv.sources.hub import resolve_hf
from ckptconv.sources.masters import nxdtrain_optimizer
from ckptconv.sources.nxd import (  # open_nxd also reached as ckptconv.commands.api.open_nxd (README)
    check_files_read,
    open_nxd,
)
from ckptconv.training.nxd_format.as_source import NxdTagOptimizer
from ckptconv.training.nxd_format.read import OPTIM_DIR
from ckptconv.training.nxd_format.write import DEFAULT_RULE, check_rule, check_written, describe_rule, rule_of
from ckptconv.training.nxdtrain_format.state import TagOptimizer, is_training_tag
from ckptconv.training.tag_parts import TagPart
from ckptconv.training.tag_reshard import NxdFormat, TrainingTag, check_nxd_trainer

DTYPES = {name: None if attr is None else getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}


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
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    kv_size_multiplier: int | None = None,
    attention: str | Attention | None = None,
    fuse_qkv: bool | None = None,
    hw_backend: str | Hardware | None = None,
    trn2_kv_layout: str | Trn2KvLayout | None = None,
    ep: int | None = None,
    layout: LayoutOverrides | None = None,
    flavour: str | Flavour = Flavour.PLAIN,
    config: str | Path | None = None,
    dtype: str = "keep",
    verify_layers: int = 0,
    revision: str | None = None,
    tokenizer: str | Path | None = None,
    options: RunOptions | None = None,
) -> Result:
    """Convert an HF Llama checkpoint (directory, single file, or hub id ``org/name``) into NxD shards under ``out/model``.

    The layout: the keywords (``tp``, ``pp``, ..., None: not given) or ``layout`` (a
    :class:`ckptconv.core.layout_flags.LayoutOverrides`, what the CLI passes), over tp 1 x pp 1; the kv
    multiplier not given is what tp needs (``default_kvm``). Neither tp nor pp given: the notes say so.

    ``tokenizer``: a directory whose tokenizer (and generation) files are kept in ``out/hf/`` instead of
    those beside ``src`` (a single ``.pt``/``.bin`` file usually has none), so that exports carry them.

    A hub id is resolved by :func:`ckptconv.sources.hub.resolve_hf` (the local cache first; ``revision``: branch, tag
    or commit). With ``verify_layers`` > 0, :func:`ckptconv.commands.verify.verify` then checks that many sampled
    layers (plus embedding and lm_head) numerically and raises ``VerificationError`` on a mismatch.
    """
    run = Run("to-nxd", options)
    options, notes = run.options, run.notes
    flags = with_api_kwargs(layout, tp=tp, pp=pp, vpp=vpp, kv_size_multiplier=kv_size_multiplier,
                            attention=attention, fuse_qkv=fuse_qkv, hw_backend=hw_backend,
                            trn2_kv_layout=trn2_kv_layout, ep=ep)
    flavour = choice(Flavour, flavour, "flavour")
    src = resolve_hf(src, revision=revision, quiet=options.quiet)
    refuse_nxd_source(src)
    out = Path(out)
    with open_hf(src, config=config, io=options.io) as hf:
        target = new_layout(flags, hf.spec, notes)
        with_inv_freq = check_source_shapes(hf.spec, hf.shapes(), str(src))
        copies, plain = dequantized(hf, dtype, hf_side_copies(hf, notes), notes)
        plan = plan_to_nxd(hf.spec, target, hf.dtypes(), dtype_policy(dtype))
        identity = fingerprint("nxd", target.to_json(), dtype, flavour.value, file_identity(hf.weight_files()),
                               tokenizer_identity(tokenizer))
        copies = with_tokenizer(copies, tokenizer, f"{HF_FILES_DIR}/", notes)
        if not has_tokenizer([Path(path).name for _, path in copies]):
            notes.append(f"no tokenizer beside {src}: {out}/{HF_FILES_DIR}/ keeps none, so exports will have none; "
                         "pass --tokenizer DIR")
        hf_config, copies, texts = config_as_written(hf.spec.config, dtype, plan, copies)
        texts = {**plain, **texts}  # a --dtype cast's config.json (also without quantization_config) wins
        spec = FinalizeSpec(
            identity,
            metadata=dict(kind="nxd", hf_config=hf_config, layout=target.to_json(), flavour=flavour.value,
                          dtype=dtype_name(plan), with_inv_freq=with_inv_freq, fingerprint=identity),
            texts=texts, copies=copies,
        )
        result = run.write(plan, hf, out, sink_factory(flavour, ep=target.ep), spec, sources=[Path(src)])
    if verify_layers and result.finalized:
        _verify_after(src, out, config, verify_layers, result.notes)
    return run.finish(result, target.to_json())


def new_layout(flags: LayoutOverrides, spec: ModelSpec, notes: list[str],
               base: ParallelLayout | None = None) -> ParallelLayout:
    """The layout a command writes from HF or DCP weights: ``flags`` over ``base`` (a recorded layout), else
    over tp 1 x pp 1 (the kv multiplier: what tp needs), checked against the model; padding and an
    unstated tp and pp said in ``notes``."""
    resolved = apply_layout(base or ParallelLayout(), flags, base_is="default" if base is None else "source",
                            kv_heads=spec.kv_heads)
    resolved.check_model(spec)
    if base is None and flags.tp is None and flags.pp is None:
        notes.append("writing tp 1 x pp 1 (one unsharded file): no tp or pp was given")
    layout = _padded(resolved.layout, spec, notes)
    if layout.hw is Hardware.TRN2 and layout.kvm > 1 and layout.trn2_kv_layout is Trn2KvLayout.OFFICIAL:
        message = ("--trn2-kv-layout official writes the official converter's trn2 K/V order, which pairs "
                   "query heads with the wrong K/V head on the NxD trn2 runtime")
        warnings.warn(message, stacklevel=3)
        notes.append(message)
    return layout


def _padded(layout: ParallelLayout, spec: ModelSpec, notes: list[str]) -> ParallelLayout:
    """``layout`` with its vocabulary padding recorded, and said (never silent)."""
    layout = layout.padded_for(spec)
    if layout.padded_vocab is not None:
        notes.append(f"vocab_size {spec.vocab} is padded to {layout.padded_vocab} rows (a multiple of tp {layout.tp}) "
                     "with zero rows in the embedding and lm_head shards; recorded in ckptconv.json, stripped by to-hf")
    return layout


def _verify_after(src: str | Path, out: Path, config: str | Path | None, layers: int, notes: list[str]) -> None:
    from ckptconv.commands.verify import verify

    report = verify(src, out, layers=layers, config=config)
    if not report["ok"]:
        raise VerificationError(f"{out} was written but does not compute what {src} computes: " + "; ".join(report["problems"][:3]))
    worst = max(c["rel"] for layer in report["layers"].values() for c in layer.values())
    notes.append(f"verified {len(report['layers'])} layers, embedding and lm_head: max relative error {worst:.2g}")


def kept_hf_files(root: Path, notes: list[str], *, into: str, skip: str = "") -> list[tuple[str, str]]:
    """(source, target) for the files ``to-nxd`` kept under ``root/hf/``, targets prefixed by ``into``."""
    side = root / HF_FILES_DIR
    if not side.is_dir() or side.is_symlink():
        return []
    names = [p.name for p in sorted(side.iterdir()) if p.name != skip and not p.is_dir()]
    return [(source, into + name) for name, source in outdir.confined_files(root, HF_FILES_DIR, names, notes)]


def with_tokenizer(copies: list[tuple[str, str]], tokenizer: str | Path | None, into: str,
                    notes: list[str]) -> list[tuple[str, str]]:
    """``copies`` with the side files of the ``--tokenizer`` directory instead of same-named ones."""
    if tokenizer is None:
        return copies
    directory = Path(tokenizer)
    found = outdir.confined_files(directory, "", tokenizer_side_files(directory), notes)
    targets = {into + name for name, _ in found}
    notes.append(f"tokenizer from {directory}: {', '.join(name for name, _ in found)}")
    return [c for c in copies if c[1] not in targets] + [(source, into + name) for name, source in found]


def tokenizer_identity(tokenizer: str | Path | None) -> list[tuple[str, int, int]] | None:
    if tokenizer is None:
        return None
    return file_identity(sorted(p for p in Path(tokenizer).iterdir() if p.is_file()))


def dequantized(hf: HfCheckpoint, dtype: str, copies: list[tuple[str, str]], notes: list[str]
                ) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Quantized HF weights (config.json's ``quantization_config``) read as ``dtype`` (bf16 for ``keep``), said in
    one note: (``copies`` without the source's config.json, the kept ``hf/config.json`` of the dequantized model).
    Call before planning (``hf.dtypes()`` then gives the dequantized dtype)."""
    if not hf.quantized.tensors:
        return copies, {}
    target = DTYPES.get(dtype) or hf.quantized.dtype  # --dtype keep: bf16
    hf.dequantize_to(target)
    notes.append(f"{len(hf.quantized.tensors)} quantized weight(s) ({describe(hf.spec.config)}) dequantized to "
                 f"{str(target).removeprefix('torch.')} as they stream; config.json without its quantization_config")
    kept = f"{HF_FILES_DIR}/{CONFIG}"
    return [c for c in copies if c[1] != kept], {kept: config_text(hf.spec.config, target)}


def hf_side_copies(hf: HfCheckpoint, notes: list[str]) -> list[tuple[str, str]]:
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
    hints: dict[str, Any] | LayoutOverrides | None = None,
    max_shard_size: int = 5 * 10**9,
    dtype: str = SOURCE_DTYPE,
    kv_replicas: str = "error",
    tokenizer: str | Path | None = None,
    masters: bool | None = None,
    hf_experts: str = "per-expert",
    options: RunOptions | None = None,
) -> Result:
    """Convert NxD shards (a converted dir, a tag, or a checkpoint root) into an HF directory.

    ``hf_experts``: a mixture of experts' layers per expert (``per-expert``, the default) or ``fused``
    (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``, see
    :mod:`ckptconv.core.fused_experts`).

    ``masters``: read the weights from the fp32 master weights in the tag's ``optim/``: those an nxdtrain
    bf16 run keeps, or NxD's own (ZeRO-1 ``sharded_master_weights``, see :mod:`ckptconv.sources.masters`).
    None, the default: when present (and always for an NxD tag whose model files hold no tensors);
    True: required; False: the shards.

    ``dtype``: ``source`` (the default) writes the dtype the model's HF config declares (see
    :func:`export_dtype`), ``keep`` the shards' dtype, or a cast (``bf16``, ``fp16``, ``fp32``).
    The tokenizer and generation files kept in the source's ``hf/`` come along; ``tokenizer`` (a
    directory) replaces them. An export that would have no tokenizer warns.
    """
    run = Run("to-hf", options)
    options, notes = run.options, run.notes
    out = Path(out)
    refuse_hf_source(src, "to-hf")
    opened = open_nxd(src, config=config, hints=hints, io=options.io, check=options.check, masters=masters,
                      prefer_masters=True)
    ckpt, spec, layout, with_inv_freq = opened.ckpt, opened.spec, opened.layout, opened.with_inv_freq
    notes += opened.notes
    with ckpt:
        fused = check_hf_experts(hf_experts, spec)
        dtype = export_dtype(dtype, spec.config, ckpt.dtypes(), notes)  # notes: said once, in the result
        plan = plan_to_hf(spec, layout, ckpt.dtypes(), max_shard_size=max_shard_size, dtype_policy=dtype_policy(dtype),
                          average_replicas=kv_replicas == "mean", fused_experts=fused)
        identity = fingerprint("hf", layout.to_json(), dtype, max_shard_size, kv_replicas, *(["fused"] if fused else []),
                               file_identity(input_files(ckpt)), tokenizer_identity(tokenizer),
                               ckpt.masters_identity())
        # config.json is rewritten with the dtype written; the tokenizer files come along as they are
        copies = with_tokenizer(kept_hf_files(ckpt.root, notes, into="", skip=CONFIG), tokenizer, "", notes)
        no_tokenizer = None
        if not has_tokenizer([target for _, target in copies]):
            no_tokenizer = (f"{out} will have no tokenizer ({ckpt.root}/{HF_FILES_DIR}/ holds none), so AutoTokenizer "
                            "cannot load it; ckptconv to-hf --tokenizer DIR (or to-nxd --tokenizer DIR before training) "
                            "adds one")
            notes.append(no_tokenizer)
        spec_ = FinalizeSpec(
            identity,
            metadata=dict(kind="hf", hf_config=plain_config(spec.config), dtype=dtype_name(plan), with_inv_freq=with_inv_freq,
                          fingerprint=identity, extra={"from_layout": layout.to_json(), **_trained_source(ckpt)}),
            texts={CONFIG: config_text(spec.config, plan.files[0].tensors[0].dtype), **index_text(plan.files)},
            copies=copies,
        )
        result = run.write(plan, ckpt, out, safetensors_sink, spec_, kv_replicas, sources=[Path(src), ckpt.root])
    if no_tokenizer is not None:  # once written: an export refused for another reason warns of nothing else
        warnings.warn(no_tokenizer, stacklevel=2)
    return run.finish(result, layout.to_json())


def _trained_source(ckpt: Any) -> dict[str, Any]:
    """What an export records of the trained tag it came from (verify then knows the export is that tag's)."""
    record = trained_record(ckpt.metadata)
    return {} if record is None else {EXPORTED_FROM: {k: record.get(k) for k in ("step", "run")}}


# --------------------------------------------------------------------------------------------
# NxD -> NxD


def reshard(
    src: str | Path,
    out: str | Path,
    *,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    kv_size_multiplier: int | None = None,
    attention: str | Attention | None = None,
    fuse_qkv: bool | None = None,
    hw_backend: str | Hardware | None = None,
    trn2_kv_layout: str | Trn2KvLayout | None = None,
    ep: int | None = None,
    layout: LayoutOverrides | None = None,
    flavour: str | Flavour | None = None,
    config: str | Path | None = None,
    hints: dict[str, Any] | LayoutOverrides | None = None,
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

    The new layout: the keywords (None: not given) or ``layout`` (a ``LayoutOverrides``) over the source's;
    the kv multiplier not given is what the new tp needs, ``trn2_kv_layout`` runtime. A reshard that would
    change nothing is refused. ``hints``: the layout of an unrecorded source (``--source-hw-backend``...).
    ``masters``: as for :func:`to_hf`, but by default the shards.

    A training tag (nxdtrain's, or NxD's own: :mod:`ckptconv.training.nxd_format.as_source`) gives an nxdtrain
    training tag at the new layout: optimizer state (:mod:`ckptconv.training.nxdtrain_format.state`) over ``dp`` ranks with ZeRO-1
    (``zero1``; both default to the tag's) or one file per shard, step, consumed samples, schedule and options
    (NxD's mapped by :mod:`ckptconv.training.nxd_format.position`). ``weights_only``: the shards alone.

    ``optimizer_format="nxd"`` writes NxD's own format (:mod:`ckptconv.training.nxd_format.write`), param groups
    by ``nxd_param_groups`` (default ``bias-norm``), read back; ``drop_masters`` accepts losing a bf16 model's fp32
    state without ZeRO-1; ``nxd_trainer``: whose side files (:mod:`ckptconv.training.nxd_format.side_files`).
    """
    run = Run("reshard", options)
    options, notes = run.options, run.notes
    rule = _nxd_rule(optimizer_format, nxd_param_groups, drop_masters)  # bad flags refused before anything opens
    check_nxd_trainer(optimizer_format, nxd_trainer)
    flags = with_api_kwargs(layout, tp=tp, pp=pp, vpp=vpp, kv_size_multiplier=kv_size_multiplier,
                            attention=attention, fuse_qkv=fuse_qkv, hw_backend=hw_backend,
                            trn2_kv_layout=trn2_kv_layout, ep=ep)
    out = Path(out)
    refuse_hf_source(src, "reshard")
    parted = options.part[1] > 1  # a part checks one model file per stage, then the files it reads (below)
    opened = open_nxd(src, config=config, hints=hints, io=options.io, check=options.check, masters=masters,
                      stages_only=parted, keep_nxd_optimizer=True)  # NxD's tag: its state moves too
    ckpt, spec, old = opened.ckpt, opened.spec, opened.layout  # old: the layout read, with its with_inv_freq
    notes += opened.notes
    with ckpt:
        resolved = apply_layout(old, flags, kv_heads=spec.kv_heads)
        resolved.check_model(spec)
        new = _padded(resolved.layout, spec, notes)
        target_flavour = ckpt.flavour if flavour is None else choice(Flavour, flavour, "flavour")
        _refuse_no_change(ckpt, old, new, flags, changes=[
            target_flavour is not ckpt.flavour, dtype != "keep", masters is True, kv_replicas != "error",
            dp is not None, zero1 is not None, optimizer_format != "nxdtrain", weights_only])
        plan = plan_reshard(spec, old, new, ckpt.dtypes(stages_only=parted), dtype_policy=dtype_policy(dtype))
        training = _reshard_training(ckpt, spec, old, dp=dp, zero1=zero1, weights_only=weights_only,
                                     optimizer_format=optimizer_format, options=options, new=new)
        if parted and training is None:  # the weights alone: split by the run's write, so every file is checked here
            check_files_read(ckpt, spec, old, ckpt.files)
        if training is not None and optimizer_format == "nxd":
            training.nxd_format = NxdFormat(_param_groups(training, rule, nxd_param_groups, notes), drop_masters,
                                            spec, old.with_inv_freq, nxd_trainer, out)
        spec_ = _reshard_spec(ckpt, spec, old, new, plan, training, dtype, target_flavour, notes)
        result = _write_reshard(plan, ckpt, training, spec, old, new, out, run, spec_,
                                target_flavour, kv_replicas, [Path(src), ckpt.root])
    return run.finish(result, new.to_json())


def _reshard_spec(ckpt: Any, spec: ModelSpec, old: ParallelLayout, new: ParallelLayout, plan: Plan,
                  training: TrainingTag | None, dtype: str, target_flavour: Flavour,
                  notes: list[str]) -> FinalizeSpec:
    """What completes a reshard's OUT: its fingerprint, ``ckptconv.json`` and the HF files kept under ``hf/``."""
    identity = fingerprint("reshard", old.to_json(), new.to_json(), dtype, target_flavour.value,
                           file_identity(input_files(ckpt)), None if training is None else training.identity())
    hf_config, copies, texts = config_as_written(spec.config, dtype, plan,
                                                 kept_hf_files(ckpt.root, notes, into=f"{HF_FILES_DIR}/"))
    metadata = dict(kind="nxd", hf_config=hf_config, layout=new.to_json(), flavour=target_flavour.value,
                    dtype=dtype_name(plan), with_inv_freq=old.with_inv_freq, fingerprint=identity)
    return FinalizeSpec(identity, metadata=metadata, texts=texts, copies=copies)


def _refuse_no_change(ckpt: Any, old: ParallelLayout, new: ParallelLayout, flags: LayoutOverrides, *,
                      changes: list[bool]) -> None:
    """A reshard with no layout given that would write what SRC holds (same layout, flavour, dtype,
    weights and optimizer state) is a mistake: refused in one line. An NxD tag becomes nxdtrain's format."""
    nxd_tag = (ckpt.root / OPTIM_DIR).is_dir() and not is_training_tag(ckpt.root)
    if flags.given() or new != old or nxd_tag or any(changes):
        return
    raise ConversionError(
        f"reshard to the same layout (tp {new.tp} x pp {new.pp}, vpp {new.vpp}, {new.attention.value}, as "
        f"{ckpt.root} has): give --tp/--pp/--vpp/--qkv-linear/... for the new layout (or --xser, --dtype, "
        "--optimizer-format, --dp, --zero1 to change something else)")


def _reshard_training(ckpt: Any, spec: ModelSpec, old: ParallelLayout, *, dp: int | None,
                      zero1: bool | None, weights_only: bool, optimizer_format: str,
                      options: RunOptions, new: ParallelLayout) -> TrainingTag | None:
    """The training state that moves with the weights (nxdtrain's tag, or NxD's own into nxdtrain's format), or
    None; flags that place optimizer state are refused where there is none."""
    training = None
    parted = options.part[1] > 1
    if not weights_only and is_training_tag(ckpt.root):
        training = TrainingTag.open(ckpt, spec, old, dp=dp, zero1=zero1, io=options.io,
                                    optim=nxdtrain_optimizer(ckpt),  # a part: its own ranks' files added below
                                    only={(0, 0)} if parted else None)
    elif not weights_only and (ckpt.root / OPTIM_DIR).is_dir():  # NxD's own tag: into nxdtrain's format
        training = TrainingTag.open_nxd(ckpt, dp=dp, zero1=zero1, io=options.io)
    if training is None and (dp is not None or zero1 is not None or optimizer_format != "nxdtrain"):
        flags = "--dp and --zero1 place" if dp is not None or zero1 is not None else "--optimizer-format nxd writes"
        raise ConversionError(f"{ckpt.root}: {flags} optimizer state; "
                              + ("--weights-only writes none" if weights_only else "this is not a training "
                                 "tag (no optim/)"))
    if training is not None:
        _refuse_ep_state(old, new, parted, training)
    return training


def _refuse_ep_state(old: ParallelLayout, new: ParallelLayout, parted: bool,
                     training: TrainingTag) -> None:
    """What an expert-parallel training tag's reshard does not do yet, refused before anything is written."""
    ep = max(old.ep, new.ep)  # NxD's own EP files' cases: ckptconv.training.nxd_format.write_ep refuses them
    if ep > 1 and parted:
        training.optim.close()
        raise ConversionError(f"{training.ckpt.root}: ep {ep}, --part: a training tag with ep > 1 is resharded by "
                              "one process (run it without --part)")


def _param_groups(training: TrainingTag, rule: str | None, asked: str | None, notes: list[str]) -> str:
    """The param-group rule of an NxD-format tag: NxD's tag keeps its own groups unless ``--nxd-param-groups``
    regroups them (said in the notes)."""
    saved = rule_of(training.optim.optim) if isinstance(training.optim, NxdTagOptimizer) else None
    if asked is None and saved is not None:  # NxD's tag: its own groups, which its run rebuilds
        notes.append(f"param groups as NxD's tag has them ({describe_rule(saved)})")
        return saved
    if saved is not None and rule != saved:
        notes.append(f"param groups regrouped by --nxd-param-groups {rule}: NxD's tag had "
                     f"{describe_rule(saved)}; the NxD run that loads it must build the new groups")
    return rule or DEFAULT_RULE


def _write_reshard(plan: Plan, ckpt: Any, training: TrainingTag | None, spec: ModelSpec, old: ParallelLayout,
                   new: ParallelLayout, out: Path, run: Run, spec_: FinalizeSpec,
                   target_flavour: Flavour, kv_replicas: str, sources: list[Path]) -> Result:
    """Write the resharded weights and, of a training tag, its optimizer files read beside them (a part: its own
    files only); an NxD-format tag's indices read back as written."""
    reader: Any = ckpt
    sinks = sink_factory(target_flavour, ep=new.ep)
    part: TagPart | None = None
    options, notes = run.options, run.notes
    with training or contextlib.nullcontext():  # a training tag: its optimizer files closed after the write
        if training is not None:  # the optimizer files join the plan, read beside the weights
            if options.part[1] > 1:  # one of several parts: the optimizer state of its own files only
                part = TagPart.split(plan, options.part, dp=training.dp, zero1=training.zero1)
                check_files_read(ckpt, spec, old,
                                 [shard_file(tp_rank=tp, pp_rank=pp) for tp, pp in part.sources()])
                everything, whole = planned_outputs(plan, spec_), plan
                if isinstance(training.optim, TagOptimizer):  # nxdtrain's files: those this part reads
                    training.optim.widen(part.sources())
                plan = part.planned()
            plan, reader = training.extend(plan, spec_, new, notes)
            if part is not None:
                training.read_back_all(whole.files, new)  # the last part reads back every part's files
                plan = part.narrowed(plan)
                part = part.declaring(everything + planned_outputs(plan, spec_))
            sinks = training.sinks(sinks, split=target_flavour is Flavour.XSER_SPLIT)
        result = run.write(plan, reader, out, sinks, spec_, kv_replicas, sources=sources, part_of=part)
    if training is not None and training.written is not None and not result.skipped and result.finalized:
        check_written(out, training.written)  # every optimizer index read back as intended
        notes.append(f"read back with NxD's optimizer reader: every index named as written "
                     f"({describe_rule(training.written.rule)})")
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
