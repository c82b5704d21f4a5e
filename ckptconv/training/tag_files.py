"""A training tag's files beside its shards, described once for every writer of tags: ``reshard`` and ``from-dcp``
(through a plan's :class:`~ckptconv.engine.finalize.FinalizeSpec`) and nxdtrain's saves (in process). A tag holds the
small side files (``scheduler.pt``, ``user_content.pt``, saved with ``torch.save``), the run's record in
``ckptconv.json`` (``extra["nxdtrain"]``: step and data position), and the markers, written last: a tag without
them is never resumed from.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch

from ckptconv.engine.finalize import FinalizeSpec
from ckptconv.io.tags import TAG_MARKERS

RECORD_KEY = "nxdtrain"  # ckptconv.json's extra[RECORD_KEY]: the run at this tag


def run_record(step: int, consumed_samples: int | None, **more: Any) -> dict[str, Any]:
    """What ``ckptconv.json`` records of the run at a tag: its step, its data position, and ``more``."""
    return {"step": int(step), "consumed_samples": consumed_samples, **more}


def torch_blob(value: Any) -> str:
    """A small side file's content (``torch.save``), as FinalizeSpec's blobs hold it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def complete_as_tag(spec: FinalizeSpec, *, side: dict[str, Any], record: dict[str, Any],
                    copies: list[tuple[str, str]] | None = None, **extra: Any) -> None:
    """``spec`` finishes its output as a training tag: ``side`` (file name -> value) saved as torch files, ``copies``
    (source path, file name) carried as they are, the run ``record`` (and ``extra``) in ``ckptconv.json``, then the
    markers."""
    spec.blobs.update({name: torch_blob(value) for name, value in side.items()})
    spec.copies.extend(copies or [])
    assert spec.metadata is not None
    spec.metadata["extra"] = {**(spec.metadata.get("extra") or {}), RECORD_KEY: record, **extra}
    spec.markers = list(TAG_MARKERS)  # after ckptconv.json: a tag is complete only then
