"""``to_dcp`` and ``from_dcp``: TorchTitan's DCP checkpoints from and to HF or NxD, through the one executor.

``to_dcp`` writes the model in TorchTitan's llama3 or qwen3 (dense or MoE) layout (pinned:
``titan_names.TITAN_VERSION``), loadable with ``checkpoint.initial_load_path=OUT``, and of a training tag its
AdamW state, schedule position and step (``plan_dcp.plan_titan_optimizer``, ``titan_state``); ``from_dcp`` reads a TorchTitan
checkpoint's model back to HF safetensors or to NxD shards at any layout, and a full checkpoint's
state into an nxdtrain training tag (``plan_dcp.plan_dcp_to_tag``).

Example:
    >>> import ckptconv
    >>> ckptconv.to_dcp("llama-hf", "llama-dcp")                                  # doctest: +SKIP
    >>> ckptconv.from_dcp("titan/checkpoint", "llama-nxd", to="nxd", tp=8,
    ...                   attention="qkv_linear", fuse_qkv=True, config="llama-hf/config.json")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptconv.commands.api import (
    dequantized,
    dtype_policy,
    hf_side_copies,
    kept_hf_files,
    new_layout,
    tokenizer_identity,
    with_tokenizer,
)
from ckptconv.commands.src_kind import open_hf
from ckptconv.commands.steps import dtype_name, input_files
from ckptconv.core.families.deepseek_v3 import BIAS
from ckptconv.core.layout import HF_FILES_DIR, MODEL_DIR, Attention, Hardware, ParallelLayout, Trn2KvLayout
from ckptconv.core.layout_flags import LayoutOverrides, as_hints, with_api_kwargs
from ckptconv.core.mapping import check_source_shapes, stores_lm_head
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import DtypePolicy, Plan, hf_sources
from ckptconv.engine.execute import replica_bands
from ckptconv.engine.finalize import FinalizeSpec
from ckptconv.engine.options import RunOptions
from ckptconv.engine.outdir import check_separate
from ckptconv.engine.run import Result, Run, file_identity, fingerprint
from ckptconv.engine.snapshots import Snapshots, export_every
from ckptconv.engine.tags import complete_as_tag, run_record
from ckptconv.errors import ConversionError, choice
from ckptconv.io.dcp import METADATA as DCP_METADATA
from ckptconv.io.dcp import DcpCheckpoint, encode_metadata, layout_items, save_id_of, sink_factory, step_dirs
from ckptconv.io.hf import CONFIG, config_text, has_tokenizer, index_text
from ckptconv.io.nxd import Flavour
from ckptconv.io.nxd_write import sink_factory as nxd_sink_factory
from ckptconv.io.quantized import plain_config
from ckptconv.io.safetensors_sink import safetensors_sink
from ckptconv.sources.hub import resolve_hf
from ckptconv.sources.nxd import model_spec_of, open_nxd
from ckptconv.titan.config_file import CONFIG_FILE, TitanRun, config_module, run_command
from ckptconv.titan.deepseek_v3 import carried_mtp, check_mtp_copies, mtp_found
from ckptconv.titan.experts import bias_note, check_expert_bias
from ckptconv.titan.export import TitanState, open_training, refuse_flags_without_state, titan_state
from ckptconv.titan.names import (
    LR_SCHEDULER_KEYS,
    OPTIMIZER_STATE_FIELDS,
    PARAM_GROUP_FIELDS,
    STATE_FAMILIES,
    TITAN_VERSION,
    TRAIN_STATE_KEYS,
    family,
    is_known_state_key,
    optimizer_key,
    optimizer_params,
    param_group_key,
    planner_path,
    titan_model,
    titan_params,
    trained_params,
)
from ckptconv.titan.plans import (
    DEFAULT_FILE_SIZE,
    hf_dtypes_of,
    plan_dcp_to_hf,
    plan_dcp_to_nxd,
    plan_dcp_to_tag,
    plan_to_dcp,
    tied_copies,
)
from ckptconv.titan.state import ScheduleFlags, tag_state
from ckptconv.training.nxdtrain_format.state import (
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    TagReader,
)
from ckptconv.training.tag_reshard import TrainingTag


def titan_record(spec: ModelSpec) -> dict[str, str]:
    """What ``ckptconv.json`` records of the TorchTitan side (the version, its model for this family)."""
    return {"torchtitan": TITAN_VERSION, "model": titan_model(spec).name}
NEEDS_TO_NXD = "pass --to nxd to write NxD shards of that layout"


def _is_hf_source(src: str | Path) -> bool:
    """An HF model (directory with config.json, a state-dict file, or a hub id) rather than NxD shards."""
    path = Path(src)
    if not path.exists():
        return True  # a hub id (resolve_hf says so if it is not one)
    return path.is_file() or ((path / CONFIG).is_file() and not (path / MODEL_DIR).is_dir())


def to_dcp(
    src: str | Path,
    out: str | Path,
    *,
    config: str | Path | None = None,
    hints: dict[str, Any] | LayoutOverrides | None = None,
    revision: str | None = None,
    dtype: str = "keep",
    max_file_size: int = DEFAULT_FILE_SIZE,
    kv_replicas: str = "error",
    weights_only: bool = False,
    masters: bool | None = None,
    schedule: ScheduleFlags | None = None,
    drop_mtp: bool = False,
    tokenizer: str | Path | None = None,
    options: RunOptions | None = None,
) -> Result:
    """Write the model of ``src`` (an HF dir/file or hub id, a converted NxD dir, a training tag or a
    checkpoint root) as a TorchTitan DCP checkpoint in ``out`` (TorchTitan's llama3 or qwen3), with
    ``out/torchtitan_config.py``, the TorchTitan run that continues it; of a training tag (nxdtrain's, NxD's
    examples', NxDT's; unless ``weights_only``) also its AdamW state, lr schedule position and step, as TorchTitan's
    own keys. ``schedule``: a schedule the tag does not record (nxdtrain's flag names).
    ``masters``: the weights from a bf16 run's fp32 masters (default: when present), as for ``to_hf``.
    ``drop_mtp``: leave out the multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``).
    Quantized HF weights (FP8 blocks) are dequantized as they stream, to bf16 unless ``dtype`` names another.
    ``tokenizer``: a directory whose tokenizer files go into ``out/hf/`` (the config's ``HF_ASSETS_PATH``) instead of
    the source's (a source without one is said in the notes)."""
    run = Run("to-dcp", options)
    out = Path(out)
    flags = schedule or ScheduleFlags()
    if kv_replicas not in ("error", "first"):
        raise ConversionError(f"--kv-replicas must be 'error' or 'first' for to-dcp, got {kv_replicas!r}")
    if _is_hf_source(src):
        given = sorted(as_hints(hints).given())
        if masters is not None:
            raise ConversionError(f"--masters/--no-masters choose a training tag's weights; {src} is an HF model")
        if given:
            raise ConversionError(f"{src}: an HF model has no parallel layout; layout flags ({', '.join(given)}) "
                                  "describe NxD sources only")
        refuse_flags_without_state(flags, str(src), weights_only)
        result, layout_json = _hf_to_dcp(src, out, config, revision, dtype, max_file_size, run, drop_mtp,
                                         tokenizer), None
    else:
        if revision is not None:
            raise ConversionError(f"--revision is for hub ids; {src} is a local NxD checkpoint")
        result, layout_json = _nxd_to_dcp(src, out, config=config, hints=hints, dtype=dtype,
                                          max_file_size=max_file_size, kv_replicas=kv_replicas,
                                          weights_only=weights_only, masters=masters, flags=flags, run=run,
                                          tokenizer=tokenizer)
    run.notes.append(f"continue in TorchTitan (set the SET names in {out / CONFIG_FILE} first: data, tokenizer, "
                     f"batch, steps, parallelism, attention): {run_command(str(out.resolve()))}")
    return run.finish(result, layout_json)


def _config_text(spec: ModelSpec, titan_run: TitanRun | None, what: str, *, dtypes: dict[str, torch.dtype],
                 masters: bool, copies: list[tuple[str, str]], notes: list[str], out: Path) -> dict[str, str]:
    """``torchtitan_config.py`` (refused here, before anything is written, where TorchTitan cannot run the model),
    with the source's precision and whether ``hf/`` holds a tokenizer (said in the notes when it does not)."""
    tokenizer = has_tokenizer([Path(rel).name for _, rel in copies])
    if not tokenizer:
        notes.append(f"no tokenizer: {out / HF_FILES_DIR}/ holds none, and TorchTitan needs one at HF_ASSETS_PATH "
                     "(tokenizer.json, or vocab + merges); pass --tokenizer DIR, or set HF_ASSETS_PATH in "
                     f"{out / CONFIG_FILE}")
    return {CONFIG_FILE: config_module(spec, titan_run, what=what, precision=_precision(dtypes, masters),
                                       tokenizer=tokenizer)}


def _precision(dtypes: dict[str, torch.dtype], masters: bool) -> str:
    """The compute dtype of the source's run: float32 when every floating weight is (a bf16 run's fp32 masters
    read as its weights do not count), else TorchTitan's default bfloat16."""
    floating = {d for d in dtypes.values() if d.is_floating_point}
    return "float32" if floating == {torch.float32} and not masters else "bfloat16"


def _model_only(notes: list[str], out: Path, why: str) -> None:
    notes.append(f"model-only DCP ({why}): TorchTitan loads it with checkpoint.initial_load_model_only=true "
                 f"(as {out / CONFIG_FILE} does) and starts its optimizer and schedule afresh")


def _hf_to_dcp(src: str | Path, out: Path, config: str | Path | None, revision: str | None, dtype: str,
               max_file_size: int, run: Run, drop_mtp: bool, tokenizer: str | Path | None) -> Result:
    """An HF model as a TorchTitan DCP checkpoint (the model only)."""
    options, notes = run.options, run.notes
    hf_src = resolve_hf(src, revision=revision, quiet=options.quiet)
    with open_hf(hf_src, config=config, io=options.io) as hf:
        with_inv_freq = check_source_shapes(hf.spec, hf.shapes(), str(hf_src))
        spec, mtp_notes = carried_mtp(hf.spec, drop=drop_mtp)
        check_mtp_copies(hf, spec, str(hf_src))
        if with_inv_freq:
            notes.append("rotary inv_freq buffers dropped (TorchTitan recomputes its RoPE cache)")
        notes += bias_note(spec) + mtp_notes
        copies, plain = dequantized(hf, dtype, hf_side_copies(hf, notes), notes)
        copies = with_tokenizer(copies, tokenizer, f"{HF_FILES_DIR}/", notes)
        texts = _config_text(spec, None, f"training from the HF model {src}", dtypes=hf.dtypes(), masters=False,
                             copies=copies, notes=notes, out=out) | plain
        _model_only(notes, out, "an HF model holds no optimizer state")
        plan = plan_to_dcp(spec, hf.dtypes(), dtype_policy=dtype_policy(dtype), max_file_size=max_file_size)
        identity = fingerprint("dcp", titan_record(spec), dtype, max_file_size, file_identity(hf.weight_files()),
                               drop_mtp, tokenizer_identity(tokenizer))
        spec_ = _dcp_finalize(plan, spec, identity, copies, None, texts=texts)
        return run.write(plan, hf, out, sink_factory(layout_items(plan.files)), spec_, sources=[Path(hf_src)])


def _nxd_to_dcp(src: str | Path, out: Path, *, config: str | Path | None, hints: Any, dtype: str,
                max_file_size: int, kv_replicas: str, weights_only: bool, masters: bool | None,
                flags: ScheduleFlags, run: Run, tokenizer: str | Path | None) -> tuple[Result, dict[str, Any]]:
    """NxD shards (of a training tag: with its AdamW state, schedule and step) as a TorchTitan DCP checkpoint."""
    options, read_notes = run.options, run.notes
    # the fp32 masters of a bf16 run (nxdtrain's or NxD's) are its weights, as for to-hf; NxD's optimizer stays open
    opened = open_nxd(src, config=config, hints=hints, io=options.io, check=options.check, masters=masters,
                      prefer_masters=True, keep_nxd_optimizer=True)
    ckpt, spec, layout = opened.ckpt, opened.spec, opened.layout
    read_notes += opened.notes
    with ckpt, contextlib.ExitStack() as stack:
        titan_model(spec)  # a family TorchTitan has no model for: refused before the tag's state is opened
        training = None if weights_only else open_training(ckpt, spec, layout, io=options.io)
        read_notes += bias_note(spec)
        if training is not None:
            stack.enter_context(training)
        else:
            refuse_flags_without_state(flags, str(src), weights_only)
            if not weights_only:
                _model_only(read_notes, out, f"{ckpt.root} is not a training tag")
        shard_dtypes = ckpt.dtypes()
        tiles, replicas = hf_sources(spec, layout,
                                     lm_head_copy=stores_lm_head(spec, shard_dtypes))
        state = (TitanState() if training is None else
                 titan_state(spec, tiles, replicas, training, flags, str(ckpt.root)))
        read_notes += state.notes
        plan = plan_to_dcp(spec, hf_dtypes_of(tiles, shard_dtypes), dtype_policy=dtype_policy(dtype),
                           max_file_size=max_file_size, tiles=tiles, replicas=replicas + state.replicas,
                           state=state.tensors)
        placed = {plan.files[0].path: state.values}  # the small values lead the first file, as DCP's writer puts them
        identity = fingerprint("dcp", titan_record(spec), layout.to_json(), dtype, max_file_size, kv_replicas,
                               file_identity(input_files(ckpt)), ckpt.masters_identity(),
                               None if training is None else training.identity(), flags.given(),
                               tokenizer_identity(tokenizer))
        copies = with_tokenizer(kept_hf_files(ckpt.root, read_notes, into=f"{HF_FILES_DIR}/"), tokenizer,
                                f"{HF_FILES_DIR}/", read_notes)
        texts = _config_text(spec, state.run, f"the run of {src}", dtypes=shard_dtypes,
                             masters=ckpt.masters_identity() is not None or any("master weights in" in n
                                                                                for n in opened.notes),
                             copies=copies, notes=read_notes, out=out)
        spec_ = _dcp_finalize(plan, spec, identity, copies, layout.to_json(), placed, texts=texts)
        reader = ckpt if training is None else TagReader(ckpt, training.optim)
        result = run.write(plan, reader, out, sink_factory(layout_items(plan.files, placed)), spec_, kv_replicas,
                           sources=[Path(src), ckpt.root])
    return result, layout.to_json()


def _dcp_finalize(plan: Plan, spec: ModelSpec, identity: str, copies: list[tuple[str, str]],
                  source_layout: dict[str, Any] | None,
                  values: dict[str, dict[str, Any]] | None = None, *, texts: dict[str, str]) -> FinalizeSpec:
    """What completes a DCP output once its data files exist: ``.metadata`` (what makes it loadable),
    the HF files kept under ``hf/``, then ``ckptconv.json``."""
    metadata = encode_metadata(layout_items(plan.files, values), planner_path, save_id_of(identity))
    extra: dict[str, Any] = titan_record(spec)
    if source_layout is not None:
        extra["from_layout"] = source_layout
    return FinalizeSpec(
        identity,
        metadata=dict(kind="dcp", hf_config=plain_config(spec.config), dtype=dtype_name(plan), with_inv_freq=False,
                      fingerprint=identity, extra=extra),
        blobs={DCP_METADATA: base64.b64encode(metadata).decode()},
        texts=texts,
        copies=copies,
    )


# --------------------------------------------------------------------------------------------
# Out of DCP


def open_dcp(src: str | Path, *, config: str | Path | None = None, io: str = "read", check: bool = True,
             carried: tuple[str, ...] = (), left_as: str | None = None) -> tuple[DcpCheckpoint, ModelSpec, list[str]]:
    """Open a TorchTitan DCP checkpoint with its model spec; its keys must be TorchTitan's llama3
    keys for that spec (else an error naming the first unknown key). Returns notes to show; ``left_as`` words the note
    on the state families outside ``carried`` (default: what a conversion does not carry)."""
    ckpt = DcpCheckpoint(src, io=io, check=check)
    try:
        notes = [f"reading {ckpt.root} ({ckpt.found_as})"]
        spec = mtp_found(model_spec_of(ckpt.root, ckpt.metadata, config, missing="a TorchTitan checkpoint records no "
                                       "HF config; pass --config PATH/config.json (the model's HF config)"), ckpt.keys())
        notes += check_titan_keys(ckpt, spec, carried, left_as)
    except BaseException:
        ckpt.close()
        raise
    return ckpt, spec, notes


def check_titan_keys(ckpt: DcpCheckpoint, spec: ModelSpec, carried: tuple[str, ...] = (),
                     left_as: str | None = None) -> list[str]:
    """Every key is a TorchTitan llama3 model key of this config (shape included) or one of the
    state TorchTitan saves beside it; the model keys are all there. Returns what is left behind
    (the state families not in ``carried``)."""
    expected = {p.key: p.shape for p in titan_params(spec)}
    trained = set(optimizer_params(spec))
    left: dict[str, int] = {}
    where = f"{ckpt.root / DCP_METADATA}"
    for key in ckpt.keys():
        if family(key) != "model":
            if not is_known_state_key(key, trained):
                raise ConversionError(f"{where}: unknown key {key!r}: not in TorchTitan {TITAN_VERSION}'s "
                                      f"{titan_model(spec).name} layout for this config (first unknown key)")
            left[family(key)] = left.get(family(key), 0) + 1
            continue
        if key not in expected:
            raise ConversionError(f"{where}: unknown key {key!r}: not a TorchTitan {TITAN_VERSION} {titan_model(spec).name} "
                                  f"model key for this config (first unknown key)")
        entry = ckpt.entry(key)
        if entry.dtype is None or entry.size != expected[key]:
            found = "a value" if entry.dtype is None else f"shape {list(entry.size)}"
            raise ConversionError(f"{where}: {key!r} is {found}; the config implies shape {list(expected[key])}")
    buffers = {p.key for p in titan_params(spec) if p.buffer}  # a run without load balancing has no expert_bias_E
    missing = [k for k in expected if k not in ckpt.entries and k not in buffers]
    if missing:
        raise ConversionError(f"{where}: missing model key {missing[0]!r} ({len(missing)} missing); "
                              f"not a TorchTitan {titan_model(spec).name} checkpoint of this config")
    group = tied_copies(spec)
    for first, other, _ in replica_bands(ckpt, group) if group is not None else ():
        if not torch.equal(first, other):
            diff = (first.float() - other.float()).abs().max().item()
            raise ConversionError(f"{where}: the config ties the embeddings, but 'tok_embeddings.weight' and "
                                  f"'lm_head.weight' differ (max abs difference {diff:.3g}); pass --config with "
                                  "the config of the model that was trained (tie_word_embeddings false)")
    if left_as is None:
        left_as = f"not carried ({'model weights only' if not carried else 'not read into an nxdtrain tag'})"
    return [f"{left_as}: {n} {fam} key(s)" for fam in STATE_FAMILIES
            if (n := left.get(fam)) and fam not in carried]


def check_titan_state(ckpt: DcpCheckpoint, spec: ModelSpec) -> None:
    """A full checkpoint holds every trained parameter's AdamW tensors (moments of its shape, a 0-dim step),
    its param-group values, the schedule and train state: else an error naming the first missing or wrong key."""
    where = f"{ckpt.root / DCP_METADATA}"
    for param in trained_params(spec):
        for field in OPTIMIZER_STATE_FIELDS:
            key, shape = optimizer_key(param.key, field), () if field == "step" else param.shape
            entry = ckpt.entries.get(key)
            if entry is None or entry.dtype is None or tuple(entry.size) != tuple(shape):
                found = "missing" if entry is None else "a value" if entry.dtype is None else f"shape {list(entry.size)}"
                raise ConversionError(f"{where}: {key!r} is {found}, expected a tensor of shape {list(shape)} (AdamW "
                                      "state of a TorchTitan run); --weights-only takes the model alone")
        for key in [param_group_key(param.key, f) for f in PARAM_GROUP_FIELDS] + [*LR_SCHEDULER_KEYS, *TRAIN_STATE_KEYS]:
            if key not in ckpt.entries:
                raise ConversionError(f"{where}: missing {key!r}; a full TorchTitan checkpoint has it (--weights-only "
                                      "takes the model alone)")


def from_dcp(
    src: str | Path,
    out: str | Path,
    *,
    to: str = "hf",
    config: str | Path | None = None,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    ep: int | None = None,
    kv_size_multiplier: int | None = None,
    attention: str | Attention | None = None,
    fuse_qkv: bool | None = None,
    hw_backend: str | Hardware | None = None,
    trn2_kv_layout: str | Trn2KvLayout | None = None,
    layout: LayoutOverrides | None = None,
    flavour: str | Flavour | None = None,
    dtype: str = "keep",
    max_shard_size: int = 5 * 10**9,
    weights_only: bool = False,
    consumed_samples: int | None = None,
    drop_expert_bias: bool = False,
    options: RunOptions | None = None,
) -> Result:
    """A TorchTitan DCP checkpoint's model (``src``: a step directory, or a checkpoint folder: its
    newest ``step-N``) as HF safetensors (``to="hf"``) or NxD shards of the given layout (``to="nxd"``).

    The layout (``to="nxd"``): the keywords (None: not given) or ``layout`` over the layout the DCP
    records (``ckptconv.json``'s ``from_layout``, written by ``to_dcp`` of NxD shards), else over tp 1 x
    pp 1; the kv multiplier not given is what tp needs.

    To NxD, a full checkpoint (with TorchTitan's AdamW state) becomes an nxdtrain training tag (unless
    ``weights_only``): shards, optimizer files, step, and ``consumed_samples`` as its data position.

    A Qwen3-MoE's ``expert_bias_E`` (TorchTitan's routing bias; HF has none) is dropped when zero; a trained one is
    refused unless ``drop_expert_bias`` (:mod:`ckptconv.titan.experts`)."""
    run = Run("from-dcp", options)
    options, notes = run.options, run.notes
    out = Path(out)
    flags = with_api_kwargs(layout, tp=tp, pp=pp, vpp=vpp, ep=ep, kv_size_multiplier=kv_size_multiplier,
                            attention=attention, fuse_qkv=fuse_qkv, hw_backend=hw_backend,
                            trn2_kv_layout=trn2_kv_layout)
    _check_from_dcp(to, flags, flavour, weights_only, consumed_samples)
    carried = ("optimizer", "lr_scheduler", "train_state") if to == "nxd" and not weights_only else ()
    ckpt, spec, dcp_notes = open_dcp(src, config=config, io=options.io, check=options.check, carried=carried)
    notes += dcp_notes
    with ckpt:  # the notes go into the result, printed once at the end (a refusal comes before any advice)
        notes += check_expert_bias(ckpt.read_rows, set(ckpt.keys()), spec, str(ckpt.root / DCP_METADATA),
                                   drop=drop_expert_bias)
        kept = kept_hf_files(ckpt.root, notes, into="" if to == "hf" else f"{HF_FILES_DIR}/",
                              skip=CONFIG if to == "hf" else "")
        if to == "hf":
            result = _dcp_to_hf(ckpt, spec, out, kept, dtype, max_shard_size, run, [Path(src), ckpt.root])
        else:
            if config is not None and not any(rel == f"{HF_FILES_DIR}/{CONFIG}" for _, rel in kept):
                kept.append((str(Path(config).resolve()), f"{HF_FILES_DIR}/{CONFIG}"))
            result = _dcp_to_nxd(ckpt, spec, out, kept, flags, choice(Flavour, flavour or Flavour.PLAIN, "flavour"),
                                 dtype, bool(carried), consumed_samples, run, [Path(src), ckpt.root])
    return run.finish(result)


def from_dcp_every(src: str | Path, out: str | Path, *, watch: float | None = None,
                   say: Callable[[str], None] | None = None, **kwargs: Any) -> Snapshots:
    """``from-dcp --every``: each completed ``step-N`` of the TorchTitan checkpoint folder ``src`` not yet exported,
    exported by :func:`from_dcp` (``kwargs``) into ``out/step-N`` (:func:`ckptconv.engine.snapshots.export_every`:
    resumable, idempotent; ``watch`` seconds: again until Ctrl-C)."""
    root, out = Path(src), Path(out)
    if (root / DCP_METADATA).is_file():
        raise ConversionError(f"{src}: is one step (it holds {DCP_METADATA}); --every takes the checkpoint folder "
                              "that holds the step-N directories")
    if not root.is_dir():
        raise ConversionError(f"{src}: no such directory")
    check_separate([root], out)
    return export_every(lambda: step_dirs(root, completed=True), lambda step, into: from_dcp(step, into, **kwargs),
                        out, watch=watch, say=say)


def _check_from_dcp(to: str, flags: LayoutOverrides, flavour: str | Flavour | None, weights_only: bool,
                    consumed_samples: int | None) -> None:
    """from_dcp's options that do not fit together, refused before anything opens."""
    if to not in ("hf", "nxd"):
        raise ConversionError(f"--to must be hf or nxd, got {to!r}")
    if to == "hf":
        flags.refuse_given(NEEDS_TO_NXD, ("--xser",) if flavour is not None else ())
    if consumed_samples is not None and (to != "nxd" or weights_only or consumed_samples < 0):
        raise ConversionError(f"--consumed-samples {consumed_samples}: the data position of an nxdtrain tag "
                              "(from-dcp --to nxd of a full checkpoint), an integer >= 0")


def _dcp_to_hf(ckpt: DcpCheckpoint, spec: ModelSpec, out: Path, kept: list[tuple[str, str]], dtype: str,
               max_shard_size: int, run: Run, sources: list[Path]) -> Result:
    """A DCP checkpoint's model as HF safetensors."""
    plan = plan_dcp_to_hf(spec, ckpt.dtypes(), max_shard_size=max_shard_size, dtype_policy=_keep_fp32_bias(dtype))
    identity = fingerprint("from-dcp-hf", dtype, max_shard_size,
                           file_identity([ckpt.root / DCP_METADATA, *ckpt.data_files()]))
    spec_ = FinalizeSpec(
        identity,
        metadata=dict(kind="hf", hf_config=plain_config(spec.config), dtype=dtype_name(plan), with_inv_freq=False,
                      fingerprint=identity, extra={"from": titan_record(spec)}),
        texts={CONFIG: config_text(spec.config, plan.files[0].tensors[0].dtype), **index_text(plan.files)},
        copies=kept,
    )
    return run.write(plan, ckpt, out, safetensors_sink, spec_, sources=sources)


def _keep_fp32_bias(dtype: str) -> DtypePolicy:
    """``--dtype``'s policy, except that DeepSeek-V3's router bias stays fp32 (as the release stores it and
    transformers keeps it: a bf16 bias would move the expert choice)."""
    policy = dtype_policy(dtype)
    return lambda key, stored: stored if key.endswith(BIAS) else policy(key, stored)


def _dcp_to_nxd(ckpt: DcpCheckpoint, spec: ModelSpec, out: Path, kept: list[tuple[str, str]],
                flags: LayoutOverrides, target: Flavour, dtype: str, carry_state: bool,
                consumed_samples: int | None, run: Run, sources: list[Path]) -> Result:
    """A DCP checkpoint's model as NxD shards; a full checkpoint's state (unless ``carry_state`` is False) as an
    nxdtrain training tag."""
    notes = run.notes
    recorded = (ckpt.metadata.extra.get("from_layout") if ckpt.metadata is not None else None)
    layout = new_layout(flags, spec, notes, None if recorded is None else ParallelLayout.from_json(recorded))
    policy = dtype_policy(dtype)
    full = carry_state and any(family(k) == "optimizer" for k in ckpt.keys())
    if full:
        check_titan_state(ckpt, spec)
    state = None if not full else tag_state(ckpt.read_value, spec, zero1=False,
                                            consumed_samples=consumed_samples, where=str(ckpt.root))
    if state is None:
        if consumed_samples is not None:
            raise ConversionError(f"{ckpt.root}: holds no optimizer state (a model-only checkpoint), so no "
                                  "training tag is written; drop --consumed-samples")
        plan = plan_dcp_to_nxd(spec, layout, ckpt.dtypes(), dtype_policy=policy)
    else:
        plan = plan_dcp_to_tag(spec, layout, ckpt.dtypes(), state.param_groups, dtype_policy=policy)
        notes += state.notes
    identity = fingerprint("from-dcp-nxd", layout.to_json(), dtype, target.value,
                           file_identity([ckpt.root / DCP_METADATA, *ckpt.data_files()]),
                           None if state is None else consumed_samples)
    spec_ = FinalizeSpec(
        identity,
        metadata=dict(kind="nxd", hf_config=spec.config, layout=layout.to_json(), flavour=target.value,
                      dtype=dtype_name(plan), with_inv_freq=False, fingerprint=identity,
                      extra={"from": titan_record(spec)}),
        copies=kept,
    )
    sinks = nxd_sink_factory(target, ep=layout.ep)
    if state is not None:  # a training tag: its side files, the run's record, then the markers
        complete_as_tag(spec_, side={USER_CONTENT_FILE: {**state.user_content, "layout": layout.to_json()},
                                     SCHEDULER_FILE: state.scheduler},
                        record=run_record(state.user_content["step"], state.user_content["consumed_samples"]))
        sinks = TrainingTag.sinks(sinks)
    result = run.write(plan, ckpt, out, sinks, spec_, sources=sources)
    result.layout = layout.to_json()  # from_dcp finishes the run (its notes once)
    return result
