"""``--async-save`` (issue 47): a background save's files are byte for byte a synchronous save's of the same state,
though the next step ran (forward and backward) before the background thread wrote a byte and changed the state in
place after it: on the CPU the thread writes the live state, and the step's fence waits for its writes before the
optimizer changes it (the writes are held back until the fence is reached; without the fence they would hold the
next step's state), in every mode that writes differently (dense, ZeRO-1 at dp 2, FSDP at dp 2, ep 2); runs resumed
from the two tags hold the same state and take the same next step."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.nxdtrain.checkpoint.test_save_writer import MODES, _equal, mixtral, run_mode  # noqa: F401 (mixtral: a fixture)
from tests.nxdtrain.harness import trainer_world


def tree_bytes(tag: Path) -> dict[str, bytes]:
    """Every file of ``tag`` by its relative path (ckptconv's temporary directory aside: cleared at the end)."""
    return {str(p.relative_to(tag)): p.read_bytes() for p in sorted(tag.rglob("*"))
            if p.is_file() and ".ckptconv-tmp" not in p.parts}


def async_worker(options: dict[str, Any]) -> None:
    import torch.distributed as dist

    import nxdtrain.checkpoint.save as save_module

    with trainer_world(options) as (env, trainer):
        first = trainer()
        first.train_step(1)
        sync_tag = first.save(background=False)
        assert first.writer is not None
        first.writer = dataclasses.replace(first.writer, root=Path(options["checkpoint_dir"] + "-async"))
        if env.rank == 0:
            first.writer.root.mkdir()
        dist.barrier()
        gate, write, fence = threading.Event(), save_module.write_files, save_module.TagWriter.fence
        # On the CPU the background thread writes the live state: it writes only once step 2 reached the fence
        # (its forward and backward ran), and the step changes the state in place only after the writes finished.
        # Without the fence the gate opens after the step: the files would hold step 2's state.
        save_module.write_files = lambda files, rank: (gate.wait(120), write(files, rank))[1]
        save_module.TagWriter.fence = lambda writer: (gate.set(), fence(writer))[1]  # type: ignore[method-assign]
        async_tag = first.save(background=True)
        assert first.writer.pending is not None and not (async_tag / "done").exists()
        assert first.writer.pending.live  # a CPU run: no host copy
        before = {k: v.clone() for k, v in first.model.state_dict().items()}
        first.train_step(2)
        assert any(not v.equal(before[k]) for k, v in first.model.state_dict().items())  # the test can fail
        gate.set()
        first.finish_save()
        save_module.write_files, save_module.TagWriter.fence = write, fence  # type: ignore[method-assign]
        if env.rank == 0:
            sync, background = tree_bytes(sync_tag), tree_bytes(async_tag)
            assert sync.keys() == background.keys() and "done" in sync
            for rel, data in sync.items():
                assert background[rel] == data, rel
        resumed = [trainer(resume=str(tag), checkpoint_dir=f"{options['checkpoint_dir']}-{i}")
                   for i, tag in enumerate((sync_tag, async_tag))]
        steps = [trainer.train_step(2) for trainer in resumed]
        assert steps[0].loss.item() == steps[1].loss.item()
        _equal(resumed[0].model.state_dict(), resumed[1].model.state_dict(), "model after a step")
        _equal(resumed[0].optimizer.state_dict(), resumed[1].optimizer.state_dict(), "optimizer after a step")
        dist.barrier()


@pytest.mark.parametrize("mode", MODES)
def test_an_async_save_writes_a_sync_saves_bytes_and_resumes_alike(tmp_path, nxd_model, mixtral, mode):  # noqa: F811
    assert run_mode(async_worker, mode, 2, tmp_path, nxd_model, mixtral) == 0


def test_host_copies_keep_views_shared_and_reuse_the_previous_saves_memory():
    import torch

    from nxdtrain.checkpoint.save import HostCopies

    base = torch.arange(12, dtype=torch.float32)
    state = {"w": base.view(3, 4).t(), "head": base[:4], "step": torch.tensor(3), "n": 1}
    copies = HostCopies()
    copies.start()
    first = copies.copy(state)
    assert first["w"].stride() == (1, 4) and first["n"] == 1
    assert first["w"].untyped_storage().data_ptr() == first["head"].untyped_storage().data_ptr()  # one storage
    assert first["w"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    base.add_(100)  # training changes the state in place: the copy keeps what was saved
    assert torch.equal(first["head"], torch.arange(4, dtype=torch.float32))
    memory = first["w"].untyped_storage().data_ptr()
    copies.start()  # the next save, once the first completed: the same memory, the new values
    second = copies.copy(state)
    assert second["w"].untyped_storage().data_ptr() == memory and torch.equal(second["w"], state["w"])
    copies.start()  # another shape: fresh memory
    third = copies.copy({"w": torch.zeros(5)})
    assert third["w"].untyped_storage().data_ptr() != memory
