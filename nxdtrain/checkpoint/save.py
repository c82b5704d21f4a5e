"""Writing a ``step_<N>`` tag: every rank's shard and optimizer state, then rank 0's side files, ``ckptconv.json`` and
markers, then retention; optionally the tag rewritten in NxD's own optimizer format.

Every file goes through ckptconv's torch-zip writer with its digest computed as written
(:func:`ckptconv.engine.tags.tag_writes`): ``torch.save``'s bytes, nothing read back for ``ckptconv.json``.

A save stalls training while its collectives run (every rank's records to rank 0; with FSDP the column-major
records' gather) and its files are written (with FSDP every dp rank writes its rows into files dp rank 0 created:
:mod:`nxdtrain.checkpoint.shared`); ``--async-save`` (``background``) keeps only the collectives, and on a device a
host copy of each rank's files, in the stall: a thread of each rank writes them while training goes on (on the CPU
from the live state, which the next optimizer step changes only after :meth:`TagWriter.fence`), and the tag gets
``ckptconv.json``, its markers and retention when every rank's writes finished (:meth:`TagWriter.complete`, from
the main thread).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
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
    WriteDigests,
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
    pending: Pending | None = None       # the save in flight (written, not yet completed: complete)
    copies: HostCopies = dataclasses.field(default_factory=lambda: HostCopies())  # --async-save's, kept for the run
    sharding: Any = None         # FSDP (nxdtrain.parallel.fsdp.Sharding): every dp rank writes its rows in place
    host_state: bool = False     # the state lives in host memory (a CPU run): --async-save reads it where it is
    fenced_s: float = 0.0        # how long the last fence waited for a background save's writes (this rank)
    save_group: Any = None       # FSDP: a gloo group of the world for the writing threads alone (their CRC exchange)

    def __post_init__(self) -> None:
        if self.sharding is not None and self.save_group is None:  # collective: every rank builds its TagWriter
            timeout = timedelta(seconds=float(self.options.get("dist_timeout") or 1800))
            self.save_group = dist.new_group(backend="gloo", timeout=timeout)

    def save(self, *, step: int, consumed: int, model: Any, optimizer: Any, scheduler: dict[str, Any],
             loss: float | None = None, background: bool = False) -> Path:
        """Save ``step_<step>``. With ``background``, a thread writes this rank's files while training goes on: from
        a host copy made here, or, where the state lives in host memory (``host_state``), from the state itself,
        which training then changes only after :meth:`fence`. The tag is completed by :meth:`complete` (the next
        save, the run's end, a stop). One save is in flight at most: a save first completes the previous one."""
        self.complete()
        tag = self.root / tag_name(step)
        rank = dist.get_rank()
        lock = self._claim(tag, step) if rank == 0 else None
        dist.barrier(group=self.host_group)
        live = background and self.host_state
        try:
            files = self._files(tag, model, optimizer, copy=background and not live)
        except TrainError:
            if lock is not None:
                lock.release()
            raise
        # rank 0's (with a gathered FSDP save the other dp ranks' model is empty)
        dtype = files.dtype if files.dtype is not None else \
            str(next(iter(model.state_dict().values())).dtype).removeprefix("torch.") if rank == 0 else ""
        pending = Pending(tag, step, consumed, dict(scheduler), loss, dtype, rng_state(), lock, live=live,
                          shared=files.shared)
        if background:
            thread = ThreadPoolExecutor(1, thread_name_prefix="save-async")
            pending.writes = thread.submit(write_files, files, rank)
            thread.shutdown(wait=False)  # its thread ends with this write; complete waits for the write
        else:
            pending.writes = Future()
            try:  # kept for complete, which every rank reaches: a rank that raised here would leave the others waiting
                pending.writes.set_result(write_files(files, rank))
            except Exception as exc:  # noqa: BLE001 (reported on every rank by complete)
                pending.writes.set_exception(exc)
        self.pending = pending
        if not background:
            self.complete()
        return tag

    def fence(self) -> None:
        """Before training changes its state (the optimizer's step): wait for a background save that reads that
        state where it lives to finish its writes (this rank's; its errors are kept for :meth:`complete`)."""
        pending = self.pending
        self.fenced_s = 0.0
        if pending is None or not pending.live or pending.writes is None:
            return
        started = time.perf_counter()
        wait([pending.writes])
        pending.live = False
        self.fenced_s = time.perf_counter() - started
        pending.waited += self.fenced_s

    def complete(self) -> float | None:
        """Complete the save in flight (collective, from the main thread: the background thread makes no collective
        call on the run's groups): wait for this rank's writes, gather every rank's records, then rank 0 writes ``ckptconv.json``, the
        markers and prunes. Returns how long the slowest rank waited for its writes, here and at the fence (None:
        nothing was in flight)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        started = time.perf_counter()
        records, error = pending.outcome()
        gathered = self._gather((records, pending.rng, pending.waited + time.perf_counter() - started), error,
                                pending.tag, pending.close)
        if pending.lock is not None:
            with pending.lock:
                self._finish(pending, [records for records, *_ in gathered], [rng for _, rng, _ in gathered])
        dist.barrier(group=self.host_group)
        if self.nxd_param_groups is not None:
            self._in_nxd_format(pending.tag)
        return max(w for *_, w in gathered)

    def _gather(self, mine: Any, error: str | None, tag: Path, close: Callable[[], None]) -> list[Any]:
        """Every rank's ``mine``; when a rank says ``error``, every rank ``close``s what it holds of the save and
        stops alike (the tag stays without its markers)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, error), group=self.host_group)
        errors = [e for _, e in gathered if e is not None]
        if errors:
            close()
            raise TrainError(f"{tag}: not saved: {errors[0]}")
        return [m for m, _ in gathered]

    def _files(self, tag: Path, model: Any, optimizer: Any, *, copy: bool) -> Files:
        """What this rank writes in ``tag`` (with ``copy``: copied to the host, so that training may go on).
        Collective with FSDP."""
        if self.sharding is not None and self.flavour is Flavour.PLAIN:
            return self._shared_files(tag, model, optimizer, copy=copy)
        if self.sharding is not None:  # xser's files are one per tensor: gathered whole, written by dp rank 0
            model, optimizer = self.sharding.gathered(model, optimizer, keep=self.coords.dp == 0)
        tp, pp = self.coords.tp, self.coords.pp
        # The ranks of one (tp, pp) hold the same shard: the first of its dp x cp replicas writes it, as at cp 1.
        # With experts over ep ranks (dp = dp_exp * ep + ep_rank), the first of each ep rank's replicas writes its
        # file (ep rank > 0: its experts only) and its optimizer state.
        ep_rank = optimizer_ep_rank(self.coords.dp, self.layout.ep)
        first = self.coords.dp == ep_rank and self.coords.cp == 0
        files = Files(tag)
        if copy:
            self.copies.start()
        snapshot = self.copies.copy if copy else (lambda obj: obj)
        if first:
            path = tag / layout_shard_file(self.layout, ep_rank=ep_rank, tp_rank=tp, pp_rank=pp)
            on_host = _on_host(model)
            if on_host and not copy:  # collected on the shard's own thread: its column-major copies stay off this one
                files.shard = functools.partial(_save_host_shard, path, model, self.flavour, self.layout.ep)
            else:
                tensors, column_major = (model.shard_state(), None) if on_host else _device_shard(model)
                files.shard = functools.partial(save_shard, path, snapshot(tensors), self.flavour,
                                                column_major=column_major, ep=self.layout.ep)
            files.beside = on_host
        if first or self.zero1:
            dp_rank = self.zero_rank if self.zero1 else ep_rank
            state = snapshot(state_to_save(optimizer, dp_rank, self.layout.ep))
            files.optim = functools.partial(save_torch, state, optim_file(tag, tp_rank=tp, pp_rank=pp,
                                                                          dp_rank=dp_rank))
        return files

    def _shared_files(self, tag: Path, model: Any, optimizer: Any, *, copy: bool) -> Files:
        """FSDP without a gather (:mod:`nxdtrain.checkpoint.shared`): the ranks of the first replica write their rows
        into the files dp rank 0 creates here; every rank learns that they exist (or why not) before any writes."""
        from nxdtrain.checkpoint import shared  # noqa: PLC0415 (imports DTensor: FSDP runs only)

        c, sharding = self.coords, self.sharding
        writes = sharding.replica == 0 and c.cp == 0
        if copy:
            self.copies.start()
        error, save = None, None
        try:
            save = shared.build(tag / layout_shard_file(self.layout, ep_rank=0, tp_rank=c.tp, pp_rank=c.pp),
                                optim_file(tag, tp_rank=c.tp, pp_rank=c.pp, dp_rank=0), model, optimizer, sharding,
                                owner=writes and sharding.shard_rank == 0, writes=writes, group=self.save_group,
                                to_host=self.copies.copy if copy else to_host)
        except Exception as exc:  # noqa: BLE001 (the owner could not create a file, say: every rank learns it)
            error = rank_error(exc)
        self._gather(None, error, tag, save.close if save is not None else lambda: None)
        assert save is not None
        return Files(tag, shared=save, dtype=save.dtype if dist.get_rank() == 0 else "")

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

    def _finish(self, pending: Pending, every: list[dict[str, Any]], rngs: list[Any]) -> None:
        """Rank 0: side files, their records, then ckptconv.json, the markers and retention (ckptconv.engine.tags).
        ``every``: the records of every rank's files; ``rngs``: every rank's RNG state."""
        tag, step, consumed = pending.tag, pending.step, pending.consumed
        files: dict[str, dict[str, Any]] = {}
        for records in every:
            files.update(records)
        with tag_writes() as digests:
            side: list[Path] = [
                save_torch({**pending.scheduler, "step": step}, tag / SCHEDULER_FILE),
                save_torch({"step": step, "consumed_samples": consumed, "rng": rngs,
                             "options": self.options, "layout": self.layout.to_json(), "run": self.record,
                             "loss": pending.loss},
                            tag / USER_CONTENT_FILE),
            ]
        hf_src = self.source.root / HF_FILES_DIR
        if hf_src.is_dir() and not hf_src.is_symlink():
            names = sorted(p.name for p in hf_src.iterdir() if not p.is_dir())
            for name, real in outdir.confined_files(self.source.root, HF_FILES_DIR, names, []):
                side.append(outdir.copy_file(Path(real), outdir.ensure_dir(tag, HF_FILES_DIR) / name))
        files.update(file_records(side, tag, digests))
        finish_tag(tag, Metadata(
            kind="nxd", hf_config=self.source.spec.config, files=files, layout=self.layout.to_json(),
            flavour=self.flavour.value, dtype=pending.dtype, with_inv_freq=self.source.with_inv_freq,
            extra={RECORD_KEY: run_record(step, consumed, run=self.record.get("run"))},
        ), retain=lambda: prune(self.root, self.keep, run=str(self.record.get("run"))))


