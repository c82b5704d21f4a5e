"""Records spread over a save's threads (ckptconv.io.write_pool): the same bytes as torch.save and as one thread,
every file's digest its BLAKE3 taken from memory (no byte read back), errors raised only after every write ended."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import blake3
import pytest
import torch

import ckptconv.io.digest as digest_module
from ckptconv.engine.tags import file_records, tag_writes
from ckptconv.io.nxd_write import save_shard
from ckptconv.io.torch_save import save_object
from ckptconv.io.write_pool import each, spreading


def _state() -> dict:
    """Many records of mixed sizes (some over the zip's small-record threshold, some empty, a zero-dim step), so the
    pool's threads finish them out of file order."""
    torch.manual_seed(0)
    state = {f"layers.{i}.w": {"exp_avg": torch.randn(64 + 37 * i, 129), "exp_avg_sq": torch.rand(11 * i + 1),
                               "step": torch.tensor(float(i))} for i in range(12)}
    state["empty"] = {"exp_avg": torch.zeros(0, 5)}
    return {"state": state, "format": 2}


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_an_optimizer_file_on_several_threads_is_torch_saves_bytes_hashed_from_memory(tmp_path: Path, monkeypatch,
                                                                                       threads: int):
    state = _state()
    torch.save(state, tmp_path / "ref.pt")
    (tmp_path / "out").mkdir()
    written = tmp_path / "out" / "ref.pt"  # the archive's name is the file's: the same as the reference's
    with tag_writes(threads=threads) as digests:
        assert save_object(state, written)
    assert written.read_bytes() == (tmp_path / "ref.pt").read_bytes()
    assert digests.pulled() == 0  # records finished out of order were hashed from held memory, not read back
    monkeypatch.setattr(digest_module, "file_digest", lambda *a: pytest.fail("read back a file hashed as written"))
    record = file_records([written], tmp_path / "out", digests)["ref.pt"]
    assert record["blake3"] == blake3.blake3(written.read_bytes()).hexdigest()


def test_a_model_shard_on_several_threads_is_the_same_as_on_one(tmp_path: Path):
    """save_shard with a column-major matrix (transposed per record) and a bf16 one: byte-equal across thread counts,
    and torch.save's file for the plain flavour."""
    torch.manual_seed(1)
    shard = {f"layers.{i}.mlp.up_proj.weight": torch.randn(96, 40 + i) for i in range(6)}
    shard["layers.0.self_attn.o_proj.weight"] = torch.randn(48, 96).t().contiguous().t()  # column-major
    shard["embed_tokens.weight"] = torch.randn(300, 40).to(torch.bfloat16)
    files = {}
    for threads in (1, 3):
        out = tmp_path / f"t{threads}" / "tp_rank_00_pp_rank_00"
        out.parent.mkdir()
        with tag_writes(threads=threads) as digests:
            written = save_shard(out / "checkpoint.pt", shard)
        files[threads] = written[-1].read_bytes()
        assert digests.pulled() == 0
    assert files[1] == files[3]
    torch.save(shard, tmp_path / "checkpoint.pt")
    assert files[3] == (tmp_path / "checkpoint.pt").read_bytes()


def test_each_runs_on_the_pools_threads_and_raises_the_first_error_after_every_write_ended():
    ended: list[int] = []
    threads: set[str] = set()

    def write(item: int) -> None:
        threads.add(threading.current_thread().name)
        if item == 1:
            raise OSError("disk full")
        time.sleep(0.05)  # still writing when item 1 fails
        ended.append(item)

    with spreading(3), pytest.raises(OSError, match="disk full"):
        each(write, range(6))
    assert sorted(ended) == [0, 2, 3, 4, 5]  # none left running when the error came out
    assert all(name.startswith("save-records") for name in threads)
    each(lambda item: threads.add(threading.current_thread().name), [0])  # outside spreading: the calling thread
    assert threading.current_thread().name in threads


def test_a_write_on_the_pool_that_writes_a_file_itself_writes_it_in_its_own_thread():
    """each inside each (a record whose writer saves a file of its own) ends, on a pool of one thread."""
    seen: list[tuple[int, str]] = []

    def outer(item: int) -> int:
        each(lambda inner: seen.append((inner, threading.current_thread().name)), [item * 10, item * 10 + 1])
        return item

    with spreading(2):  # a pool of 2: both busy with outer writes, whose inner ones must not wait for a thread
        assert each(outer, range(4)) == [0, 1, 2, 3]
    assert sorted(i for i, _ in seen) == [0, 1, 10, 11, 20, 21, 30, 31]
