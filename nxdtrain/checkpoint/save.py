"""Writing a ``step_<N>`` tag: every rank's shard and optimizer state, then rank 0's side files, ``ckptconv.json`` and
markers, then retention; optionally the tag rewritten in NxD's own optimizer format.

Every file goes through ckptconv's torch-zip writer with its digest computed as written
(:func:`ckptconv.engine.tags.tag_writes`): ``torch.save``'s bytes, nothing read back for ``ckptconv.json``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptconv.core import HF_FILES_DIR, ParallelLayout, layout_shard_file
from ckptconv.engine import (
    RECORD_KEY,
    claim_tag,
    clear_tag,
    file_records,
    finish_tag,
    outdir,
    remove_tag,
    run_record,
    save_torch,
    tag_writes,
)
from ckptconv.errors import ConversionError
from ckptconv.io import (
    SCHEDULER_FILE,
    USER_CONTENT_FILE,
    Flavour,
    Metadata,
    read_metadata,
    save_shard,
    tag_name,
    write_metadata,
)
from ckptconv.training import optimizer_ep_rank
from nxdtrain.checkpoint.resume import ResumeSource
from nxdtrain.checkpoint.tags import NXD_REWRITE_SUFFIX, REPLACED_SUFFIX, optim_file, prune
from nxdtrain.device import to_host
from nxdtrain.errors import TrainError


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Bands of each rank's share of a rewrite in NxD's format: every rank of a node rewrites at once, beside the model
REWRITE_MEMORY = 256 << 20


@dataclass
class TagWriter:
    """Writes ``step_<N>`` tags for one rank; every rank calls :meth:`save` (it is collective)."""

    root: Path
    source: ResumeSource
    layout: ParallelLayout
    coords: Any                  # dist.Coords of this rank
    zero1: bool                  # with zero_rank: this rank's ZeRO-1 shard (its index in the dp x cp group)
    flavour: Flavour
    keep: int
    options: dict[str, Any]
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run record (nxdtrain.checkpoint.continuity)
    host_group: Any = None       # barriers and object gathers (a gloo group when training on xla)
    zero_rank: int = 0
    zero_size: int = 1           # the ranks a ZeRO-1 state is partitioned over (dp x cp)
    nxd_zero1: bool = False      # --zero1 as asked (at dp 1 there is no ZeRO-1 group, NxD's format has ZeRO-1 files)
    nxd_param_groups: str | None = None  # --optimizer-format nxd: each tag rewritten in NxD's format by this rule

    def save(self, *, step: int, consumed: int, model: Any, optimizer: Any, scheduler: dict[str, Any],
             loss: float | None = None) -> Path:
        tag = self.root / tag_name(step)
        rank = dist.get_rank()
        lock = self._claim(tag, step) if rank == 0 else None
        dist.barrier(group=self.host_group)
        tp, pp = self.coords.tp, self.coords.pp
        # The ranks of one (tp, pp) hold the same shard: the first of its dp x cp replicas writes it, as at cp 1.
        # With experts over ep ranks (dp = dp_exp * ep + ep_rank), the first of each ep rank's replicas writes its
        # file (ep rank > 0: its experts only) and its optimizer state.
        ep_rank = optimizer_ep_rank(self.coords.dp, self.layout.ep)
        first = self.coords.dp == ep_rank and self.coords.cp == 0
        written: list[Path] = []
        # The converter's writer, digests as written (buffered: ckptconv.engine.tags). A host shard is written on a
        # second thread beside the optimizer file (CRC-32, BLAKE3 and pwrite release the GIL); a device shard, copied
        # to the host as it is written, on this one.
        with tag_writes() as digests, ThreadPoolExecutor(1, thread_name_prefix="save-shard") as beside:
            shard = None
            if first:
                tensors, column_major = _shard_to_save(model)
                name = layout_shard_file(self.layout, ep_rank=ep_rank, tp_rank=tp, pp_rank=pp)
                write = functools.partial(save_shard, tag / name, tensors, self.flavour, column_major=column_major,
                                          ep=self.layout.ep)
                if column_major is None:
                    shard = beside.submit(contextvars.copy_context().run, write)
                else:
                    written += write()
            if first or self.zero1:
                dp_rank = self.zero_rank if self.zero1 else ep_rank
                written.append(save_state(optimizer, optim_file(tag, tp_rank=tp, pp_rank=pp, dp_rank=dp_rank),
                                          dp_rank, self.layout.ep))
            if shard is not None:
                written += shard.result()
        _test_hold(rank)
        mine = (file_records(written, tag, digests), rng_state())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=self.host_group)
        if rank == 0:
            assert lock is not None
            with lock:
                self._finish(tag, step, consumed, model, scheduler, gathered, loss)
        dist.barrier(group=self.host_group)
        if self.nxd_param_groups is not None:
            self._in_nxd_format(tag)
        return tag

    def _in_nxd_format(self, tag: Path) -> None:
        """The tag just saved rewritten in NxD's own optimizer format (``ckptconv reshard --optimizer-format nxd``
        at the same layout), every rank writing its share of the files (``--part rank/world``) into a hidden
        sibling that replaces the tag when complete: until then the saved tag stays as it is, complete."""
        from ckptconv import RunOptions, reshard  # noqa: PLC0415 (only runs that ask for NxD's format)

        staging = tag.with_name(f".{tag.name}{NXD_REWRITE_SUFFIX}")
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0 and staging.exists():  # an interrupted rewrite of this step: what ckptconv wrote there goes
            clear_tag(staging)
        dist.barrier(group=self.host_group)
        layout = self.layout
        alone = layout.ep > 1  # ckptconv rewrites a tag at ep > 1 in one process (its --part splits dense tags only)
        error = None
        if rank == 0 or not alone:
            try:
                reshard(tag, staging, tp=layout.tp, pp=layout.pp, vpp=layout.vpp, kv_size_multiplier=layout.kvm,
                        attention=layout.attention, fuse_qkv=layout.fuse_qkv, hw_backend=layout.hw,
                        trn2_kv_layout=layout.trn2_kv_layout, dp=self.zero_size, zero1=self.nxd_zero1,
                        optimizer_format="nxd", nxd_param_groups=self.nxd_param_groups,
                        options=RunOptions(quiet=True, part=(0, 1) if alone else (rank, world), workers=1,
                                           max_memory=REWRITE_MEMORY))
            except ConversionError as exc:
                error = f"{tag}: saved, but not rewritten in NxD's format (--optimizer-format nxd): {exc}"
        if alone:  # every rank stops alike when rank 0's rewrite failed
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.host_group)
            error = box[0]
        if error is not None:
            raise TrainError(error)
        dist.barrier(group=self.host_group)
        if rank == 0:
            meta = read_metadata(staging)
            assert meta is not None
            extra = dict(meta.extra or {})
            extra[RECORD_KEY] = {**extra.get(RECORD_KEY, {}), "run": self.record.get("run")}  # prune finds it
            write_metadata(staging, dataclasses.replace(meta, extra=extra))
            replaced = tag.with_name(f".{tag.name}{REPLACED_SUFFIX}")
            os.rename(tag, replaced)
            os.rename(staging, tag)
            remove_tag(replaced)
        dist.barrier(group=self.host_group)

    def _claim(self, tag: Path, step: int) -> outdir.OutLock:
        """Rank 0: lock the tag, clear what an earlier save of this step left (only what nxdtrain
        wrote there), declare what this save writes, before any rank writes a byte."""
        if tag.exists() and os.path.realpath(tag) == os.path.realpath(self.source.root):
            raise TrainError(f"{tag}: is the checkpoint this run resumed from; it is not saved over")
        return claim_tag(tag, f"nxdtrain-step-{step}", lambda stranger: TrainError(
            f"{tag}: holds {stranger!r}, which nxdtrain did not write; move it away or use another --checkpoint-dir"))

    def _finish(self, tag: Path, step: int, consumed: int, model: Any, scheduler: dict[str, Any],
                gathered: list[Any], loss: float | None) -> None:
        """Rank 0: side files, their records, then ckptconv.json, the markers and retention (ckptconv.engine.tags)."""
        files: dict[str, dict[str, Any]] = {}
        for records, _ in gathered:
            files.update(records)
        with tag_writes() as digests:
            side: list[Path] = [
                save_torch({**scheduler, "step": step}, tag / SCHEDULER_FILE),
                save_torch({"step": step, "consumed_samples": consumed, "rng": [rng for _, rng in gathered],
                             "options": self.options, "layout": self.layout.to_json(), "run": self.record,
                             "loss": loss},
                            tag / USER_CONTENT_FILE),
            ]
        hf_src = self.source.root / HF_FILES_DIR
        if hf_src.is_dir() and not hf_src.is_symlink():
            names = sorted(p.name for p in hf_src.iterdir() if not p.is_dir())
            for name, real in outdir.confined_files(self.source.root, HF_FILES_DIR, names, []):
                side.append(outdir.copy_file(Path(real), outdir.ensure_dir(tag, HF_FILES_DIR) / name))
        files.update(file_records(side, tag, digests))
        dtype = next(iter(model.state_dict().values())).dtype
        finish_tag(tag, Metadata(
            kind="nxd", hf_config=self.source.spec.config, files=files, layout=self.layout.to_json(),
            flavour=self.flavour.value, dtype=str(dtype).removeprefix("torch."),
            with_inv_freq=self.source.with_inv_freq,
            extra={RECORD_KEY: run_record(step, consumed, run=self.record.get("run"))},
        ), retain=lambda: prune(self.root, self.keep, run=str(self.record.get("run"))))


HOLD_ENV = "NXDTRAIN_TEST_HOLD_SAVE"  # test-only: a directory; see _test_hold
HOLD_S = 5.0


def _test_hold(rank: int) -> None:
    """Test-only hook (tests/nxdtrain/parallel/test_preempt.py): with ``NXDTRAIN_TEST_HOLD_SAVE=DIR``, the first save
    of each rank stops for HOLD_S seconds after writing its files, once it has created ``DIR/rank-R``: a signal
    sent then falls inside a save."""
    hold = os.environ.get(HOLD_ENV)
    if hold:
        try:
            (Path(hold) / f"rank-{rank}").touch(exist_ok=False)
        except FileExistsError:
            return
        import time

        time.sleep(HOLD_S)


def save_state(optimizer: Any, path: Path, dp_rank: int, ep: int) -> Path:
    """The optimizer file of ``dp_rank``: its state on the host (with ``ep`` > 1, which ep rank's experts it holds:
    ckptconv.training's placement), written by :func:`ckptconv.engine.tags.save_torch`."""
    state = to_host(optimizer.state_dict())
    if ep > 1:
        state.update(dp_rank=dp_rank, ep=ep, ep_rank=optimizer_ep_rank(dp_rank, ep))
    return save_torch(state, path)


def _shard_to_save(model: Any) -> tuple[dict[str, torch.Tensor], set[str] | None]:
    """The shard's tensors and, for a device tensor (whose strides say nothing), the column-major keys.

    On a device the parameters are handed over as they are: save_shard copies each to the CPU when
    it writes it, so the host never holds the whole shard and no relayout is traced on the device.
    """
    params = model.state_dict()
    if all(t.device.type == "cpu" for t in params.values()):
        return model.shard_state(), None
    records = model.file_records()
    return {r.key: params[r.key].detach() for r in records}, {r.key for r in records if r.column_major}
