"""FSDP saves without a gather (issue 47; nxdtrain.checkpoint.shared): every dp rank writes its rows into the files
dp rank 0 created, and the tag is byte for byte the tag the gathered save writes (each tensor gathered whole,
then written by dp rank 0: ``Sharding.gathered``, the save before), at fp32, bf16 (fp32 masters in the optimizer
file) and with hybrid sharding (two replicas: only the first writes); a failure on one rank (a write of its rows,
or the owner's creation of a file) fails the save on every rank, without a hang, and leaves no markers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from nxdtrain.cli import PRELOAD
from nxdtrain.parallel.dist import spawn
from tests.nxdtrain.checkpoint.test_async_save import tree_bytes
from tests.nxdtrain.harness import DIST_TIMEOUT, WORLD_TIMEOUT, train_options, trainer_world


def gathered_save(trainer: Any, root: Path) -> Path:
    """The save as it was written before: the stage and optimizer gathered whole, dp rank 0 writing them."""
    import torch.distributed as dist

    from ckptconv.io import SCHEDULER_FILE

    writer = dataclasses.replace(trainer.writer, root=root, sharding=None, pending=None)
    if dist.get_rank() == 0:
        root.mkdir()
    dist.barrier()
    model, optimizer = trainer.sharding.gathered(trainer.model, trainer.optimizer, keep=trainer.mesh.coords.dp == 0)
    scheduler = torch.load(trainer.writer.root / f"step_{trainer.step}" / SCHEDULER_FILE, weights_only=True)
    scheduler.pop("step")
    return writer.save(step=trainer.step, consumed=trainer.consumed, model=model, optimizer=optimizer,
                       scheduler=scheduler, loss=trainer.last_loss)


def shared_worker(options: dict[str, Any]) -> None:
    import torch.distributed as dist

    with trainer_world(options) as (env, trainer):
        first = trainer()
        first.train_step(1)
        tag = first.save(background=False)
        before = gathered_save(first, Path(options["checkpoint_dir"] + "-gathered"))
        if env.rank == 0:
            new, old = tree_bytes(tag), tree_bytes(before)
            assert new.keys() == old.keys() and "done" in new and any(k.startswith("optim/") for k in new)
            for rel, data in old.items():
                assert new[rel] == data, rel
        dist.barrier()


def failing_worker(options: dict[str, Any]) -> None:
    import torch.distributed as dist

    import nxdtrain.checkpoint.shared as shared
    from nxdtrain.errors import TrainError

    with trainer_world(options) as (env, trainer):
        first = trainer()
        first.train_step(1)
        write, create = shared.write_share, shared.TorchZipWriter

        def refused(*_: Any) -> Any:
            raise OSError(28, "No space left on device (test)")

        if env.rank == 1:  # a rank that is not the owner fails to write its rows
            shared.write_share = refused
        with pytest.raises(TrainError, match=r"step_1: not saved: rank 1: OSError: .*No space left"):
            first.save(background=False)
        shared.write_share = write
        tag = first.writer.root / "step_1"
        assert not (tag / "done").exists() and not (tag / "ckptconv.json").exists()
        if env.rank == 0:  # the owner cannot create a file: no rank writes a byte
            shared.TorchZipWriter = refused
        with pytest.raises(TrainError, match=r"step_1: not saved: rank 0: OSError: .*No space left"):
            first.save(background=False)
        shared.TorchZipWriter = create
        assert not (tag / "done").exists() and not (tag / "ckptconv.json").exists()
        again = first.save(background=False)  # the step saved over what the failures left
        assert (again / "done").exists()
        dist.barrier()


# processes, options: hybrid sharding over 4 dp ranks in groups of 2 (two replicas)
CASES = {"fp32": (2, {"shard_params": True}), "bf16": (2, {"shard_params": True, "precision": "bf16"}),
         "hybrid": (4, {"hybrid_shard": 2})}


@pytest.mark.parametrize("case", CASES)
def test_a_gather_free_fsdp_save_writes_the_gathered_saves_bytes(tmp_path, nxd_model, case):
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    nproc, sharding = CASES[case]
    options = train_options(optimizer="adamw", steps=1, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"),
                            dist_timeout=DIST_TIMEOUT, **sharding)
    assert spawn(shared_worker, (options,), nproc, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 0


def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path, nxd_model):
    src = nxd_model("gqa", tp=1, pp=1, attention="qkv_linear")
    options = train_options(optimizer="adamw", steps=1, resume=str(src), checkpoint_dir=str(tmp_path / "ckpt"),
                            dist_timeout=DIST_TIMEOUT, shard_params=True)
    assert spawn(failing_worker, (options,), 2, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 0
