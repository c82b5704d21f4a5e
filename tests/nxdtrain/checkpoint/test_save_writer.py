"""A save written by the converter's writer (issue 47: torch-zip writer, digests as written, O_DIRECT where allowed),
read back in every mode that writes differently (dense, ZeRO-1 at dp 2, FSDP at dp 2, ep 2): its model shard by
ckptconv's checked reader (CRC-32s and the recorded digest checked) and its optimizer file by torch.load equal the
trainer's state (torch.equal); every file's bytes are torch.save's and its record is its BLAKE3; a trainer resumed
from the tag holds the same parameters and optimizer state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from nxdtrain.cli import PRELOAD
from nxdtrain.parallel.dist import spawn
from tests.conftest import wait_until
from tests.nxdtrain.harness import DIST_TIMEOUT, WORLD_TIMEOUT, convert, train_options, trainer_world
from tests.nxdtrain.moe_reference import make_moe


def _equal(a: Any, b: Any, where: str) -> None:
    """Nested equality, tensors by torch.equal (dtype, shape and values), DTensors by their local part."""
    local = getattr(a, "to_local", None)
    if local is not None:
        a, b = local(), b.to_local()
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def _check_files(tag: Path, model: Any, optimizer: Any, shard: Path, optim: Path, placement: dict[str, int]) -> None:
    """This rank's two files against the state it saved (gathered whole for FSDP, as the writer saw it; with
    ``placement``, the ep fields the file carries)."""
    from ckptconv.io.checked import CheckedFiles
    from ckptconv.io.nxd_read import load_shard
    from nxdtrain.device import to_host

    records = json.loads((tag / "ckptconv.json").read_text())["files"]
    read = load_shard(shard, checks=CheckedFiles(tag, records))
    _equal(model.shard_state(), read, str(shard))
    saved = torch.load(optim, weights_only=True)
    _equal({**to_host(optimizer.state_dict()), **placement}, saved, str(optim))
    # torch.save's bytes: a save of what was read, under the name each was written at (the zip's archive name):
    # the shard's own (save_shard writes it in a temporary directory), the optimizer file's temporary name
    for path, name in ((shard, shard.name), (optim, f".{optim.name}.partial")):
        again = tag.parent / f"{tag.name}-again-{path.parent.name}" / name
        again.parent.mkdir(exist_ok=True)
        torch.save(torch.load(path, weights_only=True), again)
        assert path.read_bytes() == again.read_bytes(), path
    for rel, record in records.items():
        assert record == {"size": (tag / rel).stat().st_size, "blake3": blake3.blake3((tag / rel).read_bytes()).hexdigest()}


def save_and_resume_worker(options: dict[str, Any]) -> None:
    import torch.distributed as dist

    from ckptconv.core import layout_shard_file
    from ckptconv.training import optimizer_ep_rank
    from nxdtrain.checkpoint.tags import optim_file

    with trainer_world(options) as (_, trainer):
        first = trainer()
        first.train_step(1)
        tag = first.save()
        c, layout = first.mesh.coords, first.plan.layout
        model, optimizer = (first.model, first.optimizer) if first.sharding is None else \
            first.sharding.gathered(first.model, first.optimizer, keep=c.dp == 0)
        ep_rank = optimizer_ep_rank(c.dp, layout.ep)
        if c.dp == ep_rank:  # a first replica: it wrote the shard (and, without ZeRO-1, the optimizer file)
            shard = tag / layout_shard_file(layout, ep_rank=ep_rank, tp_rank=c.tp, pp_rank=c.pp)
            dp_rank = first.mesh.dpcp_rank if options.get("zero1") else ep_rank
            placement = {} if layout.ep == 1 else {"dp_rank": dp_rank, "ep": layout.ep, "ep_rank": ep_rank}
            _check_files(tag, model, optimizer, shard, optim_file(tag, tp_rank=c.tp, pp_rank=c.pp, dp_rank=dp_rank),
                         placement)
        second = trainer(resume=str(tag), checkpoint_dir=options["checkpoint_dir"] + "-2")
        assert second.step == 1
        _equal(first.model.state_dict(), second.model.state_dict(), "resumed model")
        _equal(first.optimizer.state_dict(), second.optimizer.state_dict(), "resumed optimizer")
        dist.barrier()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("save-writer-moe")
    return convert(make_moe(root / "hf", "mixtral"), root / "nxd")


MODES = {"dense": (1, {}), "zero1-dp2": (2, {"zero1": True}), "fsdp-dp2": (2, {"shard_params": True}),
         "ep2": (2, {"ep": 2})}


def run_mode(worker: Any, mode: str, steps: int, tmp_path: Path, nxd_model: Any, mixtral: Path) -> int:
    """``worker(options)`` in a world of ``mode`` (MODES), resuming the tiny model that mode trains (the Mixtral for
    ep, else a GQA Llama), checkpoints under ``tmp_path / "ckpt"``; the world's exit code."""
    nproc, extra = MODES[mode]
    src = mixtral if "ep" in extra else nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    options = train_options(optimizer="adamw", steps=steps, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"),
                            dist_timeout=DIST_TIMEOUT, **extra)
    return spawn(worker, (options,), nproc, timeout_s=WORLD_TIMEOUT, preload=PRELOAD)


@pytest.mark.parametrize("mode", MODES)
def test_a_save_reads_back_equal_through_ckptconv_and_the_resume_path(tmp_path, nxd_model, mixtral, mode):
    assert run_mode(save_and_resume_worker, mode, 1, tmp_path, nxd_model, mixtral) == 0


def test_an_optimizer_file_that_fails_frees_the_shard_thread_hashing_it(tmp_path):
    """The shard's thread, done with its file, hashes the optimizer file as it is written; when that write fails the
    file is never finished, and the save must still end (with the error), not wait for it forever."""
    import os
    import threading

    from ckptconv.engine.tags import save_torch
    from ckptconv.io.write_digest import open_digest
    from nxdtrain.checkpoint.save import Files, _write

    helped: list[Any] = []
    opened = threading.Event()

    def shard() -> list[Path]:
        written = [save_torch({"w": torch.ones(3)}, tmp_path / "shard.pt")]
        assert opened.wait(10)  # the optimizer file is open when this thread is done with its own
        return written

    def optim() -> Path:
        path = tmp_path / "optim.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        digest = open_digest(path, fd)  # inside the save's recording: its WriteDigests holds it
        assert digest is not None
        opened.set()
        digest.write(memoryview(b"x" * 64), 64)  # the first 64 bytes never come: the helper waits for them
        wait_until(lambda: digest._helped, "the shard's thread to lend a hand", 10, poll=0.001)
        helped.append(digest)
        os.close(fd)
        raise OSError("No space left on device")

    files = Files(tmp_path, shard=shard, beside=True, optim=optim)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            _write(files)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=save, daemon=True)  # a hang must fail this test, not stop the suite
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the save waited for a file that is never finished"
    assert [str(e) for e in errors] == ["No space left on device"] and len(helped) == 1 and not helped[0]._helped
