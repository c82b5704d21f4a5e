"""``to_dcp`` and ``from_dcp``: TorchTitan's DCP checkpoints from and to HF or NxD, through the one executor.

``to_dcp`` writes the model in TorchTitan's llama3 layout (pinned: ``titan_names.TITAN_VERSION``),
loadable with ``checkpoint.initial_load_path=OUT``; ``from_dcp`` reads a TorchTitan checkpoint's
model back to HF safetensors or to NxD shards at any layout. Optimizer, scheduler and train state
are not carried yet (their keys are recognised, reported and left).

Example:
    >>> import ckptconv
    >>> ckptconv.to_dcp("llama-hf", "llama-dcp")                                  # doctest: +SKIP
    >>> ckptconv.from_dcp("titan/checkpoint", "llama-nxd", to="nxd", tp=8,
    ...                   attention="qkv_linear", fuse_qkv=True, config="llama-hf/config.json")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import torch

from ckptconv.api import (
    Result,
    RunOptions,
    _convert,
    _dtype_name,
    _fingerprint,
    _hf_side_copies,
    _identity,
    _kept_hf_files,
    dtype_policy,
    target_layout,
)
from ckptconv.errors import ConversionError, choice
from ckptconv.execute import replica_bands
from ckptconv.finalize import FinalizeSpec
from ckptconv.hub import resolve_hf
from ckptconv.io.dcp import METADATA as DCP_METADATA
from ckptconv.io.dcp import DcpCheckpoint, encode_metadata, layout_items, save_id_of, sink_factory
from ckptconv.io.hf import CONFIG, HfCheckpoint, config_text, index_text
from ckptconv.io.nxd import Flavour
from ckptconv.io.nxd import sink_factory as nxd_sink_factory
from ckptconv.io.safetensors_sink import safetensors_sink
from ckptconv.layout import HF_FILES_DIR, MODEL_DIR, Attention, Hardware, Trn2KvLayout
from ckptconv.mapping import check_source_shapes, stores_lm_head
from ckptconv.model_spec import ModelSpec
from ckptconv.nxd_source import model_spec_of, open_nxd
from ckptconv.plan import Plan, hf_sources
from ckptconv.plan_dcp import DEFAULT_FILE_SIZE, hf_dtypes_of, plan_dcp_to_hf, plan_dcp_to_nxd, plan_to_dcp, tied_copies
from ckptconv.progress import note
from ckptconv.titan_names import (
    STATE_FAMILIES,
    TITAN_MODEL,
    TITAN_VERSION,
    family,
    is_known_state_key,
    optimizer_params,
    planner_path,
    titan_params,
)

TITAN = {"torchtitan": TITAN_VERSION, "model": TITAN_MODEL}


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
    hints: dict[str, Any] | None = None,
    revision: str | None = None,
    dtype: str = "keep",
    max_file_size: int = DEFAULT_FILE_SIZE,
    kv_replicas: str = "error",
    options: RunOptions | None = None,
) -> Result:
    """Write the model of ``src`` (an HF dir/file or hub id, a converted NxD dir, a training tag or a
    checkpoint root) as a TorchTitan llama3 DCP checkpoint in ``out``."""
    options = options or RunOptions()
    started = time.monotonic()
    out = Path(out)
    notes: list[str] = []
    if kv_replicas not in ("error", "first"):
        raise ConversionError(f"--kv-replicas must be 'error' or 'first' for to-dcp, got {kv_replicas!r}")
    if _is_hf_source(src):
        given = sorted(k for k, v in (hints or {}).items() if v is not None)
        if given:
            raise ConversionError(f"{src}: an HF model has no parallel layout; layout flags ({', '.join(given)}) "
                                  "describe NxD sources only")
        hf_src = resolve_hf(src, revision=revision, quiet=options.quiet)
        with HfCheckpoint(hf_src, config=config, io=options.io) as hf:
            with_inv_freq = check_source_shapes(hf.spec, hf.shapes(), str(hf_src))
            if with_inv_freq:
                notes.append("rotary inv_freq buffers dropped (TorchTitan recomputes its RoPE cache)")
            plan = plan_to_dcp(hf.spec, hf.dtypes(), dtype_policy=dtype_policy(dtype), max_file_size=max_file_size)
            fingerprint = _fingerprint("dcp", TITAN, dtype, max_file_size, _identity(hf.weight_files()))
            spec_ = _dcp_finalize(plan, hf.spec, fingerprint, _hf_side_copies(hf, notes), None)
            result = _convert(plan, hf, out, sink_factory(layout_items(plan.files)), options, spec_, "to-dcp",
                              sources=[Path(hf_src)])
        layout_json = None
    else:
        if revision is not None:
            raise ConversionError(f"--revision is for hub ids; {src} is a local NxD checkpoint")
        ckpt, spec, layout, with_inv_freq, read_notes = open_nxd(src, config=config, hints=hints, io=options.io,
                                                                  check=options.check)
        notes += read_notes
        with ckpt:
            for line in read_notes:
                note(line, quiet=options.quiet)
            shard_dtypes = ckpt.dtypes()
            tiles, replicas = hf_sources(spec, layout, with_inv_freq=with_inv_freq,
                                         lm_head_copy=stores_lm_head(spec, shard_dtypes))
            plan = plan_to_dcp(spec, hf_dtypes_of(tiles, shard_dtypes), dtype_policy=dtype_policy(dtype),
                               max_file_size=max_file_size, tiles=tiles, replicas=replicas)
            fingerprint = _fingerprint("dcp", TITAN, layout.to_json(), dtype, max_file_size, kv_replicas,
                                       _identity(sorted(ckpt.files.values())))
            copies = _kept_hf_files(ckpt.root, notes, into=f"{HF_FILES_DIR}/")
            spec_ = _dcp_finalize(plan, spec, fingerprint, copies, layout.to_json())
            result = _convert(plan, ckpt, out, sink_factory(layout_items(plan.files)), options, spec_, "to-dcp",
                              kv_replicas, sources=[Path(src), ckpt.root])
        layout_json = layout.to_json()
    result.notes[:0] = notes
    result.layout = layout_json
    result.seconds = time.monotonic() - started
    return result


def _dcp_finalize(plan: Plan, spec: ModelSpec, fingerprint: str, copies: list[tuple[str, str]],
                  source_layout: dict[str, Any] | None) -> FinalizeSpec:
    """What completes a DCP output once its data files exist: ``.metadata`` (what makes it loadable),
    the HF files kept under ``hf/``, then ``ckptconv.json``."""
    metadata = encode_metadata(layout_items(plan.files), planner_path, save_id_of(fingerprint))
    extra: dict[str, Any] = dict(TITAN)
    if source_layout is not None:
        extra["from_layout"] = source_layout
    return FinalizeSpec(
        fingerprint,
        metadata=dict(kind="dcp", hf_config=spec.config, dtype=_dtype_name(plan), with_inv_freq=False,
                      fingerprint=fingerprint, extra=extra),
        blobs={DCP_METADATA: base64.b64encode(metadata).decode()},
        copies=copies,
    )


# --------------------------------------------------------------------------------------------
# Out of DCP


def open_dcp(src: str | Path, *, config: str | Path | None = None, io: str = "read",
             check: bool = True) -> tuple[DcpCheckpoint, ModelSpec, list[str]]:
    """Open a TorchTitan DCP checkpoint with its model spec; its keys must be TorchTitan's llama3
    keys for that spec (else an error naming the first unknown key). Returns notes to show."""
    ckpt = DcpCheckpoint(src, io=io, check=check)
    try:
        notes = [f"reading {ckpt.root} ({ckpt.found_as})"]
        spec = model_spec_of(ckpt.root, ckpt.metadata, config, missing="a TorchTitan checkpoint records no HF "
                             "config; pass --config PATH/config.json (the model's HF config)")
        notes += check_titan_keys(ckpt, spec)
    except BaseException:
        ckpt.close()
        raise
    return ckpt, spec, notes


def check_titan_keys(ckpt: DcpCheckpoint, spec: ModelSpec) -> list[str]:
    """Every key is a TorchTitan llama3 model key of this config (shape included) or one of the
    state TorchTitan saves beside it; the model keys are all there. Returns what is left behind."""
    expected = {p.key: p.shape for p in titan_params(spec)}
    trained = set(optimizer_params(spec))
    left: dict[str, int] = {}
    where = f"{ckpt.root / DCP_METADATA}"
    for key in ckpt.keys():
        if family(key) != "model":
            if not is_known_state_key(key, trained):
                raise ConversionError(f"{where}: unknown key {key!r}: not in TorchTitan {TITAN_VERSION}'s "
                                      f"{TITAN_MODEL} layout for this config (first unknown key)")
            left[family(key)] = left.get(family(key), 0) + 1
            continue
        if key not in expected:
            raise ConversionError(f"{where}: unknown key {key!r}: not a TorchTitan {TITAN_VERSION} {TITAN_MODEL} "
                                  f"model key for this config (first unknown key)")
        entry = ckpt.entry(key)
        if entry.dtype is None or entry.size != expected[key]:
            found = "a value" if entry.dtype is None else f"shape {list(entry.size)}"
            raise ConversionError(f"{where}: {key!r} is {found}; the config implies shape {list(expected[key])}")
    missing = [k for k in expected if k not in ckpt.entries]
    if missing:
        raise ConversionError(f"{where}: missing model key {missing[0]!r} ({len(missing)} missing); "
                              "not a TorchTitan llama3 checkpoint of this config")
    group = tied_copies(spec)
    for first, other, _ in replica_bands(ckpt, group) if group is not None else ():
        if not torch.equal(first, other):
            diff = (first.float() - other.float()).abs().max().item()
            raise ConversionError(f"{where}: the config ties the embeddings, but 'tok_embeddings.weight' and "
                                  f"'lm_head.weight' differ (max abs difference {diff:.3g}); pass --config with "
                                  "the config of the model that was trained (tie_word_embeddings false)")
    return [f"not carried (model weights only): {n} {fam} key(s)" for fam in STATE_FAMILIES if (n := left.get(fam))]


def from_dcp(
    src: str | Path,
    out: str | Path,
    *,
    to: str = "hf",
    config: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    kv_size_multiplier: int = 1,
    attention: str | Attention = Attention.SEPARATE,
    fuse_qkv: bool = False,
    hw_backend: str | Hardware = Hardware.TRN1,
    trn2_kv_layout: str | Trn2KvLayout = Trn2KvLayout.RUNTIME,
    flavour: str | Flavour = Flavour.PLAIN,
    dtype: str = "keep",
    max_shard_size: int = 5 * 10**9,
    options: RunOptions | None = None,
) -> Result:
    """A TorchTitan DCP checkpoint's model (``src``: a step directory, or a checkpoint folder: its
    newest ``step-N``) as HF safetensors (``to="hf"``) or NxD shards of the given layout (``to="nxd"``)."""
    options = options or RunOptions()
    started = time.monotonic()
    out = Path(out)
    if to not in ("hf", "nxd"):
        raise ConversionError(f"--to must be hf or nxd, got {to!r}")
    ckpt, spec, notes = open_dcp(src, config=config, io=options.io, check=options.check)
    with ckpt:
        for line in notes:
            note(line, quiet=options.quiet)
        policy = dtype_policy(dtype)
        identity = _identity([ckpt.root / DCP_METADATA, *ckpt.data_files()])
        kept = _kept_hf_files(ckpt.root, notes, into="" if to == "hf" else f"{HF_FILES_DIR}/",
                              skip=CONFIG if to == "hf" else "")
        if to == "hf":
            plan = plan_dcp_to_hf(spec, ckpt.dtypes(), max_shard_size=max_shard_size, dtype_policy=policy)
            fingerprint = _fingerprint("from-dcp-hf", dtype, max_shard_size, identity)
            spec_ = FinalizeSpec(
                fingerprint,
                metadata=dict(kind="hf", hf_config=spec.config, dtype=_dtype_name(plan), with_inv_freq=False,
                              fingerprint=fingerprint, extra={"from": TITAN}),
                texts={CONFIG: config_text(spec.config, plan.files[0].tensors[0].dtype), **index_text(plan.files)},
                copies=kept,
            )
            result = _convert(plan, ckpt, out, safetensors_sink, options, spec_, "from-dcp",
                              sources=[Path(src), ckpt.root])
            layout_json = None
        else:
            layout = target_layout(tp=tp, pp=pp, vpp=vpp, kv_size_multiplier=kv_size_multiplier, attention=attention,
                                   fuse_qkv=fuse_qkv, hw_backend=hw_backend, trn2_kv_layout=trn2_kv_layout)
            layout.check_model(spec)
            layout = layout.padded_for(spec)
            target = choice(Flavour, flavour, "flavour")
            plan = plan_dcp_to_nxd(spec, layout, ckpt.dtypes(), dtype_policy=policy)
            fingerprint = _fingerprint("from-dcp-nxd", layout.to_json(), dtype, target.value, identity)
            if config is not None and not any(rel == f"{HF_FILES_DIR}/{CONFIG}" for _, rel in kept):
                kept.append((str(Path(config).resolve()), f"{HF_FILES_DIR}/{CONFIG}"))
            spec_ = FinalizeSpec(
                fingerprint,
                metadata=dict(kind="nxd", hf_config=spec.config, layout=layout.to_json(), flavour=target.value,
                              dtype=_dtype_name(plan), with_inv_freq=False, fingerprint=fingerprint,
                              extra={"from": TITAN}),
                copies=kept,
            )
            result = _convert(plan, ckpt, out, nxd_sink_factory(target), options, spec_, "from-dcp",
                              sources=[Path(src), ckpt.root])
            layout_json = layout.to_json()
    result.notes[:0] = notes
    result.layout = layout_json
    result.seconds = time.monotonic() - started
    return result