def rank_error(exc: BaseException) -> str:
    """A save's failure on this rank as the line every rank raises (``TagWriter._gather``, ``SharedSave.seal``)."""
    return f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"


@dataclass
class Files:
    """What one rank writes in a tag: its shard (``beside``: on a second thread, beside the optimizer file) and
    its optimizer file, each a call that writes it; or, FSDP, its share of files the ranks write together."""

    tag: Path
    shard: Callable[[], list[Path]] | None = None
    beside: bool = False
    optim: Callable[[], Path] | None = None
    shared: Any = None           # nxdtrain.checkpoint.shared.SharedSave
    dtype: str | None = None     # the shard's dtype, where the model handed to save does not say it


def write_files(files: Files, rank: int) -> dict[str, dict[str, Any]]:
    """Write this rank's files (in the calling thread: the main one, or a save's background thread) by the
    converter's writer, digests as written (buffered: ckptconv.engine.tags); their ckptconv.json records. FSDP:
    then the shared files sealed (:meth:`nxdtrain.checkpoint.shared.SharedSave.seal`: every rank's thread, collective
    over the save group), even after a failure here, which every rank then raises."""
    records: dict[str, dict[str, Any]] = {}
    extents: dict[str, list[Any]] = {}
    error = None
    try:
        records, extents = _write(files)
    except Exception as exc:
        if files.shared is None:
            raise
        error = rank_error(exc)  # every rank learns it in the seal
    _test_hold(rank)
    if files.shared is not None:
        records.update(files.shared.seal(extents, error, files.tag))
    return records


