"""Checks a run must pass before its first step, so that it fails in seconds with one line, not after hours.

``prepare`` calls them once before ``--nproc`` starts any process (and again in each rank, where they
are cheap): a run that would save nothing, an ``--export-hf`` target that the export at the end would
refuse, directories this user cannot write, an MoE run its experts cannot take (:func:`moe_refusal`).

    >>> from nxdtrain.config.options import TrainConfig
    >>> config = TrainConfig.from_flat({"resume": "llama-nxd", "data": "synthetic", "no_checkpoint": True})
    >>> check_saves(config)  # allowed: asked for
    >>> synthetic_notice(config)[:29]
    'training on synthetic data: -'
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptconv.core import HF_FILES_DIR, ModelSpec
from ckptconv.engine import TMP_DIR
from ckptconv.errors import ConversionError
from ckptconv.io import CONFIG, METADATA_FILE, Metadata, read_metadata
from ckptconv.training import ep_fits
from nxdtrain.config.options import SYNTHETIC, TrainConfig
from nxdtrain.errors import TrainError


def check_saves(config: TrainConfig) -> None:
    """Refuse a run without ``--checkpoint-dir`` unless ``--no-checkpoint`` says that is intended."""
    ckpt = config.checkpoint
    if not ckpt.checkpoint_dir and not ckpt.no_checkpoint:
        raise TrainError("no --checkpoint-dir: this run would save nothing and its trained weights would be lost; "
                         "pass --checkpoint-dir DIR, or --no-checkpoint to train without saving")


def synthetic_notice(config: TrainConfig) -> str | None:
    """What rank 0 says when the rows are random tokens rather than a corpus (None: real data)."""
    if config.data.data != SYNTHETIC:
        return None
    return ("training on synthetic data: --data synthetic, so the rows are random tokens from --seed, not a "
            "corpus; pass --data PATH to train on your data")


def check_writable(path: str | Path, label: str) -> None:
    """``path`` can be created or written: its nearest existing ancestor is a directory this user may write."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise TrainError(f"{label} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TrainError(f"{label} {path}: {existing} is not writable by this user")


def check_export_target(out: str | Path, label: str) -> None:
    """An HF export may go to ``out``: absent, empty, or an earlier HF export (which the export replaces).

    Anything else is refused here, before training, instead of by the export after the last step.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise TrainError(f"{label} {out}: exists and is not a directory; choose a new directory")
    # ckptconv's own temporary directory is an interrupted export, which the export resumes
    held = sorted(p.name for p in path.iterdir() if p.name != TMP_DIR) if path.is_dir() else []
    if held:
        meta = _metadata_or_none(path)
        if meta is None or meta.kind != "hf":
            names = ", ".join(held[:3])
            raise TrainError(f"{label} {out}: not empty and not an earlier HF export (holds {names}); "
                             "choose a new directory or empty this one")
    check_writable(path, label)


def _metadata_or_none(path: Path) -> Metadata | None:
    try:
        return read_metadata(path)
    except ConversionError:  # an unreadable ckptconv.json is not an export of ours either
        return None


def check_model_config(root: Path, hf_config: str | None = None, *, takes_hf_config: bool = True) -> None:
    """The shards under ``root`` come with their model config (ckptconv.json or hf/config.json), or
    ``--hf-config`` gives it; not both (which would win is a guess). ``takes_hf_config``: whether the command has
    that flag (``nxdtrain export`` has not), so the hint names only what the user can do.

    Said here in nxdtrain's words: ckptconv's own message suggests its --config flag, which nxdtrain
    does not have (nxdtrain's --config is the run's YAML).
    """
    meta = _metadata_or_none(root)
    recorded = (str(root / METADATA_FILE) if meta is not None and meta.hf_config
                else str(root / HF_FILES_DIR / CONFIG) if (root / HF_FILES_DIR / CONFIG).is_file() else None)
    if hf_config is not None:
        if recorded is not None:
            raise TrainError(f"--hf-config {hf_config}: {root} records its model config ({recorded}); drop "
                             "--hf-config (it is for tags without one)")
        if not Path(hf_config).is_file():
            raise TrainError(f"--hf-config {hf_config}: no such file (the HF model's config.json)")
        return
    if recorded is not None:
        return
    fix = (f"pass --hf-config PATH/config.json (the HF model's), or copy it to {root / HF_FILES_DIR / CONFIG}"
           if takes_hf_config else f"copy the HF model's config.json to {root / HF_FILES_DIR / CONFIG}")
    raise TrainError(f"{root} has no {METADATA_FILE} and no {HF_FILES_DIR}/{CONFIG}, so the model is unknown; {fix}")


def moe_refusal(spec: ModelSpec, ep: int, *, dp: int, cp: int, device: str,
            optimizer_format: str = "nxdtrain", shards: bool = False, zero1: bool = False) -> str | None:
    """Why this MoE run (or ``--ep`` on a dense model) cannot run, in one line; None: it can. Before any process."""
    if not spec.experts:  # --ep on a dense model: the layout's own check refuses it
        return None
    if not ep_fits(dp, ep):
        return f"--ep {ep} must divide the data-parallel size {dp} (expert parallelism is carved out of dp)"
    if shards:
        return (f"--shard-params / --hybrid-shard with a {spec.family.name} model: FSDP would shard each ep rank's "
                "experts over all dp ranks, which hold different experts; use --zero1")
    if cp > 1:
        return (f"--context-parallel {cp} with a {spec.family.name} model: the router's aux loss counts a "
                "micro-batch's whole sequence, which no cp rank holds; use --context-parallel 1")
    if ep > 1 and optimizer_format == "nxd" and not zero1:
        return (f"--optimizer-format nxd with --ep {ep} needs --zero1: NxD's expert-parallel optimizer files are its "
                "ZeRO-1 optimizer's (NeuronEPZero1Optimizer), the only ones ckptconv writes at ep > 1")
    if ep > 1 and device == "xla":
        return f"--ep {ep} on xla: the all-to-all's splits are data-dependent (a host read per layer); use --ep 1"
    if jitter := spec.config.get("router_jitter_noise") or 0:  # what nxdtrain's MoE block does not compute
        return f"config.json: router_jitter_noise {jitter}: nxdtrain's router has no jitter (0 works)"
    return None
