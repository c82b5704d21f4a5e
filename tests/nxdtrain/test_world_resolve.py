"""Under torchrun/srun (no launcher resolved --resume): rank 0 reads the tag's headers and state, the others take
its answer through the process group, and a refusal on rank 0 stops every rank with the same message."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nxdtrain.cli import PRELOAD
from nxdtrain.config.options import TrainConfig
from nxdtrain.parallel.dist import spawn
from nxdtrain.train import run_worker
from tests.nxdtrain.checkpoint.test_nxd_resume import nxd_tag
from tests.nxdtrain.harness import DIST_TIMEOUT, WORLD_TIMEOUT

# The schedule NxD's fixture tags recorded (their resume refuses another one).
NXD_SCHEDULE = dict(schedule="CosineAnnealing", lr=0.01, min_lr=0.001, warmup=2, decay_steps=10)
RUN = dict(data="synthetic", seq_len=16, gbs=4, mbs=1, precision="fp32", no_checkpoint=True, dist_timeout=DIST_TIMEOUT)


def recording_worker(config: TrainConfig, tag: str, out: str) -> None:
    """``run_worker`` in a torchrun-style process (RANK, WORLD_SIZE, MASTER_* set by spawn, no ``resolved``), with
    the files under ``tag`` that this rank's ``prepare`` opened, and the error it stopped with, written to
    ``out/rank-N.json`` (an error is recorded there instead of raised)."""
    import nxdtrain.train as train_module
    from ckptconv.cli.errors import describe

    rank = os.environ["RANK"]
    opened: list[str] = []
    inside: list[bool] = []

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and inside and isinstance(args[0], (str, os.PathLike)):
            path = os.path.abspath(args[0])
            if path.startswith(tag + os.sep):
                opened.append(os.path.relpath(path, tag))

    sys.addaudithook(hook)  # this worker process only (forked for this world)
    original = train_module.prepare

    def recorded_prepare(*args: Any, **kwargs: Any) -> Any:
        inside.append(True)
        try:
            return original(*args, **kwargs)
        finally:
            inside.pop()

    train_module.prepare = recorded_prepare  # prepare_in_world and train look it up in the module
    error = None
    try:
        train_module.run_worker(config)
    except Exception as exc:  # recorded, not raised: spawn would terminate the other rank before it records its own
        error = " ".join(describe(exc)[0].split())
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"opened": opened, "error": error}))


def run_recorded(nproc: int, tag: Path, out: Path, **options: Any) -> tuple[int, list[dict[str, Any]]]:
    out.mkdir()
    config = TrainConfig.from_flat({"resume": str(tag), **RUN, **options})
    code = spawn(recording_worker, (config, str(tag.resolve()), str(out)), nproc, timeout_s=WORLD_TIMEOUT,
                 preload=PRELOAD)
    return code, [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def tag_files(tag: Path) -> set[str]:
    return {p.relative_to(tag).as_posix() for p in tag.rglob("*") if p.is_file()}


@pytest.mark.parametrize("kind", ["nxd-zero1-masters", "ckptconv-tp2"])
def test_only_rank0_reads_the_tags_headers(tmp_path: Path, nxd_model: Any, kind: str) -> None:
    """A non-zero rank's prepare opens none of the tag's files (before: every file rank 0's opens, per rank); rank 0
    still reads the shards' headers (the hook sees them) and the run trains."""
    if kind == "nxd-zero1-masters":  # NxD's own full tag: headers, optimizer files and training state
        tag, options = nxd_tag("zero1_bf16_masters_only_xser", tmp_path), dict(steps=3, **NXD_SCHEDULE)
    else:  # a converted tp 2 checkpoint: two model shards' headers
        tag = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
        options = dict(steps=1, tp=2)
    code, ranks = run_recorded(2, tag, tmp_path / "out", **options)
    assert code == 0 and [r["error"] for r in ranks] == [None, None]
    shards = {name for name in tag_files(tag) if name.startswith("model/")}
    assert shards and shards <= set(ranks[0]["opened"]), (shards, ranks[0]["opened"])  # rank 0 read every shard
    assert ranks[1]["opened"] == []


def test_a_refusal_on_rank0_stops_every_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged shard that only rank 0 reads: both ranks stop with rank 0's one-line error, at once (not after
    --dist-timeout), and rank 1 opened no file of the tag. The plain worker world exits 1 and prints that line once
    (the process group's rendezvous file, in the same directory as the ranks' messages, is not taken for one)."""
    tag = nxd_tag("zero1_bf16_masters_only_xser", tmp_path)
    damaged = tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    damaged.write_bytes(b"not a checkpoint")
    started = time.monotonic()
    code, ranks = run_recorded(2, tag, tmp_path / "out", steps=3, **NXD_SCHEDULE)
    assert code == 0 and time.monotonic() - started < DIST_TIMEOUT  # each worker returned after recording its error
    assert ranks[0]["error"] is not None and ranks[1]["error"] == ranks[0]["error"]
    assert "dp_rank_00_tp_rank_00_pp_rank_00.pt" in ranks[0]["error"], ranks[0]["error"]
    assert ranks[1]["opened"] == []
    config = TrainConfig.from_flat({"resume": str(tag), **RUN, "steps": 3, **NXD_SCHEDULE})
    capsys.readouterr()
    assert spawn(run_worker, (config,), 2, timeout_s=WORLD_TIMEOUT, preload=PRELOAD) == 1
    printed = capsys.readouterr().err.splitlines()[-1]
    assert printed == f"nxdtrain: error: {ranks[0]['error']}"


def failing_rank(fail_on: int, out: str) -> None:
    """Joins a torchrun-style world; rank ``fail_on`` alone fails; every rank records what stop_together raised."""
    from nxdtrain.errors import TrainError
    from nxdtrain.parallel.dist import detect_env, host_group, init_world, stop_together

    env = detect_env()
    init_world(env, DIST_TIMEOUT, "cpu")
    failure = TrainError(f"rank {env.rank}: only this rank's refusal") if env.rank == fail_on else None
    raised = None
    try:
        stop_together(failure, host_group(DIST_TIMEOUT))
    except TrainError as exc:
        raised = str(exc)
    Path(out, f"rank-{env.rank}.json").write_text(json.dumps(raised))


def test_a_refusal_on_another_rank_stops_every_rank(tmp_path: Path) -> None:
    """A rank's own prepare refusing after rank 0's succeeded: every rank raises that rank's message (rank 0 does not
    go on to wait in its first collective for a rank that stopped)."""
    code = spawn(failing_rank, (2, str(tmp_path)), 3, timeout_s=WORLD_TIMEOUT, preload=PRELOAD)
    assert code == 0
    raised = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert raised == ["rank 2: only this rank's refusal"] * 3