def _write(files: Files) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]]]:
    """:func:`write_files`' writes: the records of this rank's own files, and the CRC-32s of what it wrote into
    shared files (by file) for their owners. A host shard (or shared file) is written on a second thread beside the
    optimizer file (CRC-32, BLAKE3 and pwrite release the GIL), which then hashes the rest of the optimizer file
    while this thread writes it (host tensors stay unchanged until their file is finished: ``hold``); a device
    shard, copied to the host as it is written, on this one."""
    written: list[Path] = []
    shares = [] if files.shared is None else files.shared.files
    extents: dict[str, list[Any]] = {}
    with tag_writes(hold=files.beside) as digests, ThreadPoolExecutor(1, thread_name_prefix="save-shard") as beside:
        try:
            shard = None
            if files.shard is not None and files.beside:
                shard = beside.submit(contextvars.copy_context().run, _written_then_helping, files.shard, digests)
            elif files.shard is not None:
                written += files.shard()
            first = beside.submit(shares[0].write) if shares else None
            extents.update({f.rel: f.write() for f in shares[1:]})
            if files.optim is not None:
                written.append(files.optim())
        finally:  # a file that failed is never finished: the shard's thread must not wait for it
            digests.end_help()
        if shard is not None:
            written += shard.result()
        if first is not None:
            extents[shares[0].rel] = first.result()
    return file_records(written, files.tag, digests), extents


