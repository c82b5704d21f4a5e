"""``ckptconv reshard`` of a training tag: the optimizer files and side files beside the resharded shards.

The shards' plan is extended by one format-2 optimizer file per target (tp, pp, dp) rank
(:func:`ckptconv.training_state.plan_optimizer_files`), written by the same executor in bands: memory stays
within ``--max-memory`` however large the state. The replicas the weights must agree on (K/V heads under
kv_size_multiplier, norms, a tied head) are checked for every moment too. ``scheduler.pt`` is copied,
``user_content.pt`` rewritten for the new layout, and the ``checkpoint``/``done`` markers written last.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.errors import ConversionError
from ckptconv.finalize import FinalizeSpec
from ckptconv.io.checked import check_whole_file
from ckptconv.io.nxd import CHECKPOINT_MARKER, DONE_MARKER, NxdCheckpoint, TorchZipSink
from ckptconv.io.safe_load import load_small_bytes
from ckptconv.layout import ParallelLayout
from ckptconv.mapping import stores_lm_head
from ckptconv.model_spec import ModelSpec
from ckptconv.plan import OutFile, Plan
from ckptconv.training_state import (
    OPTIM_DIR,
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    TagOptimizer,
    TagReader,
    plan_optimizer_files,
    resharded_user_content,
    state_replicas,
)


def _describe_zero1(on: bool, dp: int) -> str:
    return f"ZeRO-1 over {dp} dp rank{'s' if dp != 1 else ''}" if on else "without ZeRO-1"


def _checked(ckpt: NxdCheckpoint, path: Path) -> bytes:
    """A side file's bytes, as recorded (--no-check: as they are): side files are carried only so."""
    if not path.is_file():
        raise ConversionError(f"{path}: missing from the training tag; pass --weights-only for the shards alone")
    return check_whole_file(path, ckpt.checks.record(path) if ckpt.checks.enabled else None)


def _load(ckpt: NxdCheckpoint, path: Path) -> Any:
    try:
        return load_small_bytes(_checked(ckpt, path), str(path))
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


@dataclass
class TrainingTag:
    """A training tag being resharded: its optimizer files opened, the target's dp and ZeRO-1 chosen."""

    ckpt: NxdCheckpoint
    optim: TagOptimizer
    user_content: dict[str, Any]
    dp: int
    zero1: bool

    @classmethod
    def open(cls, ckpt: NxdCheckpoint, spec: ModelSpec, old: ParallelLayout, with_inv_freq: bool, plan: Plan, *,
             dp: int | None, zero1: bool | None, io: str) -> TrainingTag:
        path = ckpt.root / USER_CONTENT_FILE
        _checked(ckpt, ckpt.root / SCHEDULER_FILE)
        content = _load(ckpt, path)
        if not isinstance(content, dict) or "step" not in content:
            raise ConversionError(f"{path}: not nxdtrain's user content (expected a dict with 'step')")
        optim = TagOptimizer(ckpt.root, spec, old, with_inv_freq=with_inv_freq,
                             lm_head_copy=stores_lm_head(spec, ckpt.dtypes()), checks=ckpt.checks, io=io)
        on = optim.hyper.zero1 if zero1 is None else zero1
        size = (optim.hyper.zero_size if optim.hyper.zero1 else 1) if dp is None else dp
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            optim.close()
            raise ConversionError(f"--dp must be an integer >= 1, got {size!r}")
        return cls(ckpt, optim, content, size if on else 1, on)

    def scheduler(self) -> dict[str, Any]:
        """``scheduler.pt``: the run's schedule (schedule, lr, min_lr, warmup, decay_steps) at its step."""
        path = self.ckpt.root / SCHEDULER_FILE
        record = _load(self.ckpt, path)
        if not isinstance(record, dict):
            raise ConversionError(f"{path}: not nxdtrain's scheduler record (expected a dict)")
        return record

    def __enter__(self) -> TrainingTag:
        return self

    def __exit__(self, *exc: object) -> None:
        self.optim.close()

    def identity(self) -> list[tuple[str, int, int]]:
        """What identifies the tag's other inputs cheaply (the fingerprint of a rerun)."""
        files = sorted((self.ckpt.root / OPTIM_DIR).iterdir()) + [self.ckpt.root / SCHEDULER_FILE,
                                                                  self.ckpt.root / USER_CONTENT_FILE]
        return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()] + [
            ("dp", self.dp, int(self.zero1))]

    def extend(self, plan: Plan, spec: FinalizeSpec, new: ParallelLayout, notes: list[str]) -> tuple[Plan, TagReader]:
        """The plan with the optimizer files; ``spec`` with the side files and markers; the reader of both."""
        optim_files = plan_optimizer_files(plan.files, self.optim, dp=self.dp, zero1=self.zero1)
        replicas = plan.replicas + state_replicas(plan.replicas, self.optim)
        content = resharded_user_content(self.user_content, new, zero1=self.zero1)
        blob = io.BytesIO()
        torch.save(content, blob)
        spec.blobs[USER_CONTENT_FILE] = base64.b64encode(blob.getvalue()).decode()
        spec.copies.append((str((self.ckpt.root / SCHEDULER_FILE).resolve()), SCHEDULER_FILE))
        spec.markers = [CHECKPOINT_MARKER, DONE_MARKER]  # after ckptconv.json: a tag is complete only then
        assert spec.metadata is not None
        spec.metadata["extra"] = {"nxdtrain": {"step": int(content["step"]),
                                               "consumed_samples": int(content.get("consumed_samples", 0))}}
        hyper = self.optim.hyper
        was = _describe_zero1(hyper.zero1, hyper.zero_size)
        notes.append(f"training tag at step {content['step']}: optimizer state ({', '.join(hyper.components) or 'none'}) "
                     f"moved with the weights, {was} -> {_describe_zero1(self.zero1, self.dp)}; RNG states dropped "
                     "(they belong to the old world's ranks)")
        return Plan(plan.files + optim_files, replicas), TagReader(self.ckpt, self.optim)

    @staticmethod
    def sinks(model_sinks: Any) -> Any:
        """Optimizer files are plain torch zips whatever the shards' flavour."""
        def make(out_file: OutFile, tmp: Path) -> Any:
            if out_file.path.startswith(OPTIM_DIR + "/"):
                return TorchZipSink(out_file, tmp)
            return model_sinks(out_file, tmp)

        return make