def _written_then_helping(write: Callable[[], list[Path]], digests: WriteDigests) -> list[Path]:
    """The shard's files written; then this thread, idle otherwise, hashes the optimizer file's writes as the other
    thread makes them (the larger file: ~2/3 of a dense rank's bytes), until that file is finished."""
    written = write()
    digests.lend_hand()
    return written


@dataclass
class Pending:
    """A save between its stall and its completion: what rank 0 writes then, and this rank's writes (their records,
    or the future of a background thread that returns them)."""

    tag: Path
    step: int
    consumed: int
    scheduler: dict[str, Any]
    loss: float | None
    dtype: str
    rng: dict[str, torch.Tensor]
    lock: outdir.OutLock | None            # rank 0: the tag's lock, held until the markers are written
    writes: Future[Any] | None = None      # write_files' result
    live: bool = False                     # the writes read the state training changes: TagWriter.fence first
    waited: float = 0.0                    # seconds the fence waited for the writes
    shared: Any = None                     # FSDP: this rank's nxdtrain.checkpoint.shared.SharedSave

    def outcome(self) -> tuple[dict[str, dict[str, Any]], str | None]:
        """This rank's records once its writes finished; an error as a line, so that every rank learns it (a rank
        that raised here would leave the others waiting in the gather)."""
        assert self.writes is not None
        try:
            return self.writes.result(), None
        except TrainError as exc:  # a line naming the rank it happened on (an FSDP save's seal)
            return {}, str(exc)
        except Exception as exc:  # noqa: BLE001 (reported on every rank by complete)
            return {}, rank_error(exc)

    def close(self) -> None:
        """After a failure: the tag's lock released, the shared files this rank created closed."""
        if self.lock is not None:
            self.lock.release()
        if self.shared is not None:
            self.shared.close()


class HostCopies:
    """Host copies of what a rank saves, in memory training does not change: each CPU storage copied once (views that
    shared one share its copy, so torch.save writes the same bytes), a device tensor copied to the host. The copies
    are kept for the next save to copy into, once the save that used them completed: memory already faulted in
    copies in about half the time of fresh memory (measured 0.20 s against 0.37-0.43 s for 370 MB)."""

    def __init__(self) -> None:
        self.kept: list[torch.UntypedStorage] = []  # the previous save's copies, in the order they were made
        self.made: list[torch.UntypedStorage] = []

    def start(self) -> None:
        """A new save: what the previous one copied into may be reused (its writes have completed)."""
        self.kept, self.made = self.made or self.kept, []

    def copy(self, obj: Any, memo: dict[int, Any] | None = None) -> Any:
        memo = {} if memo is None else memo
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                return t.cpu()
            storage = t.untyped_storage()
            copy = memo.get(storage.data_ptr())
            if copy is None:
                copy = memo[storage.data_ptr()] = self._storage_like(storage)
            return torch.empty(0, dtype=t.dtype).set_(copy, t.storage_offset(), t.size(), t.stride())
        if isinstance(obj, dict):
            return type(obj)((k, self.copy(v, memo)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, memo) for v in obj)
        return obj

    def _storage_like(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        index = len(self.made)
        if index < len(self.kept) and self.kept[index].nbytes() == storage.nbytes():
            copy = self.kept[index]
            _bytes(copy).copy_(_bytes(storage))
        else:
            copy = storage.clone()
        self.made.append(copy)
        return copy


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


HOLD_ENV = "NXDTRAIN_TEST_HOLD_SAVE"  # test-only: a directory; see _test_hold
HOLD_S = 5.0


def _test_hold(rank: int) -> None:
    """Test-only hook (tests/nxdtrain/parallel/test_preempt.py, test_async_preempt.py): with
    ``NXDTRAIN_TEST_HOLD_SAVE=DIR``, the first save of each rank stops for HOLD_S seconds after writing its files
    (with --async-save: its background thread, while training goes on), once it has created ``DIR/rank-R``: a
    signal sent then falls inside a save."""
    hold = os.environ.get(HOLD_ENV)
    if hold:
        try:
            (Path(hold) / f"rank-{rank}").touch(exist_ok=False)
        except FileExistsError:
            return
        import time

        time.sleep(HOLD_S)


def state_to_save(optimizer: Any, dp_rank: int, ep: int) -> dict[str, Any]:
    """The optimizer file of ``dp_rank``: its state on the host (with ``ep`` > 1, which ep rank's experts it holds:
    ckptconv.training's placement), as :func:`ckptconv.engine.tags.save_torch` writes it."""
    state = to_host(optimizer.state_dict())
    if ep > 1:
        state.update(dp_rank=dp_rank, ep=ep, ep_rank=optimizer_ep_rank(dp_rank, ep))
    return state


def _on_host(model: Any) -> bool:
    return all(t.device.type == "cpu" for t in model.state_dict().values())


def _save_host_shard(path: Path, model: Any, flavour: Any, ep: int) -> list[Path]:
    """A shard whose parameters live on the host, collected (o_proj made column-major) and written."""
    return save_shard(path, model.shard_state(), flavour, ep=ep)


def _device_shard(model: Any) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The shard's tensors on a device, and the column-major keys (a device tensor's strides say nothing).

    The parameters are handed over as they are: save_shard copies each to the CPU when it writes it, so the host
    never holds the whole shard and no relayout is traced on the device.
    """
    params = model.state_dict()
    records = model.file_records()
    return {r.key: params[r.key].detach() for r in records}, {r.key for r in records if r.column_major}
